"""Pass `gqa`: attention reads the KV heads directly; optionally regroup the KV heads (MHA → GQA → MQA).

before: attention(q, repeat_kv(k), repeat_kv(v))            (transformers' default path: K/V copied to every head)
→ after: attention(q, k, v) with Hkv < Hq handled natively by the attention op (no Expand/Tile on the K/V path).
With kv_heads=N: K and V projections are mean-pooled over groups of query heads (Ainslie et al., 2023), so the
model has N KV heads and its cache shrinks by the head ratio; this changes the model (see the drift in dumps).
"""

from __future__ import annotations

import torch

from fxllm.compiler.patterns import match_repeat_kv
from fxllm.compiler.pass_registry import register_pass
from fxllm.compiler.program import Program
from fxllm.compiler.projections import ProjectionSlice, rewrite_projection_slices, trace_projection
from fxllm.errors import PipelineError, UnsupportedModelError

fxllm_ops = torch.ops.fxllm
REPEATS = {torch.ops.aten.repeat.default, torch.ops.aten.tile.default, torch.ops.aten.expand.default,
           torch.ops.aten.repeat_interleave.self_int}


@register_pass("gqa", requires=("fxllm-attention",), provides=("native-gqa",),
               forbids=("kv-cache", "native-gqa", "quantized"), exact=lambda options: options.get("kv_heads") is None)
def gqa(program: Program, *, kv_heads: int | None = None) -> Program:
    """Fold K/V head repeats into native grouped-query attention; with kv_heads=N, regroup to N KV heads."""
    attention_nodes = [n for n in program.graph.nodes if n.target is fxllm_ops.attention.default]
    for node in attention_nodes:
        node.update_arg(1, _fold(node.args[1]))
        node.update_arg(2, _fold(node.args[2]))
    program.graph.eliminate_dead_code()
    _check_native(program, attention_nodes)
    if kv_heads is not None:
        _regroup(program, attention_nodes, kv_heads)
    return program


def _fold(node):
    repeat = match_repeat_kv(node)
    return repeat[0] if repeat else node


def _check_native(program: Program, attention_nodes) -> None:
    """Every attention must now see exactly the model's KV heads, and nothing that repeats heads may feed K/V."""
    for node in attention_nodes:
        for name, arg in zip(("k", "v"), node.args[1:3]):
            producer = arg
            if producer.target in REPEATS:
                raise UnsupportedModelError(
                    f"gqa: {name} of attention node '{node.name}' comes from {producer.target} (node "
                    f"'{producer.name}'), a head repeat fxllm cannot fold"
                )
            heads = arg.meta["val"].shape[1] if "val" in arg.meta else None
            if heads is not None and heads != program.spec.num_kv_heads:
                raise UnsupportedModelError(
                    f"gqa: {name} of attention node '{node.name}' has {heads} heads, expected the model's "
                    f"{program.spec.num_kv_heads} KV heads"
                )


def _regroup(program: Program, attention_nodes, kv_heads: int) -> None:
    spec = program.spec
    if kv_heads < 1 or spec.num_heads % kv_heads:
        raise PipelineError(f"gqa: kv_heads={kv_heads} must divide the {spec.num_heads} query heads")
    if kv_heads > spec.num_kv_heads:
        raise PipelineError(
            f"gqa: kv_heads={kv_heads} is more than the model's {spec.num_kv_heads} KV heads; gqa only merges heads"
        )
    if kv_heads == spec.num_kv_heads:
        return
    slices: list[ProjectionSlice] = []
    for node in attention_nodes:
        for arg in node.args[1:3]:
            found = trace_projection(program, arg)
            if found is None:
                raise UnsupportedModelError(
                    f"gqa: cannot find the linear projection that produces '{arg.name}' for attention '{node.name}'"
                )
            _check_head_features(found, arg, node, spec.num_kv_heads * spec.head_dim)
            slices.append(found)
    pool = _pooling_matrix(spec.num_heads, spec.num_kv_heads, kv_heads)
    rewrite_projection_slices(program, slices, lambda rows: _pool_rows(rows, pool, spec.head_dim))
    spec.notes.append(f"gqa: {spec.num_kv_heads} → {kv_heads} KV heads by mean-pooling K/V projections "
                      "(no uptraining: expect a quality drop)")
    if spec.source_num_kv_heads is None:
        spec.source_num_kv_heads = spec.num_kv_heads
    spec.num_kv_heads = kv_heads


def _check_head_features(found: ProjectionSlice, arg, attention, expected: int) -> None:
    """The traced output features must be exactly the KV heads' (heads × head_dim, head-major), the rows the pooling
    regroups. A fused projection laid out per head (GPT-NeoX's q|k|v within each head; Falcon's heads) or cut by
    slicing (Phi-3's qkv) traces back to all its features instead: regrouping those failed with a reshape error
    deep in the pass."""
    features = found.stop - found.start
    if features != expected:
        raise UnsupportedModelError(
            f"gqa: cannot regroup KV heads: '{arg.name}' of attention '{attention.name}' traces back to "
            f"{features} output features of projection '{found.projection.name}', not the {expected} of its KV "
            "heads (a fused projection laid out per head or cut by slicing); compile without kv_heads")


def _pooling_matrix(query_heads: int, kv_heads: int, new_kv_heads: int) -> torch.Tensor:
    """[new, old] weights: new KV head j is the mean, over the query heads of group j, of the KV head each of
    them reads now (query head h reads KV head h // (query_heads / kv_heads))."""
    reads = torch.arange(query_heads) // (query_heads // kv_heads)
    group = torch.arange(query_heads) // (query_heads // new_kv_heads)
    matrix = torch.zeros(new_kv_heads, kv_heads, dtype=torch.float64)
    matrix.index_put_((group, reads), torch.ones(query_heads, dtype=torch.float64), accumulate=True)
    return matrix / matrix.sum(1, keepdim=True)


def _pool_rows(rows: torch.Tensor, pool: torch.Tensor, head_dim: int) -> torch.Tensor:
    """rows [old_heads*head_dim, ...] (output features first) → [new_heads*head_dim, ...]."""
    old = rows.reshape(pool.shape[1], head_dim, *rows.shape[1:]).double()
    return torch.einsum("no,od...->nd...", pool, old).reshape(-1, *rows.shape[1:]).to(rows.dtype)
