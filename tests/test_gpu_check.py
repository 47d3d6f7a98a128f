"""scripts/gpu_check.sh in its CI-sized CPU mode prints and writes every row (the GPU rows say "no CUDA device"),
with fp32 greedy parity against transformers; and its bandwidth floor counts the real architectures' weights."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

import fxllm
from benchmarks import gpu_check

REPO = Path(fxllm.__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU mode")
def test_gpu_check_cpu_mode_prints_every_row(make_tiny_model, make_torch_artifact, tmp_path):
    # The check builds its own 2-layer model; the tests' tiny Llama has the same shapes, so its compiled torch
    # artifacts (session fixtures) stand in for the check's and only transformers' side runs here.
    work = tmp_path / "work"
    work.mkdir()
    (work / "model-tiny").symlink_to(make_tiny_model("llama"))
    for paged in (False, True):
        (work / f"artifact-tiny-float32{'-paged' if paged else ''}").symlink_to(make_torch_artifact("llama", paged))
    out = tmp_path / "results.md"
    proc = subprocess.run([str(REPO / "scripts" / "gpu_check.sh"), "--out", str(out), "--work", str(work)],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHON": str(Path(os.sys.executable))})
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.with_suffix(".json").read_text())
    names = {(r["section"], r["name"]): r["value"] for r in rows}
    for section, name in names:
        assert f"{section:<8} {name}" in proc.stdout and name in out.read_text()
    assert names[("env", "gpu")] == gpu_check.NO_CUDA and names[("env", "torch")] == torch.__version__
    parity = [r for r in rows if r["section"] == "parity"]
    assert len(parity) == 2 and all(r["identical"] == r["prompts"] == 4 for r in parity), parity
    decode = [name for section, name in names if section == "decode"]
    assert decode == gpu_check.decode_row_names("tiny", gpu_check.CPU_SIZES)
    assert all(names[("decode", name)] == gpu_check.NO_CUDA for name in decode)
    assert "MB read per token" in names[("floor", "tiny batch 1")]


@pytest.mark.parametrize("name", ["smollm2-135m", "llama-3.2-1b"])
def test_bandwidth_floor_counts_the_models_weights(name):
    """bytes_per_token's weight count equals the parameters of the real architecture (the tied embedding once),
    built on the meta device."""
    from transformers import AutoModelForCausalLM

    builder = gpu_check.ModelBuilder.__new__(gpu_check.ModelBuilder)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(builder.config(name))
    parameters = sum(p.numel() for p in model.parameters())  # tied weights are one parameter
    sizes = gpu_check.Sizes(name, (name,), prompt=0, new=0)
    assert gpu_check.bytes_per_token(builder, name, sizes) == 2 * parameters
