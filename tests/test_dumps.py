"""--dump-dir writes readable per-pass graphs, op histograms, timings, drift and a summary."""

from __future__ import annotations

import json

import fxllm


def test_dump_files(make_tiny_model, tmp_path):
    dumps = tmp_path / "dumps"
    fxllm.compile(make_tiny_model("llama"), tmp_path / "artifact", dump_dir=dumps)
    names = {p.name for p in dumps.iterdir()}
    for stem in ("01_cleanup", "02_gqa", "03_fuse-projections", "04_select-logits", "05_kv-cache"):
        assert {f"{stem}.before.txt", f"{stem}.after.txt", f"{stem}.ops.txt", f"{stem}.report.json"} <= names
    assert {"00_captured.txt", "summary.txt", "summary.json"} <= names

    after = (dumps / "05_kv-cache.after.txt").read_text()
    assert "fxllm.masked_attention" in after and "past_key_0" in after and "f32[" in after
    assert "fxllm.masked_attention" not in (dumps / "05_kv-cache.before.txt").read_text()
    histogram = (dumps / "05_kv-cache.ops.txt").read_text()
    assert "+2  fxllm.masked_attention.default" in histogram and "-2  fxllm.attention.default" in histogram
    report = json.loads((dumps / "05_kv-cache.report.json").read_text())
    assert report["seconds"] > 0 and report["drift_vs_captured"]["greedy_agreement"] == 1.0
    assert report["drift_vs_captured"]["max_abs_logit"] <= 1e-5
    summary = (dumps / "summary.txt").read_text()
    assert "cleanup" in summary and "kv-cache" in summary and "max|Δlogit|" in summary
