"""Capture: a transformers causal LM → torch.export'ed GraphModule (input_ids, position_ids → logits) + ModelSpec.

Attention is routed through fxllm::attention (registered as a transformers attention implementation), so the graph
holds one attention node per layer and no mask construction. Like transformers' default path, K/V are computed at
the model's KV heads and repeated to the query heads in front of it; the `gqa` pass folds that repeat away.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from fxllm.compiler import ops  # noqa: F401 - registers torch.ops.fxllm.*
from fxllm.compiler.model_features import (check_sliding_windows, describe_layers, supports_attention_interface,
                                           text_config_of)
from fxllm.compiler.moe import moe_layer_shapes, register_moe_experts
from fxllm.compiler.patterns import call_arguments, match_repeat_kv
from fxllm.compiler.program import Program
from fxllm.compiler.targets.op_support import first_unsupported_node
from fxllm.runtime.contract import INPUT_IDS, LOGITS, POSITION_IDS, ModelSpec, TensorSig
from fxllm.errors import ModelSourceError, UnsupportedModelError

ATTN_IMPLEMENTATION = "fxllm"
SAMPLE_BATCH, SAMPLE_TOKENS = 2, 8


def _fxllm_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
                     softcap=None, s_aux=None, **kwargs):
    """transformers attention hook: q [B,Hq,T,D], k/v [B,Hkv,T,D] → ([B,T,Hq,D], None).

    The layer's sliding window (keys within W - 1 positions before the query), attention-logit soft-capping (Gemma
    2) and sinks (`s_aux`, one logit per query head: GPT-OSS) are carried on the op; bidirectional attention is
    refused."""
    if getattr(module, "is_causal", True) is False:
        raise UnsupportedModelError(f"{type(module).__name__} uses bidirectional (non-causal) attention, which "
                                    "fxllm cannot express")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    return _attention(query, key, value, float(scaling), int(sliding_window or 0), float(softcap or 0.0),
                      s_aux).transpose(1, 2).contiguous(), None


def _attention(query, key, value, scale: float, window: int = 0, softcap: float = 0.0, sinks=None):
    """fxllm::attention, faithful to transformers' default attention path, which repeats K/V to every query head
    (repeat_kv); the `gqa` pass folds the repeat away so attention reads the KV heads directly."""
    groups = query.shape[1] // key.shape[1]
    return torch.ops.fxllm.attention(query, repeat_kv(key, groups), repeat_kv(value, groups), scale, window,
                                     softcap, sinks)


def _intercepted_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                      enable_gqa=False):
    """Stands in for torch's scaled_dot_product_attention while a model whose attention does not go through
    transformers' interface (Falcon) is captured: plain causal attention becomes fxllm::attention; anything else
    (an explicit mask or bias, non-causal attention) is refused. A K/V head broadcast with expand (multi-query
    models) is read back as the single head it is."""
    if attn_mask is not None or not is_causal:
        raise UnsupportedModelError("the model calls scaled_dot_product_attention with an explicit mask or bias "
                                    "(not plain causal attention), which fxllm cannot express")
    key, value = (_unbroadcast_heads(t) for t in (key, value))
    return _attention(query, key, value, float(scale if scale is not None else query.shape[-1] ** -0.5))


def _unbroadcast_heads(states: torch.Tensor) -> torch.Tensor:
    return states[:, :1] if states.shape[1] > 1 and states.stride(1) == 0 else states


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


@contextmanager
def attention_routed(model: torch.nn.Module) -> Iterator[None]:
    """Inside: every attention layer of `model` calls fxllm::attention. A model whose attention goes through
    transformers' attention interface gets the `fxllm` implementation (and keeps it); one that calls torch's
    scaled_dot_product_attention itself (Falcon) runs its `sdpa` path without a mask, with that function
    intercepted (_intercepted_sdpa) until the context ends."""
    register_moe_experts(model)
    if supports_attention_interface(model):
        register_attention()
        model.config._attn_implementation = ATTN_IMPLEMENTATION
        yield
        return
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    functional = torch.nn.functional
    saved = (model.config._attn_implementation, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"],
             functional.scaled_dot_product_attention)
    model.config._attn_implementation = "sdpa"
    ALL_MASK_ATTENTION_FUNCTIONS["sdpa"] = lambda *args, **kwargs: None
    functional.scaled_dot_product_attention = _intercepted_sdpa
    try:
        yield
    finally:
        model.config._attn_implementation, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"], \
            functional.scaled_dot_product_attention = saved


@contextmanager
def rope_fixed_within_context(model: torch.nn.Module) -> Iterator[None]:
    """Inside: rotary embeddings whose frequencies transformers recomputes from each call's positions (dynamic NTK
    scaling; LongRoPE) keep the ones they were built with, which is exact within the artifact's context.

    The artifact's context is max_position_embeddings (spec.max_positions, which the runtime enforces). Dynamic
    scaling only changes its frequencies past max_position_embeddings, so never there. LongRoPE switches to its
    long factors past original_max_position_embeddings: exact only when that is the whole context; otherwise its
    frequencies depend on the largest position of each call (of the batch, of the prefill chunk), which fxllm
    cannot express, and it is refused naming the feature. Left as they are, both fail inside torch.export
    (a data-dependent branch; an in-place buffer update) with messages that do not name the model's feature."""
    context = getattr(text_config_of(model.config), "max_position_embeddings", None)
    saved = []
    for module in model.modules():
        rope_type = getattr(module, "rope_type", None)
        if isinstance(rope_type, dict):
            fixed = {layer: _fixed_rope_type(module, kind, context, layer) for layer, kind in rope_type.items()}
        elif isinstance(rope_type, str):
            fixed = _fixed_rope_type(module, rope_type, context)
        else:
            continue
        if fixed != rope_type:
            saved.append((module, rope_type))
            module.rope_type = fixed
    try:
        yield
    finally:
        for module, rope_type in saved:
            module.rope_type = rope_type


