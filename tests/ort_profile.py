"""Run an ONNX model once with ONNX Runtime's profiler on: the outputs, and which op types and nodes really ran
(tests that check which branch of a graph's If executed)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def profiled_run(model_file: Path, feeds: dict[str, np.ndarray],
                 profile_dir: Path) -> tuple[dict[str, np.ndarray], set[str], set[str]]:
    """(outputs by name, op types that ran, names of the nodes that ran) of one CPU session.run."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.enable_profiling = True
    options.profile_file_prefix = str(profile_dir / "run")
    session = ort.InferenceSession(str(model_file), options, providers=["CPUExecutionProvider"])
    outputs = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
    with open(session.end_profiling()) as trace:
        events = [event for event in json.load(trace) if event.get("args", {}).get("op_name")]
    return outputs, {event["args"]["op_name"] for event in events}, {event["name"] for event in events}
