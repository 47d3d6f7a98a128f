"""ONNX Runtime backend: one InferenceSession over the artifact's model, CUDA when available, else all CPU cores."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from fxllm.errors import ArtifactError
from fxllm.runtime import huge_pages
from fxllm.runtime.backend import StepFeeds
from fxllm.runtime.request_validation import MAX_THREADS


def default_providers() -> list[str]:
    import onnxruntime as ort

    available = ort.get_available_providers()
    return [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in available]


def check_providers(providers: list[str] | None) -> list[str] | None:
    """The providers asked for, refused (ArtifactError, one line) when this ONNX Runtime build lacks one: ONNX
    Runtime itself only prints a banner and falls back to the CPU."""
    import onnxruntime as ort

    available = ort.get_available_providers()
    missing = [p for p in providers or () if p not in available]
    if missing:
        raise ArtifactError(f"execution provider {missing[0]} is not in this ONNX Runtime build (it has "
                            f"{', '.join(available)})")
    return providers


def default_threads() -> int:
    """Intra-op threads when none are given: OMP_NUM_THREADS where it is a positive integer (torch's and
    CTranslate2's convention, so one setting bounds every library in the process — e.g. one thread per process when
    several share a machine), else every CPU."""
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    if value.isdigit() and 0 < int(value) <= MAX_THREADS:
        return int(value)
    return os.cpu_count() or 1


class OrtBackend:
    """The Backend protocol (runtime/backend.py) over one ONNX Runtime InferenceSession."""

    name = "onnxruntime"
    allows_empty_selection = True

    def __init__(self, model_path: Path, threads: int | None = None, providers: list[str] | None = None,
                 int8_activations: bool = False, spin: bool = True, aliases: dict[str, str] | None = None,
                 collapse_huge_pages: bool = True):
        """aliases: {output: input} whose memory is one buffer (shared-buffer KV caches): those outputs are bound
        to their input's array, which the step updates in place (ONNX Runtime IOBinding)."""
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads or default_threads()
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
        providers = check_providers(providers) or default_providers()
        on_cpu = collapse_huge_pages and providers == ["CPUExecutionProvider"] and huge_pages.enabled()
        before = huge_pages.anonymous_mappings() if on_cpu else {}
        try:
            self.session = ort.InferenceSession(str(model_path), options, providers=providers)
        except Exception as exc:  # onnxruntime raises its own exception types for bad models
            raise ArtifactError(f"ONNX Runtime cannot load '{model_path}': {exc}") from exc
        # the weights as the session keeps them (prepacked), on 2 MiB pages: runtime/huge_pages.py
        self.huge_page_bytes = huge_pages.collapse_new_mappings(before) if on_cpu else 0
        self.output_names = [o.name for o in self.session.get_outputs()]
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.aliases = dict(aliases or {})
        self._aliased_inputs = {source: output for output, source in self.aliases.items()}
        self._binding = self.session.io_binding()
        self._bound: dict[str, np.ndarray] = {}  # input name → the array it is bound to (kept alive: ids stay valid)
        self._owned: set[str] = set()  # inputs bound to an array of the backend's own (StepFeeds.step copies)
        self._binding_order: list[str] = []  # outputs in the order IOBinding returns them (first bound first)
        self._state: dict[str, np.ndarray] | None = None  # StepFeeds.state of the last call, bound as it was
        self._state_outputs: dict[str, np.ndarray] = {}  # the aliased outputs of that state
        self._given: dict[str, np.ndarray] | None = None  # StepFeeds.outputs of the last call, bound as they were
        self._own_outputs = [name for name in self.output_names if name not in self.aliases]
        self._output_dims = {o.name: list(o.shape) for o in self.session.get_outputs()}
        # the named dims that non-aliased outputs' shapes use, each with the first (input, axis) that fixes it: the
        # KV inputs' dims need no reading on each step
        needed = {d for name, dims in self._output_dims.items() if name not in self.aliases for d in dims}
        self._dim_sources: dict[str, tuple[str, int]] = {}
        for i in self.session.get_inputs():
            for axis, d in enumerate(i.shape):
                if isinstance(d, str) and d in needed:
                    self._dim_sources.setdefault(d, (i.name, axis))
        self._output_dtypes = {o.name: _NUMPY_DTYPES.get(_dtype(o.type)) for o in self.session.get_outputs()}

    def use_session(self, session) -> None:
        """Run on `session` from now on (an InferenceSession of the same model, e.g. one that profiles): bindings
        are made anew on it."""
        self.session, self._binding = session, session.io_binding()
        self._bound, self._binding_order, self._state, self._state_outputs, self._given = {}, [], None, {}, None
        self._owned = set()

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

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        if not self.aliases and not isinstance(feeds, StepFeeds):
            return dict(zip(self.output_names, self.session.run(self.output_names, dict(feeds))))
        return self._run_bound(feeds)

    def _run_bound(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One call with the aliased outputs written into their inputs' arrays. Bindings are kept between calls
        and redone only for an input array that is not the one bound last time (the KV buffers rarely move); the
        `state` of StepFeeds is not even looked at when it is the dict of the previous call (a step's Python runs
        on caches the weights just flushed: 60 lookups cost ~0.1 ms), nor are its `outputs` destinations. Other
        outputs whose shape the inputs determine (logits: [batch, selected, vocab]) are written into arrays
        allocated here, so no output needs fetching from ONNX Runtime after the call (fetching a paged step's 60
        new K/V outputs cost ~1 ms of its ~27, measured)."""
        given = None
        if isinstance(feeds, StepFeeds):
            if feeds.state is not self._state:
                self._bind_inputs(feeds.state)
                self._state = feeds.state
                self._state_outputs = {output: self._bound[source] for output, source in self.aliases.items()
                                       if source in feeds.state}
            self._bind_step(feeds.step)
            outputs = dict(self._state_outputs)
            given = feeds.outputs
        else:
            self._state = None
            self._bind_inputs(feeds)
            outputs = {output: self._bound[source] for output, source in self.aliases.items()}
        if given is not None:
            if given is not self._given:
                for name, array in given.items():
                    self._bind_output(name, array)
            outputs.update(given)
        self._given = given
        dims = {dim: self._bound[name].shape[axis] for dim, (name, axis) in self._dim_sources.items()
                if name in self._bound}
        fetched = []  # outputs left to ONNX Runtime's allocation
        for name in self._own_outputs:
            if given is not None and name in given:
                continue
            shape = _resolve(self._output_dims[name], dims)
            if shape is None or self._output_dtypes[name] is None:
                self._bind_output(name, None)
                fetched.append(name)
            else:
                outputs[name] = np.empty(shape, self._output_dtypes[name])
                self._bind_output(name, outputs[name])
        self.session.run_with_iobinding(self._binding)
        if fetched:
            values = dict(zip(self._binding_order, self._binding.get_outputs()))
            outputs.update({name: values[name].numpy() for name in fetched})
        return outputs

    def _bind_inputs(self, feeds: Mapping[str, np.ndarray]) -> None:
        """Bind each array that is not the one its input is bound to (and an aliased output to the same memory)."""
        for name, array in feeds.items():
            if self._bound.get(name) is not array:
                self._owned.discard(name)
                array = np.ascontiguousarray(array)
                self._binding.bind_input(name, "cpu", 0, array.dtype, array.shape, array.ctypes.data)
                self._bound[name] = array
                if name in self._aliased_inputs:
                    self._bind_output(self._aliased_inputs[name], array)

    def _bind_step(self, step: Mapping[str, np.ndarray]) -> None:
        """A StepFeeds' step inputs (made for this call, never aliased): each is copied into the array of the
        backend's own that its input is bound to when shape and dtype match, else bound anew to a copy. A decode
        step's ids, positions, block tables and logits index keep their shapes from step to step: a contiguous
        SmolLM2 int4 step then binds only its growing attention mask, 105 → 60 µs of its Python (right after a
        model call the binding's Python runs cold)."""
        for name, array in step.items():
            bound = self._bound.get(name)
            if name in self._owned and bound.shape == array.shape and bound.dtype == array.dtype:
                np.copyto(bound, array)
                continue
            owned = np.array(array, order="C")
            self._binding.bind_input(name, "cpu", 0, owned.dtype, owned.shape, owned.ctypes.data)
            self._bound[name] = owned
            self._owned.add(name)

    def _bind_output(self, name: str, array: np.ndarray | None) -> None:
        if array is None:
            self._binding.bind_output(name, "cpu")
        else:
            self._binding.bind_output(name, "cpu", 0, array.dtype, array.shape, array.ctypes.data)
        if name not in self._binding_order:
            self._binding_order.append(name)


_NUMPY_DTYPES = {name: np.dtype(name) for name in ("float32", "float16", "float64", "int64", "int32", "bool")}


def _resolve(dims: list, sizes: dict[str, int]) -> tuple[int, ...] | None:
    """An output's shape from its dims (ints, or dim names the inputs fixed in `sizes`), or None if any is not."""
    shape = []
    for dim in dims:
        if isinstance(dim, int):
            shape.append(dim)
        elif dim in sizes:
            shape.append(sizes[dim])
        else:
            return None
    return tuple(shape)


def _dtype(onnx_type: str) -> str:
    """ONNX Runtime's 'tensor(float)' → the manifest's 'float32'."""
    name = onnx_type.removeprefix("tensor(").removesuffix(")")
    return {"float": "float32", "double": "float64", "float16": "float16", "bfloat16": "bfloat16"}.get(name, name)
