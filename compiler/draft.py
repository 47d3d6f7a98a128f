"""Draft models for speculative decoding: what `--draft` names, checked before any work, and how each is built.

- a model (HF directory, .gguf, built-in name): compiled through the default pipeline; it must tokenize exactly
  like the target (same vocabulary size, same ids for a probe text), since draft and target probabilities are
  compared token by token;
- `self-int4`: the target itself, quantized (int4, round-to-nearest, group 32: no calibration, so it compiles fast),
  its lm_head too (at batch 1 a small model's float lm_head is a large share of a decode step: a draft must be cheap);
- `self-layers:N`: the target's first N layers plus its final norm and lm_head (early exit);
- `ngram`: no draft model; the runtime proposes continuations of earlier n-gram matches (prompt lookup).
"""

from __future__ import annotations

from dataclasses import dataclass

from fxllm.compiler.pipeline import DEFAULT_PIPELINE
from fxllm.compiler.source_checks import check_supported, declared_vocab_size
from fxllm.compiler.sources import ModelSource
from fxllm.errors import ModelSourceError, PipelineError, UnsupportedModelError
from fxllm.runtime.contract import MAX_SPEC_K

SELF_INT4_PASSES = ",".join(p for p in DEFAULT_PIPELINE if p != "kv-cache") + \
    ",quantize:method=int4-rtn;group_size=32;lm_head=int4,kv-cache"
PROBE_TEXT = "Speculative decoding checks a draft's tokens: ünïcödé, 12345, def f(x): return x ** 2\n\tThe end."


@dataclass(frozen=True)
class DraftSpec:
    mode: str  # "model" | "self-int4" | "self-layers" | "ngram"
    model: str | None = None  # the draft model's source (mode "model")
    layers: int | None = None  # mode "self-layers"

    @property
    def compiled(self) -> bool:
        return self.mode != "ngram"

    def describe(self) -> str:
        return {"model": f"model {self.model}", "self-layers": f"self-layers:{self.layers}"}.get(self.mode, self.mode)


def parse_draft(text: str, k: int) -> DraftSpec:
    if not isinstance(text, str) or isinstance(k, bool) or not isinstance(k, int):
        raise PipelineError(f"draft must be a string and spec_k an integer, got {type(text).__name__} "
                            f"{text!r} and {type(k).__name__} {k!r}")
    if not 1 <= k <= MAX_SPEC_K:
        raise PipelineError(f"--spec-k must be between 1 and {MAX_SPEC_K}, got {k}")
    if not text.strip():  # as a path, '' would be the working directory
        raise PipelineError("--draft is empty; give self-int4, self-layers:N, ngram or a draft model's path")
    if text in ("self-int4", "ngram"):
        return DraftSpec(text)
    if text.startswith("self-layers"):
        _, _, count = text.partition(":")
        if not count.isdigit() or int(count) < 1:
            raise PipelineError(f"--draft self-layers:N needs a layer count N >= 1, got '{text}'")
        return DraftSpec("self-layers", layers=int(count))
    return DraftSpec("model", model=text)


def check_layers(spec: DraftSpec, target_layers: int) -> None:
    if spec.mode == "self-layers" and spec.layers >= target_layers:
        raise PipelineError(f"--draft self-layers:{spec.layers} must keep fewer layers than the target's "
                            f"{target_layers}")


def check_draft_source(target: ModelSource, draft: ModelSource, spec: DraftSpec) -> None:
    """A draft model's source, before any weight loads: one fxllm cannot compile is refused as the draft's (the
    message would otherwise read as the target's), and a vocabulary size its header states that differs from the
    target's at once rather than after the draft's whole compile."""
    try:
        check_supported(draft)
    except (ModelSourceError, UnsupportedModelError) as exc:
        raise type(exc)(f"--draft '{spec.model}': {exc}") from None
    target_vocab, draft_vocab = declared_vocab_size(target), declared_vocab_size(draft)
    if target_vocab is not None and draft_vocab is not None:
        check_same_vocab(target_vocab, draft_vocab, spec.describe())


def check_same_tokenizer(target_tokenizer, draft_tokenizer, draft_name: str) -> None:
    target_ids = target_tokenizer(PROBE_TEXT)["input_ids"]
    draft_ids = draft_tokenizer(PROBE_TEXT)["input_ids"]
    if len(target_tokenizer) != len(draft_tokenizer) or target_ids != draft_ids:
        raise ModelSourceError(
            f"draft '{draft_name}' tokenizes differently from the target (vocabulary {len(draft_tokenizer)} vs "
            f"{len(target_tokenizer)}; probe ids {draft_ids[:8]}... vs {target_ids[:8]}...); speculative decoding "
            "needs the same tokenizer")


def check_same_vocab(target_vocab: int, draft_vocab: int, draft_name: str) -> None:
    if target_vocab != draft_vocab:
        raise ModelSourceError(f"draft '{draft_name}' has {draft_vocab} output logits, the target {target_vocab}; "
                               "speculative decoding compares their distributions token by token")


def truncate_layers(model, layers: int):
    """Keep the first `layers` decoder layers (the final norm and lm_head stay): the self-layers draft."""
    owner, name = _decoder_layers(model)
    setattr(owner, name, getattr(owner, name)[:layers])
    model.config.num_hidden_layers = layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:layers]
    return model


def _decoder_layers(model) -> tuple[object, str]:
    """(module, attribute) of the decoder's layer list: the one ModuleList in the base model with
    config.num_hidden_layers entries (model.layers in Llama-likes, transformer.h in GPT-2 and Falcon,
    gpt_neox.layers, model.decoder.layers in OPT); model.layers first, where it exists."""
    import torch

    decoder = getattr(model, "model", None)
    if isinstance(getattr(decoder, "layers", None), torch.nn.ModuleList):
        return decoder, "layers"
    count = getattr(model.config, "num_hidden_layers", None)
    found = [(module, name) for module in model.base_model.modules() for name, child in module.named_children()
             if isinstance(child, torch.nn.ModuleList) and len(child) == count]
    if len(found) != 1:
        raise PipelineError(f"self-layers drafts need one list of decoder layers; {type(model).__name__} has "
                            f"{len(found)} lists of {count} modules")
    return found[0]
