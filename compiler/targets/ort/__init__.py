"""Legalization for target `ort`: rewrites of the exported standard ONNX into what ONNX Runtime's CPU kernels run
fastest (its com.microsoft contrib ops, forms its own graph optimizer fuses).

The passes stay shared; only lowering differs per target. Each step is one file with `apply(model, context) -> int`
(the number of sites it rewrote), run in STEPS order on the exporter's in-memory model before its single save
(targets/onnx_export.lower_to_onnx). The `tensorrt` target never runs them: it keeps the standard form its audit
accepts. What each step measurably buys is in docs/targets.md; steps that did not pay were dropped and are listed
there with their numbers.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from fxllm.compiler.targets.ort import (attention_rotary, group_query_attention, int4_zero_points, int8_kv_cache,
                                        paged_attention, paged_run, skip_rms_norm, split_projections,
                                        untie_quantized_head)
from fxllm.compiler.targets.ort.graph import MS_DOMAIN, remove_unused
from fxllm.errors import UnsupportedModelError
from fxllm.runtime.contract import ModelSpec, TensorSig


@dataclass
class LegalizationContext:
    """What a step may read and change besides the graph: the model's spec and the artifact's signature (a step
    that changes the calling convention, like group-query-attention, rewrites the signature's cache dims)."""

    spec: ModelSpec
    inputs: list[TensorSig]
    outputs: list[TensorSig]
    rewritten: dict[str, int] = field(default_factory=dict)
    # per layer (K scale, V scale), each [kv_heads, head_dim]: the int8-kv-cache step's; None: float caches
    kv_cache_scales: list[tuple[np.ndarray, np.ndarray]] | None = None


@dataclass(frozen=True)
class Step:
    name: str
    apply: Callable[[ir.Model, LegalizationContext], int]


STEPS: tuple[Step, ...] = (
    Step(int4_zero_points.NAME, int4_zero_points.apply),
    Step(untie_quantized_head.NAME, untie_quantized_head.apply),
    Step(group_query_attention.NAME, group_query_attention.apply),
    Step(attention_rotary.NAME, attention_rotary.apply),
    Step(int8_kv_cache.NAME, int8_kv_cache.apply),  # on the final GroupQueryAttention nodes; only when asked for
    Step(paged_run.NAME, paged_run.apply),  # where it applies, paged-attention finds nothing left to rewrite
    Step(paged_attention.NAME, paged_attention.apply),
    Step(split_projections.NAME, split_projections.apply),  # after the steps that read a fused q/k/v whole
    Step(skip_rms_norm.NAME, skip_rms_norm.apply),
)
STEP_NAMES = tuple(step.name for step in STEPS)


def legalize(model: ir.Model, context: LegalizationContext, seconds: dict[str, float] | None = None,
             only: tuple[str, ...] | None = None) -> LegalizationContext:
    """Run the steps (all, or those named in `only`, in STEPS order) on `model` in place; `context.rewritten`
    counts each step's sites and `seconds` (optional) receives each step's time as ort/<step>."""
    from onnx_ir.passes.common import TopologicalSortPass

    unknown = set(only or ()) - set(STEP_NAMES)
    if unknown:
        raise UnsupportedModelError(f"unknown ort legalization step(s) {', '.join(sorted(unknown))} "
                                    f"(available: {', '.join(STEP_NAMES)})")
    for step in STEPS:
        if only is not None and step.name not in only:
            continue
        start = time.perf_counter()
        context.rewritten[step.name] = step.apply(model, context)
        remove_unused(model)
        if seconds is not None:
            seconds[f"ort/{step.name}"] = time.perf_counter() - start
    if any(node.domain == MS_DOMAIN for node in model.graph.all_nodes()):  # also inside the paged form's Ifs
        model.opset_imports.setdefault(MS_DOMAIN, 1)
    TopologicalSortPass()(model)
    return context
