"""Capture: a transformers causal LM → torch.export'ed GraphModule (input_ids, position_ids → logits) + ModelSpec.

Attention is routed through fxllm::attention (registered as a transformers attention implementation), so the graph
holds one attention node per layer and no mask construction. Like transformers' default path, K/V are computed at
the model's KV heads and repeated to the query heads in front of it; the `gqa` pass folds that repeat away.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from fxllm.compiler import ops  # noqa: F401 - registers torch.ops.fxllm.*
from fxllm.compiler.targets.op_support import first_unsupported_node
from fxllm.compiler.program import Program
from fxllm.runtime.contract import INPUT_IDS, LOGITS, POSITION_IDS, ModelSpec, TensorSig
from fxllm.errors import UnsupportedModelError

ATTN_IMPLEMENTATION = "fxllm"
SAMPLE_BATCH, SAMPLE_TOKENS = 2, 8


def _fxllm_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention hook: q [B,Hq,T,D], k/v [B,Hkv,T,D] → ([B,T,Hq,D], None).

    A sliding window is accepted because spec_from_config caps the context at the window, where full causal
    attention is exact; soft-capping changes the math and is refused."""
    if kwargs.get("softcap") or getattr(module.config, "attn_logit_softcapping", None):
        raise UnsupportedModelError(f"{type(module).__name__} uses soft-capped attention, which fxllm cannot express")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    # Faithful to transformers' default attention path, which repeats K/V to every query head (repeat_kv); the
    # `gqa` pass folds the repeat away so attention reads the KV heads directly.
    groups = query.shape[1] // key.shape[1]
    out = torch.ops.fxllm.attention(query, repeat_kv(key, groups), repeat_kv(value, groups), float(scaling))
    return out.transpose(1, 2).contiguous(), None


def repeat_kv(states: torch.Tensor, groups: int) -> torch.Tensor:
    """[B,Hkv,T,D] → [B,Hkv*groups,T,D], head h of the result being KV head h // groups (transformers' repeat_kv)."""
    if groups == 1:
        return states
    batch, heads, tokens, dim = states.shape
    return states[:, :, None, :, :].expand(batch, heads, groups, tokens, dim).reshape(batch, heads * groups, tokens, dim)


def register_attention() -> None:
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, _fxllm_attention)
    # Causality lives inside the op; transformers must not build (and the graph must not contain) a mask.
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, lambda *args, **kwargs: None)


def spec_from_config(config, architecture: str) -> ModelSpec:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    eos = config.eos_token_id
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    max_positions = config.max_position_embeddings
    notes = []
    window = getattr(config, "sliding_window", None)
    if window is not None and getattr(config, "use_sliding_window", True) and window < max_positions:
        # Full causal attention equals windowed attention while the context fits in the window.
        notes.append(f"context capped at the sliding window ({window}) so full causal attention stays exact")
        max_positions = window
    rope = dict(getattr(config, "rope_parameters", None) or {})
    if not rope and getattr(config, "rope_theta", None) is not None:
        rope = {"rope_type": "default", "rope_theta": config.rope_theta}
    return ModelSpec(
        architecture=architecture,
        model_type=config.model_type,
        num_layers=config.num_hidden_layers,
        num_heads=config.num_attention_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        head_dim=head_dim,
        hidden_size=config.hidden_size,
        vocab_size=config.vocab_size,
        max_positions=max_positions,
        rope=rope,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        bos_token_id=config.bos_token_id,
        eos_token_ids=eos_ids,
        pad_token_id=config.pad_token_id,
        notes=notes,
    )


class LogitsForward(torch.nn.Module):
    """The captured calling convention: (input_ids [B,T], position_ids [B,T]) → logits [B,T,V], no cache."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits


@dataclass
class Capture:
    program: Program
    seconds: float


def sample_inputs(batch: int = SAMPLE_BATCH, tokens: int = SAMPLE_TOKENS, vocab: int = 1000) -> tuple:
    input_ids = torch.randint(0, vocab, (batch, tokens), generator=torch.Generator().manual_seed(0))
    position_ids = torch.arange(tokens).expand(batch, tokens).contiguous()
    return input_ids, position_ids


def capture(model: torch.nn.Module) -> Capture:
    """torch.export the model's logits forward with dynamic batch and sequence length."""
    architecture = type(model).__name__
    spec = spec_from_config(model.config, architecture)
    register_attention()
    model.config._attn_implementation = ATTN_IMPLEMENTATION
    start = time.perf_counter()
    batch, tokens = torch.export.Dim("batch"), torch.export.Dim("tokens")
    dynamic = ({0: batch, 1: tokens}, {0: batch, 1: tokens})
    try:
        with torch.no_grad():
            exported = torch.export.export(
                LogitsForward(model), sample_inputs(vocab=spec.vocab_size), dynamic_shapes=dynamic, strict=False
            )
    except UnsupportedModelError:
        raise
    except Exception as exc:
        raise UnsupportedModelError(f"torch.export failed for {architecture}: {type(exc).__name__}: {exc}") from exc
    graph_module = _plain_graph_module(exported.module())
    attention_nodes = [n for n in graph_module.graph.nodes if n.target is torch.ops.fxllm.attention.default]
    if len(attention_nodes) != spec.num_layers:
        raise UnsupportedModelError(
            f"{architecture}: expected {spec.num_layers} fxllm.attention nodes after capture, found "
            f"{len(attention_nodes)} (the model does not route attention through transformers' AttentionInterface)"
        )
    unsupported = first_unsupported_node(graph_module)
    if unsupported is not None:
        raise UnsupportedModelError(
            f"{architecture}: op {unsupported.target} (node '{unsupported.name}') is not understood by any pass or "
            "lowering"
        )
    program = Program(
        graph_module,
        spec,
        inputs=[TensorSig(INPUT_IDS, ("batch", "tokens"), "int64"), TensorSig(POSITION_IDS, ("batch", "tokens"), "int64")],
        outputs=[TensorSig(LOGITS, ("batch", "tokens", spec.vocab_size), "float32")],
        facts={"captured", "fxllm-attention"},
    )
    return Capture(program, time.perf_counter() - start)


def _plain_graph_module(unlifted: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Positional inputs and a flat output tuple, without the unlifted module's pytree codegen and input checks,
    so passes may add inputs and outputs freely."""
    graph = unlifted.graph
    graph._codegen = torch.fx.graph.CodeGen()
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    results = output.args[0]
    output.args = (tuple(results) if isinstance(results, (tuple, list)) else (results,),)
    graph_module = torch.fx.GraphModule(unlifted, graph)
    graph_module.recompile()
    return graph_module
