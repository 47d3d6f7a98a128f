"""ONNX Runtime backend: one InferenceSession over the artifact's model, CUDA when available, else all CPU cores."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from fxllm.errors import ArtifactError


def default_providers() -> list[str]:
    import onnxruntime as ort

    available = ort.get_available_providers()
    return [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in available]


class OrtBackend:
    name = "onnxruntime"

    def __init__(self, model_path: Path, threads: int | None = None, providers: list[str] | None = None):
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads or os.cpu_count() or 1
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.log_severity_level = 3
        # ORT fuses DequantizeLinear → MatMul into MatMulNBits; its default accuracy level quantizes activations to
        # int8, which would add error the compiler's drift report never saw. Level 0 keeps float activations.
        options.add_session_config_entry("session.qdq_matmulnbits_accuracy_level",
                                         os.environ.get("FXLLM_ORT_ACCURACY_LEVEL", "0"))
        try:
            self.session = ort.InferenceSession(str(model_path), options, providers=providers or default_providers())
        except Exception as exc:  # onnxruntime raises its own exception types for bad models
            raise ArtifactError(f"ONNX Runtime cannot load '{model_path}': {exc}") from exc
        self.output_names = [o.name for o in self.session.get_outputs()]
        self.input_names = [i.name for i in self.session.get_inputs()]

    @property
    def providers(self) -> list[str]:
        return self.session.get_providers()

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(zip(self.output_names, self.session.run(self.output_names, feeds)))