def _fixed_rope_type(module: torch.nn.Module, rope_type: str, context: int | None, layer: str | None = None) -> str:
    """A rope type under which transformers' rotary forward keeps its initial frequencies, where that is exact
    for positions below `context`; `rope_type` itself when the forward never recomputes them."""
    if "dynamic" in rope_type:
        return "default"
    if rope_type != "longrope":
        return rope_type
    parameters = getattr(module.config, "rope_parameters", None) or {}
    parameters = parameters.get(layer, {}) if layer is not None else parameters
    original = parameters.get("original_max_position_embeddings") or getattr(
        module.config, "original_max_position_embeddings", None)
    if original and context and context <= original:
        return "default"
    raise UnsupportedModelError(
        f"LongRoPE scaling switches to its long factors past position {original}, inside the context of {context} "
        "positions: its frequencies depend on the longest position of each call, which fxllm cannot express")


def spec_from_config(config, architecture: str, kv_heads: int | None = None, generation_config=None,
                     head_dim: int | None = None) -> ModelSpec:
    """The model spec from the config; `kv_heads` and `head_dim` as the captured attention reads them (configs of
    MHA models often have no KV-head field, and some state a count the attention does not use); `generation_config`:
    the checkpoint's generation_config.json, whose end ids end a generation too (special_token_ids)."""
    config = text_config_of(config)
    head_dim = head_dim or getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    bos, eos_ids, pad = special_token_ids(config, generation_config, architecture)
    max_positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if not max_positions:
        raise UnsupportedModelError(f"{architecture}: the config gives no context length (max_position_embeddings)")
    rope = dict(getattr(config, "rope_parameters", None) or {})
    if not rope and getattr(config, "rope_theta", None) is not None:
        rope = {"rope_type": "default", "rope_theta": config.rope_theta}
    return ModelSpec(
        architecture=architecture,
        model_type=config.model_type,
        num_layers=config.num_hidden_layers,
        num_heads=config.num_attention_heads,
        num_kv_heads=kv_heads or getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        head_dim=head_dim,
        hidden_size=config.hidden_size,
        vocab_size=config.vocab_size,
        max_positions=max_positions,
        rope=rope,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        bos_token_id=bos,
        eos_token_ids=eos_ids,
        pad_token_id=pad,
    )


