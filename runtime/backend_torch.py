"""The torch backend: runs a `torch`-target artifact's model.pt2 (a torch.export program of ATen ops only) with
PyTorch on CPU or CUDA, optionally through torch.compile.

It implements the Backend protocol (runtime/backend.py) with one difference in what `run` returns: logits come back
as a host numpy array (the sampler's input), while the KV outputs (present_* / new_*) stay on the device as torch
tensors. Fed back as inputs (the device caches of runtime/device_cache.py do that), they are used in place, so the
KV cache never travels through host memory between steps. Numpy inputs (token ids, positions, masks, block tables)
are copied to the device each step; they are a few integers per row.

torch is imported when a backend is made, never at import: the ONNX Runtime path stays torch-free.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fxllm.errors import ArtifactError, MissingDependencyError
from fxllm.runtime.contract import CONTRACT_METADATA_KEY, LOGITS, parse_cache_name
from fxllm.runtime.manifest import Manifest
from fxllm.runtime.pt2_archive import check_no_pickled_code

TORCH_HINT = "install torch (`pip install 'fxllm[compile]'` brings it; a CUDA build of torch for device='cuda')"


def import_torch():
    try:
        import torch
    except ImportError as exc:
        raise MissingDependencyError(f"backend 'torch' needs PyTorch, which is not installed: {TORCH_HINT}") from exc
    return torch


def resolve_device(torch, device: str):
    """torch.device for 'cpu', 'cuda' or 'cuda:N', refused with one line when this machine cannot run it."""
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ArtifactError(f"unknown device '{device}' for backend 'torch' (use 'cpu', 'cuda' or 'cuda:N')") from exc
    if resolved.type not in ("cpu", "cuda"):
        raise ArtifactError(f"backend 'torch' runs on 'cpu' or 'cuda', not '{device}'")
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ArtifactError(f"device '{device}' needs a CUDA GPU and a CUDA build of torch; this machine has none "
                                f"(torch {torch.__version__}); use device='cpu'")
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise ArtifactError(f"device '{device}' does not exist: this machine has {torch.cuda.device_count()} "
                                "CUDA device(s)")
    return resolved


class TorchBackend:
    """The Backend protocol over a torch.export program; KV outputs stay on `device` (see the module docstring)."""

    name = "torch"
    allows_empty_selection = False  # torch.export's dynamic sizes start at 1

    def __init__(self, manifest: Manifest, device: str = "cpu", compile: bool = False, threads: int | None = None):
        if manifest.target != "torch":
            raise ArtifactError(f"backend 'torch' runs artifacts compiled with --target torch; "
                                f"'{manifest.directory}' was compiled for target '{manifest.target}' "
                                f"({manifest.model_file.name}): recompile it with --target torch, or load it with "
                                "backend='onnxruntime'")
        torch = import_torch()
        self.torch = torch
        self.device = resolve_device(torch, device)
        if threads:
            torch.set_num_threads(threads)
        check_no_pickled_code(torch, manifest.model_file)
        extra = {CONTRACT_METADATA_KEY: ""}
        try:
            exported = torch.export.load(str(manifest.model_file), extra_files=extra)
        except Exception as exc:  # torch raises many kinds of errors for a bad or foreign archive
            raise ArtifactError(f"torch cannot load '{manifest.model_file.name}': {type(exc).__name__}: "
                                f"{str(exc).splitlines()[0] if str(exc) else ''} (was it written by another torch "
                                "version? recompile the artifact with this one)") from exc
        self._metadata = {k: v for k, v in extra.items() if v}
        self.input_names = [spec.arg.name for spec in exported.graph_signature.input_specs
                            if spec.kind.name == "USER_INPUT"]
        self.output_names = [sig.name for sig in manifest.io.outputs]
        self._signatures = _signatures(exported, self.input_names, self.output_names)
        self.float_dtype = getattr(torch, manifest.spec.dtype)
        self.module = program_on_device(torch, exported, self.device)
        self.compiled = bool(compile)
        if compile:
            self.module = torch.compile(self.module, dynamic=True)

    @property
    def providers(self) -> list[str]:
        return [f"torch:{self.device}" + (" (torch.compile)" if self.compiled else "")]

    def input_signature(self) -> dict[str, tuple[str, int]]:
        return {name: self._signatures[name] for name in self.input_names}

    def output_signature(self) -> dict[str, tuple[str, int]]:
        return {name: self._signatures[name] for name in self.output_names}

    def metadata(self) -> dict[str, str]:
        """The contract digest lowering stored in the archive ({} for an archive without one)."""
        return dict(self._metadata)

    def run(self, feeds: dict[str, Any]) -> dict[str, Any]:
        """One forward call. Feeds: numpy arrays or torch tensors (device KV caches, used in place). → logits as a
        float32 numpy array, every KV output as a torch tensor on the device."""
        torch = self.torch
        arguments = [self._tensor(name, feeds[name]) for name in self.input_names]
        with torch.inference_mode():
            results = self.module(*arguments)
        outputs: dict[str, Any] = {}
        for name, value in zip(self.output_names, results):
            outputs[name] = value.float().cpu().numpy() if name == LOGITS else value
        return outputs

    def _tensor(self, name: str, value: Any):
        torch = self.torch
        if isinstance(value, torch.Tensor):
            tensor = value if value.device == self.device else value.to(self.device)
        else:
            tensor = torch.from_numpy(np.ascontiguousarray(value)).to(self.device, non_blocking=True)
        if parse_cache_name(name) is not None and tensor.dtype != self.float_dtype:
            tensor = tensor.to(self.float_dtype)
        return tensor

    # -- device-resident KV storage for the model runner --------------------------------------------------------

    def new_contiguous_cache(self, layers: int, batch: int, kv_heads: int, head_dim: int):
        from fxllm.runtime.device_cache import TorchContiguousCache

        return TorchContiguousCache.empty(layers, batch, kv_heads, head_dim, self.device, self.float_dtype)

    def new_paged_pool(self, layers: int, blocks: int, block_size: int, kv_heads: int, head_dim: int):
        from fxllm.runtime.device_cache import TorchPagedPool

        return TorchPagedPool(layers, blocks, block_size, kv_heads, head_dim, self.device, self.float_dtype)


def program_on_device(torch, exported, device):
    """The program as a callable module on `device`. Lowering ran on CPU and torch.export burns that device into
    the graph (`arange(..., device=cpu)` in the masks); torch.export.passes.move_to_device_pass moves the weights
    and rewrites those arguments."""
    from torch.export.passes import move_to_device_pass

    return move_to_device_pass(exported, str(device)).module()


def _signatures(exported, input_names: list[str], output_names: list[str]) -> dict[str, tuple[str, int]]:
    """{name: (dtype, rank)} from the program's placeholders and output values (outputs in the manifest's order:
    a torch.export program does not name them)."""
    values = {node.name: node.meta.get("val") for node in exported.graph.nodes if node.op == "placeholder"}
    output = next(node for node in exported.graph.nodes if node.op == "output")
    results = [node.meta.get("val") for node in output.args[0]]
    if len(results) != len(output_names):
        raise ArtifactError(f"the program returns {len(results)} outputs, the manifest names {len(output_names)}; "
                            "recompile the artifact")
    signatures = {}
    for name, value in [(n, values.get(n)) for n in input_names] + list(zip(output_names, results)):
        signatures[name] = (str(value.dtype).removeprefix("torch."), value.dim()) if value is not None else ("?", -1)
    return signatures
