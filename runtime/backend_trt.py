"""TensorRT backend: runs an artifact's engine.plan with the same run(feeds) → outputs interface as OrtBackend.

API used (TensorRT 10.x / 11.x): trt.Runtime.deserialize_cuda_engine, ICudaEngine.num_io_tensors /
get_tensor_name / get_tensor_mode / get_tensor_dtype, IExecutionContext.set_input_shape / get_tensor_shape /
set_tensor_address / execute_async_v3(stream handle). Device buffers are torch CUDA tensors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from fxllm.errors import ArtifactError, GenerationError

INSTALL_HINT = "install TensorRT 10.15+ with a CUDA build of torch (pip install 'fxllm[tensorrt]')"


def check_plan_compatibility(recorded: dict[str, Any] | None, installed_version: str,
                             compute_capability: str) -> None:
    """An engine only runs on the TensorRT version and GPU architecture it was built for."""
    if not recorded:
        raise ArtifactError("this artifact has no TensorRT engine: compile it with --target tensorrt, then run "
                            "`fxllm build-engine ARTIFACT` on the GPU machine")
    if recorded["version"] != installed_version:
        raise ArtifactError(f"engine.plan was built with TensorRT {recorded['version']}, this machine has "
                            f"{installed_version}: rebuild it here with `fxllm build-engine ARTIFACT`")
    if recorded["compute_capability"] != compute_capability:
        raise ArtifactError(f"engine.plan was built for GPU compute capability {recorded['compute_capability']} "
                            f"({recorded.get('gpu', '?')}), this GPU is {compute_capability}: rebuild it here with "
                            "`fxllm build-engine ARTIFACT`")


class TrtBackend:
    """The Backend protocol (runtime/backend.py) over a TensorRT engine; host arrays in and out of every call."""

    name = "tensorrt"
    allows_empty_selection = False  # the engine's optimization profile starts `select` at 1

    def __init__(self, directory: Path, manifest: dict[str, Any]):
        try:
            import tensorrt as trt
            import torch
        except ImportError as exc:
            raise ArtifactError(f"the tensorrt backend needs TensorRT: {INSTALL_HINT}") from exc
        if not torch.cuda.is_available():
            raise ArtifactError("the tensorrt backend needs a CUDA GPU; use backend='onnxruntime' here")
        major, minor = torch.cuda.get_device_capability()
        recorded = manifest.get("tensorrt")
        check_plan_compatibility(recorded, trt.__version__, f"{major}.{minor}")
        self.torch = torch
        self.logger = trt.Logger(trt.Logger.WARNING)
        runtime = trt.Runtime(self.logger)
        self.engine = runtime.deserialize_cuda_engine((directory / recorded["plan_file"]).read_bytes())
        if self.engine is None:
            raise ArtifactError("TensorRT could not deserialize engine.plan; rebuild it with `fxllm build-engine`")
        self.context = self.engine.create_execution_context()
        self.stream = torch.cuda.Stream()
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self.input_names = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.output_names = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]
        self.dtypes = {n: _torch_dtype(torch, trt, self.engine.get_tensor_dtype(n)) for n in names}
        self.signature = {n: (str(self.dtypes[n]).removeprefix("torch."), len(self.engine.get_tensor_shape(n)))
                          for n in names}
        self.profile = {name: tuple(tuple(s) for s in shapes) for name, shapes in recorded["profile"].items()}

    @property
    def providers(self) -> list[str]:
        return ["TensorRT"]

    def input_signature(self) -> dict[str, tuple[str, int]]:
        return {name: self.signature[name] for name in self.input_names}

    def output_signature(self) -> dict[str, tuple[str, int]]:
        return {name: self.signature[name] for name in self.output_names}

    def metadata(self) -> dict[str, str]:
        return {}  # a serialized engine keeps no ONNX metadata

    def check_shapes(self, feeds: dict[str, np.ndarray]) -> None:
        """Shapes outside the engine's optimization profile fail inside TensorRT; say which limit, and how to
        raise it, instead."""
        for name, (low, _, high) in self.profile.items():
            shape = feeds[name].shape
            if any(not lo <= dim <= hi for dim, lo, hi in zip(shape, low, high)):
                raise GenerationError(f"input '{name}' has shape {list(shape)}, outside the engine's profile "
                                      f"{list(low)}..{list(high)}; rebuild with `fxllm build-engine` and larger "
                                      "--max-batch/--max-tokens, or send smaller batches")

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        torch = self.torch
        self.check_shapes(feeds)
        keep = []  # device tensors must outlive the asynchronous execution
        with torch.cuda.stream(self.stream):  # copies, allocations and execution ordered on one stream
            for name in self.input_names:
                tensor = torch.from_numpy(np.ascontiguousarray(feeds[name])).to("cuda", self.dtypes[name])
                keep.append(tensor)
                if not self.context.set_input_shape(name, tuple(tensor.shape)):
                    raise GenerationError(f"TensorRT rejected shape {list(tensor.shape)} for input '{name}'")
                self.context.set_tensor_address(name, tensor.data_ptr())
            outputs = {}
            for name in self.output_names:
                shape = tuple(self.context.get_tensor_shape(name))
                outputs[name] = torch.empty(shape, dtype=self.dtypes[name], device="cuda")
                self.context.set_tensor_address(name, outputs[name].data_ptr())
            if not self.context.execute_async_v3(self.stream.cuda_stream):
                raise RuntimeError("TensorRT execution failed")
        self.stream.synchronize()
        # numpy has no bfloat16: a bfloat16 cache comes back as float32 (exact) and goes in again as bfloat16
        return {name: (tensor.float() if tensor.dtype == torch.bfloat16 else tensor).cpu().numpy()
                for name, tensor in outputs.items()}


def _torch_dtype(torch, trt, dtype):
    table = {trt.float32: torch.float32, trt.float16: torch.float16, trt.int64: torch.int64, trt.int32: torch.int32,
             trt.bool: torch.bool, trt.bfloat16: torch.bfloat16}
    return table[dtype]