def special_token_ids(config, generation_config, architecture: str) -> tuple[int | None, list[int], int | None]:
    """(bos, end ids, pad) of a checkpoint. The end ids are the config's and then its generation_config.json's, each
    once: an instruct model's end of turn is often only in the latter (Gemma 2's <end_of_turn>, some Llama 3
    snapshots' <|eot_id|>), and transformers' generate stops on it. A pad id outside the vocabulary (old LLaMA
    conversions say -1) means none; a bos or end id outside it is a ModelSourceError, since no artifact naming it
    could be loaded."""
    vocab = config.vocab_size

    def ids(value, where: str) -> list[int]:
        listed = list(value) if isinstance(value, (list, tuple)) else [] if value is None else [value]
        for token in listed:
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab:
                raise ModelSourceError(f"{architecture}: {where} {token!r} is not a token id of the model's "
                                       f"vocabulary (0 to {vocab - 1}); correct it in the checkpoint")
        return listed

    eos = ids(config.eos_token_id, "the config's eos_token_id")
    if generation_config is not None:
        eos += ids(getattr(generation_config, "eos_token_id", None), "generation_config.json's eos_token_id")
    bos = getattr(config, "bos_token_id", None)
    pad = getattr(config, "pad_token_id", None)  # (CodeGen's config has none)
    pad = pad if isinstance(pad, int) and not isinstance(pad, bool) and 0 <= pad < vocab else None
    return (ids(bos, "the config's bos_token_id")[0] if bos is not None else None), list(dict.fromkeys(eos)), pad


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


INPUT_IDS_SIZE = "L['input_ids'].size()[1]"  # torch.export's name for the tokens dim in a guard


def _export_failure(exc: Exception) -> str:
    """Why torch.export refused the model, in one line: a guard on the sequence length or a data-dependent branch
    is named as what the model's code does; anything else is torch's message, shortened."""
    text = " ".join(str(exc).split())
    guard = re.search(r"generated guard (.+?)(?:\. - |\. The error above| Suggested fixes|$)", text)
    if "Constraints violated" in text and guard:
        return ("its forward fixes or bounds the sequence length (torch.export guard: "
                f"{guard.group(1).replace(INPUT_IDS_SIZE, 'tokens')}), e.g. an attention mask or position table "
                "built for a fixed length outside transformers' attention interface; fxllm compiles any length")
    expression = re.search(r"data-dependent expression (.+?) \(unhinted", text) or \
        re.search(r"data-dependent expression (\S+)", text)
    if expression:
        return (f"its forward branches on or sizes tensors by their values (data-dependent: "
                f"{expression.group(1).rstrip('.,')}), which a compiled graph cannot")
    return f"{type(exc).__name__}: {text[:600]}"


