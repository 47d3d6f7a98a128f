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
    """The Backend protocol (runtime/backend.py) over one ONNX Runtime InferenceSession."""

    name = "onnxruntime"

    def __init__(self, model_path: Path, threads: int | None = None, providers: list[str] | None = None,
                 int8_activations: bool = False, spin: bool = True, aliases: dict[str, str] | None = None):
        """aliases: {output: input} whose memory is one buffer (shared-buffer KV caches): those outputs are bound
        to their input's array, which the step updates in place (ONNX Runtime IOBinding)."""
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads or os.cpu_count() or 1
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.log_severity_level = 3
        if not spin:
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        # int8 activations: ORT fuses DequantizeLinear → MatMul into MatMulNBits at accuracy level 4, which
        # quantizes the activations to int8 per block (fast int8 dot products; what onnxruntime-genai uses on CPU).
        # Float activations (the math of the compiler's drift report): MatMulNBits at level 0 ran SmolLM2's int4
        # steps 6.6x slower than float32 weights, so instead the quantized weights are dequantized once, when the
        # session loads (constant folding, which ORT skips for DequantizeLinear unless its QDQ handling is off):
        # float32 speed and float32 memory at run time, the quantized file on disk (docs/quantization.md).
        if int8_activations:
            options.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "4")
        else:
            options.add_session_config_entry("session.disable_quant_qdq", "1")
        try:
            self.session = ort.InferenceSession(str(model_path), options, providers=providers or default_providers())
        except Exception as exc:  # onnxruntime raises its own exception types for bad models
            raise ArtifactError(f"ONNX Runtime cannot load '{model_path}': {exc}") from exc
        self.output_names = [o.name for o in self.session.get_outputs()]
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.aliases = dict(aliases or {})
        self._binding = self.session.io_binding() if self.aliases else None
        self._bound: dict[str, tuple] = {}  # input name → (address, shape, dtype) it is bound to
        self._binding_order: list[str] = []  # outputs in the order IOBinding returns them (first bound first)

    @property
    def providers(self) -> list[str]:
        return self.session.get_providers()

    def input_signature(self) -> dict[str, tuple[str, int]]:
        """{name: (dtype, rank)} of the model's inputs, dtypes spelled as in the manifest (int64, float32...)."""
        return {i.name: (_dtype(i.type), len(i.shape)) for i in self.session.get_inputs()}

    def output_signature(self) -> dict[str, tuple[str, int]]:
        return {o.name: (_dtype(o.type), len(o.shape)) for o in self.session.get_outputs()}

    def metadata(self) -> dict[str, str]:
        """The model file's custom metadata (lowering records the contract digest there)."""
        return dict(self.session.get_modelmeta().custom_metadata_map)

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self._binding is None:
            return dict(zip(self.output_names, self.session.run(self.output_names, feeds)))
        return self._run_bound(feeds)

    def _run_bound(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One call with the aliased outputs written into their inputs' arrays. Bindings are kept between calls
        and redone only for an array at a new address or of a new shape (the KV buffers rarely move)."""
        binding = self._binding
        aliased_inputs = {source: output for output, source in self.aliases.items()}
        arrays = {name: np.ascontiguousarray(array) for name, array in feeds.items()}
        for name, array in arrays.items():
            key = (array.__array_interface__["data"][0], array.shape, array.dtype.str)
            if self._bound.get(name) == key:
                continue
            binding.bind_input(name, "cpu", 0, array.dtype, array.shape, key[0])
            self._bound[name] = key
            if name in aliased_inputs:
                self._bind_output(aliased_inputs[name], array)
        for name in self.output_names:
            if name not in self.aliases:
                self._bind_output(name, None)
        self.session.run_with_iobinding(binding)
        values = dict(zip(self._binding_order, binding.get_outputs()))
        outputs = {}
        for name in self.output_names:
            source = self.aliases.get(name)
            outputs[name] = arrays[source] if source is not None else values[name].numpy()
        return outputs

    def _bind_output(self, name: str, array: np.ndarray | None) -> None:
        if array is None:
            self._binding.bind_output(name, "cpu")
        else:
            self._binding.bind_output(name, "cpu", 0, array.dtype, array.shape,
                                      array.__array_interface__["data"][0])
        if name not in self._binding_order:
            self._binding_order.append(name)


def _dtype(onnx_type: str) -> str:
    """ONNX Runtime's 'tensor(float)' → the manifest's 'float32'."""
    name = onnx_type.removeprefix("tensor(").removesuffix(")")
    return {"float": "float32", "double": "float64", "float16": "float16", "bfloat16": "bfloat16"}.get(name, name)
