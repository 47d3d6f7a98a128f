"""One import namespace: fxllm.* — the repository's folders never become generic top-level modules."""

from __future__ import annotations

import subprocess
import sys


def test_only_fxllm_is_importable_at_top_level(tmp_path):
    code = (
        "import importlib.util, fxllm.compiler, fxllm.passes, fxllm.runtime;"
        "print([m for m in ('compiler', 'passes', 'runtime') if importlib.util.find_spec(m)])"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_runtime_modules_do_not_import_the_compiler(tmp_path):
    """The runtime's own code needs numpy and onnxruntime only (transformers may still pull torch in when the
    tokenizer loads); importing it must not drag in torch through fxllm.compiler."""
    code = "import sys, fxllm.runtime.engine, fxllm.runtime.sampler; print('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "False", proc.stderr