def capture(model: torch.nn.Module) -> Capture:
    """torch.export the model's logits forward with dynamic batch and sequence length: one fxllm::attention node
    per layer (with its window, soft-cap and sinks), one fxllm::moe_experts node per mixture-of-experts layer."""
    architecture = type(model).__name__
    vocab_size = text_config_of(model.config).vocab_size
    latent_rank = getattr(text_config_of(model.config), "kv_lora_rank", None)
    if latent_rank:  # DeepSeek-V2/V3, MiniCPM3: its export stops on an in-place slice write, which says nothing
        raise UnsupportedModelError(f"{architecture}: multi-head latent attention (MLA: kv_lora_rank {latent_rank}), "
                                    "which fxllm cannot express yet")
    start = time.perf_counter()
    batch, tokens = torch.export.Dim("batch"), torch.export.Dim("tokens")
    dynamic = ({0: batch, 1: tokens}, {0: batch, 1: tokens})
    try:
        with torch.no_grad(), attention_routed(model), rope_fixed_within_context(model):
            exported = torch.export.export(
                LogitsForward(model), sample_inputs(vocab=vocab_size), dynamic_shapes=dynamic, strict=False
            )
    except UnsupportedModelError as exc:
        raise UnsupportedModelError(f"{architecture}: {exc}") if not str(exc).startswith(architecture) else exc
    except Exception as exc:
        raise UnsupportedModelError(f"torch.export failed for {architecture}: {_export_failure(exc)}") from exc
    graph_module = _plain_graph_module(exported.module())
    attention_nodes = [n for n in graph_module.graph.nodes if n.target is torch.ops.fxllm.attention.default]
    layers = text_config_of(model.config).num_hidden_layers
    if len(attention_nodes) != layers:
        found = len(attention_nodes)
        why = ("more than one attention a layer (e.g. differential attention), which fxllm cannot express"
               if found > layers else
               f"{'the' if found == 0 else 'some layers of the'} model's attention goes neither through "
               "transformers' AttentionInterface nor through scaled_dot_product_attention")
        raise UnsupportedModelError(f"{architecture}: expected {layers} fxllm.attention nodes after capture, found "
                                    f"{found} ({why})")
    attention = [_attention_facts(node) for node in attention_nodes]
    kv_heads = {facts["kv_heads"] for facts in attention}
    if len(kv_heads) != 1:
        raise UnsupportedModelError(f"{architecture}: layers with different KV head counts ({sorted(kv_heads)})")
    head_dims = {facts["head_dim"] for facts in attention}
    if len(head_dims) != 1:
        raise UnsupportedModelError(f"{architecture}: layers with different head sizes ({sorted(head_dims)}), which "
                                    "fxllm's one KV cache layout cannot hold")
    check_sliding_windows(model.config, [facts["window"] for facts in attention], architecture)
    unsupported = first_unsupported_node(graph_module)
    if unsupported is not None:
        raise UnsupportedModelError(
            f"{architecture}: op {unsupported.target} (node '{unsupported.name}') is not understood by any pass or "
            "lowering"
        )
    try:
        spec = spec_from_config(model.config, architecture, kv_heads.pop(), getattr(model, "generation_config", None),
                                head_dim=head_dims.pop())
    except RuntimeError as exc:  # transformers' AmbiguousGlobalPerLayerAttributeError: a per-layer config value
        if "is a per-layer attribute" not in str(exc):
            raise
        name = re.search(r"'(\w+)' is a per-layer attribute", str(exc))
        raise UnsupportedModelError(f"{architecture}: the config's {name.group(1) if name else 'attributes'} may "
                                    "vary across layers (per-layer configs), which fxllm cannot express") from None
    spec.sliding_windows = [facts["window"] for facts in attention] if any(f["window"] for f in attention) else []
    for facts, module in zip(attention, _attention_modules(model)):
        facts["qk_norm"] = any(hasattr(module, name) for name in ("q_norm", "k_norm", "q_layernorm"))
    spec.layers = describe_layers(model, attention, moe_layer_shapes(model, graph_module))
    program = Program(
        graph_module,
        spec,
        inputs=[TensorSig(INPUT_IDS, ("batch", "tokens"), "int64"), TensorSig(POSITION_IDS, ("batch", "tokens"), "int64")],
        outputs=[TensorSig(LOGITS, ("batch", "tokens", spec.vocab_size), "float32")],
        facts={"captured", "fxllm-attention"},
    )
    return Capture(program, time.perf_counter() - start)


def _attention_facts(node: torch.fx.Node) -> dict:
    """What one captured attention node computes: window, soft-cap, sinks, and the KV heads it reads (before the
    repeat to the query heads)."""
    arguments = call_arguments(node)
    key = arguments["k"]
    repeat = match_repeat_kv(key)
    heads = (repeat[0] if repeat else key).meta["val"].shape[1]
    return {"window": int(arguments["window"]), "softcap": float(arguments["softcap"]),
            "sinks": arguments["sinks"] is not None, "kv_heads": int(heads), "head_dim": int(key.meta["val"].shape[-1])}


def _attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's attention modules in layer order (those with q/k projections or a fused qkv), for describing
    them; may be shorter than the layers for unusual models, which then go undescribed."""
    return [m for name, m in model.named_modules()
            if name.endswith(("self_attn", "attention", "attn")) and any(p.dim() >= 2 for p in m.parameters())
            and not any(child.endswith(("self_attn", "attention", "attn")) for child, _ in m.named_children())]


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
