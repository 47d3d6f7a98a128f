"""The backend seam: what the model runner needs from whatever executes an artifact's graph.

A backend runs one forward call on host (numpy) arrays named by the contract (runtime/contract.py) and describes
its graph's signature so the manifest can be checked against it before the first step. Where tensors live between
calls (host, device, a device-resident KV pool) is the model runner's and the backend's business, never the
engine's. Implementations: OrtBackend (runtime/backend_ort.py), TrtBackend (runtime/backend_trt.py), TorchBackend
(runtime/backend_torch.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Protocol, runtime_checkable

import numpy as np

from fxllm.errors import ArtifactError
from fxllm.runtime.contract import CONTRACT_METADATA_KEY, contract_digest, signature_mismatch
from fxllm.runtime.manifest import Manifest

BACKENDS = ("onnxruntime", "tensorrt", "torch")


class StepFeeds(Mapping[str, np.ndarray]):
    """One call's feeds in two parts: `step`, the inputs made for this call, and `state`, the KV buffers, a dict its
    owner replaces (never mutates) when a buffer moves. A backend that keeps its bindings between calls may skip
    `state` when it is the very dict of its previous call; any other backend reads it as one mapping.
    `outputs` (optional): host arrays of the right shape that a backend may write those outputs into instead of
    allocating them (the returned dict then holds these arrays), for outputs the caller consumes before its next
    call, such as a paged step's new K/V; the same dict again means the same destinations. A backend may ignore
    it: callers read outputs from the returned dict only."""

    __slots__ = ("step", "state", "outputs")

    def __init__(self, step: dict[str, np.ndarray], state: dict[str, np.ndarray],
                 outputs: dict[str, np.ndarray] | None = None):
        self.step, self.state, self.outputs = step, state, outputs

    def __getitem__(self, name: str) -> np.ndarray:
        return self.step[name] if name in self.step else self.state[name]

    def __iter__(self) -> Iterator[str]:
        yield from self.step
        yield from self.state

    def __len__(self) -> int:
        return len(self.step) + len(self.state)


@runtime_checkable
class Backend(Protocol):
    name: str  # "onnxruntime", "tensorrt", ...
    # a select-logits graph runs with an empty logits_index (a prefill call whose logits nobody reads skips the
    # lm_head); a backend without this attribute is given one position
    allows_empty_selection: bool

    @property
    def providers(self) -> list[str]:
        """The execution providers / devices in use, most preferred first."""

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One forward call: every graph input by name (a dict, or StepFeeds) → every graph output by name."""

    def input_signature(self) -> dict[str, tuple[str, int]]:
        """{name: (dtype, rank)} of the graph's inputs, dtypes spelled as in the manifest (int64, float32...)."""

    def output_signature(self) -> dict[str, tuple[str, int]]:
        """The same for the outputs."""

    def metadata(self) -> dict[str, str]:
        """The model file's custom metadata (lowering records the contract digest there); {} when it has none."""


def load_backend(manifest: Manifest, kind: str = "onnxruntime", threads: int | None = None,
                 providers: list[str] | None = None, int8_activations: bool = False, spin: bool = True,
                 device: str = "cpu", torch_compile: bool = False, huge_pages: bool = True) -> Backend:
    """The artifact's graph on backend `kind`, checked against the manifest (ONNX Runtime: the real signature and
    the recorded contract digest) before it is returned. huge_pages: ONNX Runtime on CPU moves the session's weights
    onto huge pages once loaded (runtime/huge_pages.py)."""
    if kind != "torch" and manifest.target == "torch":
        raise ArtifactError(f"'{manifest.directory}' was compiled with --target torch ({manifest.model_file.name}): "
                            "load it with backend='torch' (device='cpu' or 'cuda')")
    if kind == "onnxruntime" and manifest.spec.dtype == "bfloat16":
        raise ArtifactError(f"'{manifest.directory}' is a bfloat16 artifact, which runs on TensorRT "
                            "(backend='tensorrt'), not on ONNX Runtime (no bfloat16 MatMul on its CPU, no bfloat16 "
                            "in numpy for the caches): compile with --dtype float16 for ONNX Runtime")
    if kind == "onnxruntime":
        from fxllm.runtime.backend_ort import OrtBackend

        backend = OrtBackend(manifest.model_file, threads=threads, providers=providers,
                             int8_activations=int8_activations, spin=spin, aliases=manifest.io.aliases,
                             collapse_huge_pages=huge_pages)
        check_model_matches(manifest, backend)
        return backend
    if kind == "torch":  # a --target torch artifact (model.pt2) on `device`, KV kept there between steps
        from fxllm.runtime.backend_torch import TorchBackend

        backend = TorchBackend(manifest, device=device, compile=torch_compile, threads=threads)
        check_model_matches(manifest, backend)
        return backend
    if kind == "tensorrt":
        from fxllm.runtime.backend_trt import TrtBackend

        return TrtBackend(manifest.directory, manifest.data)
    raise ArtifactError(f"unknown backend '{kind}' (available: {', '.join(BACKENDS)})")


def check_model_matches(manifest: Manifest, backend: Backend) -> None:
    """The model file must be the one the manifest describes: same I/O signature, and (for artifacts that record
    it) the same spec and signature digest it was lowered for. Checked at load, not at the first step."""
    problem = signature_mismatch(manifest.io, backend.input_signature(), backend.output_signature())
    if problem is not None:
        raise ArtifactError(f"'{manifest.model_file.name}' does not match the manifest: {problem}; recompile the "
                            "artifact")
    check_contract_digest(manifest, backend.metadata())


def check_contract_digest(manifest: Manifest, metadata: dict[str, str]) -> None:
    """ArtifactError when the model file's metadata records the digest of another spec or signature than the
    manifest's (an artifact that records none passes)."""
    recorded = metadata.get(CONTRACT_METADATA_KEY)
    if recorded is not None and recorded != contract_digest(manifest.data["spec"], list(manifest.io.inputs),
                                                            list(manifest.io.outputs)):
        raise ArtifactError(f"the manifest's model spec or signature was changed after compilation (it no longer "
                            f"matches '{manifest.model_file.name}'); recompile the artifact")
