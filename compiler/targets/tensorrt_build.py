"""Build a TensorRT engine (engine.plan) for a `tensorrt`-target artifact, on a machine with TensorRT and a GPU.

API used (TensorRT 10.x / 11.x Python API): trt.Builder, Builder.create_network (explicit batch is the only mode since
10.0; NetworkDefinitionCreationFlag.STRONGLY_TYPED (10.1+) for half-precision artifacts; 11.x networks are strongly
typed by default), trt.OnnxParser.parse_from_file, create_builder_config,
IBuilderConfig.builder_optimization_level, create_optimization_profile / IOptimizationProfile.set_shape,
create_timing_cache / set_timing_cache / get_timing_cache().serialize(), IProgressMonitor (10.0+), and
Builder.build_serialized_network.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from fxllm.progress import status
from fxllm.compiler.targets.tensorrt_audit import audit_file, format_findings
from fxllm.errors import FxllmError
from fxllm.runtime.artifact import write_manifest
from fxllm.runtime.contract import MANIFEST_FILE
from fxllm.runtime.manifest import load_manifest

PLAN_FILE = "engine.plan"
TIMING_CACHE = Path(os.environ.get("FXLLM_CACHE", Path.home() / ".cache" / "fxllm")) / "tensorrt-timing.cache"
INSTALL_HINT = ("install TensorRT 10.15+ and a CUDA build of torch on a machine with an NVIDIA GPU "
                "(pip install 'fxllm[tensorrt]'), then run `fxllm build-engine ARTIFACT`")


class TensorRTUnavailable(FxllmError):
    """TensorRT or a CUDA GPU is missing; the ONNX and its audit are still usable."""


def tensorrt_module():
    try:
        import tensorrt as trt  # noqa: PLC0415 - optional dependency
    except ImportError as exc:
        raise TensorRTUnavailable(f"TensorRT is not installed: {INSTALL_HINT}") from exc
    import torch

    if not torch.cuda.is_available():
        raise TensorRTUnavailable(f"no CUDA GPU is visible: {INSTALL_HINT}")
    return trt


def dim_ranges(manifest: dict[str, Any], max_batch: int, max_tokens: int,
               max_blocks: int | None = None) -> dict[str, tuple[int, int, int]]:
    """(min, opt, max) of every symbolic dim an artifact's signature uses; opt is a single-token decode step at half
    the context. `select` (select-logits: positions whose logits are computed) is 1 at prefill/decode and up to
    every new token for scoring and speculative verification; `table` (paged: blocks per sequence) covers the whole
    context; `blocks` (paged: the slice of the pool a step reads, runtime/model_runner.py) ranges up to the pool the
    runtime allocates by default (`max_blocks`, default: the 512 MiB default KV budget, at least one full
    context)."""
    for name, value in (("max_batch", max_batch), ("max_tokens", max_tokens)) + \
            ((("max_blocks", max_blocks),) if max_blocks is not None else ()):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise FxllmError(f"--{name.replace('_', '-')} must be an integer >= 1, got {value!r}")
    context = int(manifest["spec"]["max_positions"])
    ranges = {"batch": (1, 1, max_batch), "tokens": (1, 1, max_tokens), "past": (0, context // 2, context - 1),
              "total": (1, context // 2 + 1, context), "select": (1, 1, max_tokens)}
    pool = next((sig for sig in manifest["io"]["inputs"] if sig["dims"][:1] == ["blocks"]), None)
    if pool is not None:
        from fxllm.runtime.contract import ModelSpec
        from fxllm.runtime.paged_cache import default_num_blocks

        block_size = int(pool["dims"][1])
        per_sequence = -(-context // block_size)
        if max_blocks is None:
            block_bytes = ModelSpec.from_dict(manifest["spec"]).kv_bytes_per_token() * block_size
            max_blocks = default_num_blocks(block_bytes, block_size, context)  # the runtime's default pool
        ranges["table"] = (1, max(1, per_sequence // 2), per_sequence)
        ranges["blocks"] = (1, max_blocks, max_blocks)
    return ranges


def profile_shapes(manifest: dict[str, Any], max_batch: int, max_tokens: int,
                   max_blocks: int | None = None) -> dict[str, tuple[tuple, ...]]:
    """(min, opt, max) shape per input from the artifact's symbolic dims (dim_ranges); a dim no range is known for
    is an error here rather than a failed build."""
    ranges = dim_ranges(manifest, max_batch, max_tokens, max_blocks)
    shapes = {}
    for sig in manifest["io"]["inputs"]:
        unknown = [dim for dim in sig["dims"] if isinstance(dim, str) and dim not in ranges]
        if unknown:
            raise FxllmError(f"input '{sig['name']}' has dims {', '.join(unknown)}, which the TensorRT optimization "
                             "profile does not know; this artifact cannot be built into an engine")
        shapes[sig["name"]] = tuple(
            tuple(dim if isinstance(dim, int) else ranges[dim][i] for dim in sig["dims"]) for i in range(3)
        )
    return shapes


def network_flags(trt, dtype: str) -> int:
    """Half-precision artifacts build a strongly typed network: TensorRT keeps the ONNX's types (half weights and
    activations, float32 norm statistics and logits) instead of choosing precisions itself. TensorRT 11 networks are
    strongly typed by default (the flag may be gone); TensorRT 10 needs the flag (10.1+)."""
    flag = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
    return 1 << int(flag) if dtype != "float32" and flag is not None else 0


def build_engine(artifact: str | os.PathLike, optimization_level: int = 3, max_batch: int = 8,
                 max_tokens: int = 512, max_blocks: int | None = None) -> Path:
    """Parse the artifact's ONNX, build with one optimization profile, write engine.plan and record the TensorRT
    version and GPU compute capability in the manifest. Paged artifacts: the engine takes pools of up to
    `max_blocks` blocks (default: the runtime's default pool)."""
    if isinstance(optimization_level, bool) or optimization_level not in range(6):
        raise FxllmError(f"--optimization-level must be an integer from 0 to 5 (TensorRT's builder levels), got "
                         f"{optimization_level!r}")
    directory = Path(artifact)
    manifest = load_manifest(directory).data
    if manifest["target"] != "tensorrt":
        raise FxllmError(f"'{directory}' was compiled for target '{manifest['target']}'; recompile it with "
                         "--target tensorrt")
    findings = audit_file(directory)
    if findings:
        raise FxllmError(format_findings(findings).replace("\n", "; "))
    trt = tensorrt_module()
    import torch

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(network_flags(trt, manifest["spec"].get("dtype", "float32")))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(directory / manifest["model_file"])):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise FxllmError(f"TensorRT's ONNX parser rejected the model: {errors}")
    config = builder.create_builder_config()
    config.builder_optimization_level = optimization_level
    profile = builder.create_optimization_profile()
    shapes = profile_shapes(manifest, max_batch, max_tokens, max_blocks)
    for name, (low, opt, high) in shapes.items():
        profile.set_shape(name, low, opt, high)
    config.add_optimization_profile(profile)
    cache = config.create_timing_cache(TIMING_CACHE.read_bytes() if TIMING_CACHE.exists() else b"")
    config.set_timing_cache(cache, ignore_mismatch=False)
    config.progress_monitor = _progress_monitor(trt)
    status(f"building TensorRT {trt.__version__} engine (optimization level {optimization_level})")
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise FxllmError("TensorRT failed to build the engine (see the TensorRT log above)")
    TIMING_CACHE.parent.mkdir(parents=True, exist_ok=True)
    TIMING_CACHE.write_bytes(bytes(config.get_timing_cache().serialize()))
    (directory / PLAN_FILE).write_bytes(bytes(plan))
    major, minor = torch.cuda.get_device_capability()
    manifest = json.loads((directory / MANIFEST_FILE).read_text())
    manifest.pop("files", None)
    manifest["tensorrt"] = {"version": trt.__version__, "compute_capability": f"{major}.{minor}",
                            "gpu": torch.cuda.get_device_name(), "plan_file": PLAN_FILE,
                            "optimization_level": optimization_level,
                            "profile": {k: [list(s) for s in v] for k, v in shapes.items()}}
    write_manifest(directory, {k: v for k, v in manifest.items() if k != "format_version"})
    return directory / PLAN_FILE


def _progress_monitor(trt):
    """A trt.IProgressMonitor that prints the builder's phases (TensorRT 10.0+)."""

    class Monitor(trt.IProgressMonitor):
        def __init__(self) -> None:
            trt.IProgressMonitor.__init__(self)

        def phase_start(self, phase_name, parent_phase, num_steps):
            status(f"  tensorrt: {phase_name} ({num_steps} steps)")

        def step_complete(self, phase_name, step):
            return True  # returning False would cancel the build

        def phase_finish(self, phase_name):
            pass

    return Monitor()
