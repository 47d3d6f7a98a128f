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
    """Importing the runtime must not drag in torch (through fxllm.compiler or transformers); test_thin_runtime.py
    checks the whole load/generate/inspect/eval paths in a process where those imports fail."""
    code = "import sys, fxllm.runtime.engine, fxllm.runtime.sampler; print('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "False", proc.stderr
