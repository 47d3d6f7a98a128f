"""What a transformers model is made of, by capability rather than by name: the features fxllm cannot express are
refused before any weight is loaded, naming the feature; the per-layer attention, position and MoE facts of a
captured model are described for the spec (and `fxllm inspect`).

Refused: encoder-decoder models, configs no causal-LM class exists for, layers other than full or sliding-window
attention (chunked attention, state-space/recurrent/linear-attention layers), ALiBi position biases, bidirectional
attention. Everything else is tried: a model whose attention goes through transformers' attention interface (or
calls `scaled_dot_product_attention` with a plain causal mask) is captured, and capture checks what it saw.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

import torch

from fxllm.errors import UnsupportedModelError

ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")
# Config fields that only recurrent / state-space layers have (Mamba, RWKV, xLSTM, Jamba's and Zamba's SSM blocks).
STATE_SPACE_FIELDS = ("state_size", "ssm_state_size", "mamba_d_state", "mamba_d_conv", "time_step_rank",
                      "rescale_every", "attention_hidden_size", "d_state")


def text_config_of(config):
    """The config of the language model itself (a multimodal config's text part; the config itself otherwise)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def causal_lm_class_name(config) -> str | None:
    """The AutoModelForCausalLM class transformers has for this config's model type, or None."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)


def _causal_lm_class_names() -> set[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())


def causal_lm_class(config) -> type | None:
    import transformers

    name = causal_lm_class_name(config)
    return getattr(transformers, name, None) if name else None


def check_capabilities(config, architecture: str) -> None:
    """Refuse, in one line naming the feature, a model fxllm cannot compile; read from the config alone."""
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{architecture} is an encoder-decoder model; fxllm compiles decoder-only "
                                    "causal language models")
    if causal_lm_class_name(config) is None:
        raise UnsupportedModelError(f"{architecture} (model type '{config.model_type}') is not a causal language "
                                    "model: transformers has no AutoModelForCausalLM class for it")
    declared = (getattr(config, "architectures", None) or [None])[0]
    if declared is not None and declared not in _causal_lm_class_names():
        raise UnsupportedModelError(f"{declared} is not a causal language model (its head is not a causal-LM "
                                    "head; an encoder such as BERT attends in both directions)")
    text_config = text_config_of(config)
    for layer, kind in enumerate(getattr(text_config, "layer_types", None) or ()):
        if kind not in ATTENTION_LAYER_TYPES:
            feature = "chunked attention" if "chunk" in str(kind) else "recurrent/state-space layers"
            raise UnsupportedModelError(f"{architecture}: {feature} (layer {layer} is '{kind}'), which fxllm cannot "
                                        "express")
    if any(getattr(text_config, name, None) is not None for name in STATE_SPACE_FIELDS):
        raise UnsupportedModelError(f"{architecture}: recurrent/state-space layers, which fxllm cannot express")
    if _uses_alibi(config):
        raise UnsupportedModelError(f"{architecture}: ALiBi attention (position biases added to the attention "
                                    "scores), which fxllm cannot express")


def _uses_alibi(config) -> bool:
    """ALiBi by the config's own switch (Falcon's `alibi`), or by a modeling module built around ALiBi biases and
    without a switch (Bloom, MPT): a function or method of its own whose name says alibi."""
    if getattr(config, "alibi", None) is not None:
        return bool(config.alibi)
    cls = causal_lm_class(config)
    module = sys.modules.get(cls.__module__) if cls is not None else None
    if module is None:
        return False
    for name, value in vars(module).items():
        if getattr(value, "__module__", None) != module.__name__:
            continue
        names = [name] + ([n for n, _ in inspect.getmembers(value, inspect.isfunction)] if inspect.isclass(value)
                          else [])
        if any("alibi" in n.lower() for n in names):
            return True
    return False


def supports_attention_interface(model: torch.nn.Module) -> bool:
    """Whether the model's attention layers call transformers' attention interface (set attn_implementation)."""
    return bool(getattr(type(model), "_supports_attention_backend", False))


def check_sliding_windows(config, windows: list[int], architecture: str) -> None:
    """A layer the config says slides must have reached the attention op with its window: some models build the
    sliding mask themselves and never pass the window to the attention function, and would silently lose it."""
    text_config = text_config_of(config)
    window = getattr(text_config, "sliding_window", None)
    if not window or getattr(text_config, "use_sliding_window", True) is False:
        return
    layer_types = getattr(text_config, "layer_types", None)
    expected = [kind == "sliding_attention" for kind in layer_types] if layer_types else [True] * len(windows)
    for layer, (slides, seen) in enumerate(zip(expected, windows)):
        if slides and not seen:
            raise UnsupportedModelError(
                f"{architecture}: layer {layer} has a sliding window ({window}) that does not reach transformers' "
                "attention interface (the model masks it itself), which fxllm cannot capture")


# Families whose attention rotates q and k only in sliding-window layers once any layer slides (their modeling code
# says so, not their config: Cohere2Attention rotates when its layer has a window, Exaone4Attention when the model
# has none or the layer slides)
NOPE_FULL_LAYERS = frozenset({"cohere2", "exaone4"})


def describe_layers(model: torch.nn.Module, attention: list[dict[str, Any]],
                    experts: list[dict[str, Any] | None]) -> list[dict[str, Any]]:
    """Per layer: the attention variant as captured (window, softcap, sinks), the position encoding and QK-norm
    as the config and modules say, and the MoE shape; what `fxllm inspect` prints."""
    config = text_config_of(model.config)
    rope = _rope_description(config, attention[0]["head_dim"])
    if rope != "learned positions" and not any("rotary" in type(module).__name__.lower() for module in model.modules()):
        rope = "absolute positions"  # no rotary module at all (gpt_bigcode's learned, ctrl's sinusoidal positions)
    no_rope = getattr(config, "no_rope_layers", None)
    if no_rope is None and config.model_type in NOPE_FULL_LAYERS and any(seen["window"] for seen in attention):
        no_rope = [bool(seen["window"]) for seen in attention]
    layers = []
    for layer, seen in enumerate(attention):
        entry: dict[str, Any] = {"attention": f"sliding {seen['window']}" if seen["window"] else "full"}
        if seen["softcap"]:
            entry["softcap"] = seen["softcap"]
        if seen["sinks"]:
            entry["sinks"] = True
        entry["rope"] = "none" if no_rope is not None and layer < len(no_rope) and not no_rope[layer] else rope
        if seen.get("qk_norm"):
            entry["qk_norm"] = True
        if layer < len(experts) and experts[layer]:
            entry["moe"] = experts[layer]
        layers.append(entry)
    return layers


def _rope_description(config, head_dim: int) -> str:
    """The position encoding as the config states it; `head_dim` as captured (gptj and codegen state a rotary_dim
    and no head size)."""
    if getattr(config, "position_embedding_type", None) == "absolute" or config.model_type in ("gpt2", "opt"):
        return "learned positions"
    rope_parameters = getattr(config, "rope_parameters", None) or {}  # transformers 5 keeps the factor here
    fraction = (getattr(config, "partial_rotary_factor", None) or getattr(config, "rotary_pct", None)
                or (rope_parameters.get("partial_rotary_factor") if isinstance(rope_parameters, dict) else None))
    if fraction is None and getattr(config, "rotary_dim", None):
        fraction = config.rotary_dim / head_dim
    return f"partial {fraction:.0%}" if fraction is not None and fraction < 1 else "full"
