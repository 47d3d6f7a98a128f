"""`fxllm eval`: perplexity over non-overlapping windows of a text, and agreement with a reference model.

Method: tokenize the whole text (no special tokens added beyond what the tokenizer adds by default), keep the first
`max_tokens`, cut into windows of `ctx` tokens; each window is scored independently, every token but the first of a
window is predicted from its window prefix. Perplexity = exp(total NLL / predicted tokens). A text longer than
WHOLE_TEXT_CHARS with `max_tokens` given is tokenized by growing heads instead, until one holds LEAD_MARGIN tokens
more than are kept: the kept ones are then the whole text's (tokenizers split text into words before merging, so a
cut far past them cannot change them), and a 1 GB text costs what its head does.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from fxllm.datasets import WHOLE_TEXT_CHARS
from fxllm.errors import EvaluationError, FxllmError, InvalidArgumentError
from fxllm.progress import progress
from fxllm.runtime.checks import integer, short
from fxllm.runtime.contract import MANIFEST_FILE

DEFAULT_CTX = 512  # window length when none is given (shortened to a model's shorter context)
LEAD_MARGIN = 256  # tokens a head must hold past the kept ones: its cut never reaches them
HEAD_CHARS_PER_TOKEN = 8  # a head's first length, per token wanted; doubled while it holds too few


class Scorer:
    """Full-window logits from either a compiled artifact (ONNX Runtime; the runtime alone; a `--target torch`
    artifact through the torch backend on CPU) or a source model (transformers, fp32; needs the compile extra). Both
    tokenizers have `encode(text)` with special tokens added; `vocab_size` is how many token ids the model scores
    (its embedding's rows)."""

    def __init__(self, model: str | os.PathLike, int8_activations: bool | None = None):
        self.name = str(model)
        if (Path(model) / MANIFEST_FILE).is_file():
            from fxllm.runtime.engine import Engine
            from fxllm.runtime.manifest import load_manifest

            # the backend the artifact was compiled for (Engine.load checks the files again)
            torch_target = load_manifest(model, verify=False).target == "torch"
            self.engine = Engine.load(model, int8_activations=int8_activations,
                                      **({"backend": "torch", "device": "cpu"} if torch_target else {}))
            self.tokenizer = self.engine.tokenizer
            self.max_context = self.engine.max_context
            self.vocab_size = self.engine.spec.vocab_size
            self.kind = "artifact"
        else:
            from fxllm.compiler.sources import load_model, load_tokenizer, resolve_source

            if int8_activations:  # refused, not ignored: transformers runs its own float matmuls
                raise InvalidArgumentError("int8_activations", f"int8_activations (--int8-activations) applies to "
                                           f"quantized artifacts, and '{model}' is not an artifact (a model "
                                           "transformers runs in float)")
            source = resolve_source(model)
            self.model = load_model(source)
            self.tokenizer = load_tokenizer(source)
            self.max_context = self.model.config.max_position_embeddings
            self.vocab_size = self.model.get_input_embeddings().num_embeddings
            self.kind = "transformers"

    def logits(self, token_ids: list[int]) -> np.ndarray:
        if self.kind == "artifact":
            return self.engine.score(token_ids)
        import torch

        with torch.no_grad():
            return self.model(torch.tensor([token_ids])).logits[0].numpy()


@dataclass
class EvalReport:
    """What `fxllm eval` measured. Its floats may be infinite or NaN (a model whose mean NLL is past float range has
    perplexity inf); `to_dict` keeps the JSON strict."""

    model: str
    tokens: int
    windows: int
    ctx: int
    perplexity: float
    reference: str | None = None
    reference_perplexity: float | None = None
    mean_kl: float | None = None
    top1_agreement: float | None = None

    def to_dict(self) -> dict:
        """The report as strict JSON values (what `fxllm eval --json` prints): a non-finite float is null, and
        "non_finite" then maps its field name to "inf", "-inf" or "nan" (the key is absent when every value is
        finite). JSON has no infinity, and Python's json module would write the non-standard `Infinity`."""
        values = asdict(self)
        non_finite = {key: str(value) for key, value in values.items()
                      if isinstance(value, float) and not math.isfinite(value)}
        if non_finite:
            values.update(dict.fromkeys(non_finite), non_finite=non_finite)
        return values

    def text(self) -> str:
        lines = [f"model        {self.model}",
                 f"scored       {self.tokens} tokens in {self.windows} window{'s' * (self.windows != 1)} of {self.ctx}",
                 f"perplexity   {self.perplexity:.4f}"]
        if self.reference:
            lines += [f"reference    {self.reference}: perplexity {self.reference_perplexity:.4f}",
                      f"mean KL      {self.mean_kl:.6f} (reference ‖ model, per token)",
                      f"top-1 agree  {self.top1_agreement:.2%}"]
        return "\n".join(lines)


def _checked(flag: str, param: str, value) -> int:
    """A window length or token limit: an int >= 2 (one token to predict from, one to predict)."""
    try:
        return integer(param, value, minimum=2)
    except InvalidArgumentError:
        raise EvaluationError(f"{flag} must be an integer of at least 2, got {short(value)}") from None


def read_text(text_path: str | os.PathLike) -> str:
    """The evaluation text: a UTF-8 file (a leading byte-order mark dropped), or a named public-domain text
    ('britannica', fetched once)."""
    from fxllm.datasets import dataset_names, dataset_path, utf8_text

    if str(text_path) in dataset_names() and not Path(text_path).exists():
        text_path = dataset_path(str(text_path))
    path = Path(text_path)
    if not str(text_path).strip():
        raise EvaluationError("the text file path is empty")
    if path.is_dir():
        raise EvaluationError(f"'{text_path}' is a directory; --text takes a UTF-8 text file")
    if not path.exists():
        raise EvaluationError(f"text file '{text_path}' does not exist")
    if not path.is_file():  # a FIFO, a device such as /dev/null: read, it would hang or score nothing
        raise EvaluationError(f"'{text_path}' is not a regular file; --text takes a UTF-8 text file")
    try:
        return utf8_text(path.read_bytes())
    except UnicodeDecodeError as exc:
        raise EvaluationError(f"'{text_path}' is not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset "
                              f"{exc.start}); --text takes a UTF-8 text file") from None


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    logits = logits.astype(np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def leading_ids(encode: Callable[[str], list[int]], text: str, count: int | None) -> list[int]:
    """The first `count` token ids of the text (None: all of them), as encoding it whole gives them; see the module
    docstring for a long text."""
    if count is None or len(text) <= WHOLE_TEXT_CHARS:
        return encode(text)[:count]
    chars = (count + LEAD_MARGIN) * HEAD_CHARS_PER_TOKEN
    while chars < len(text):
        ids = encode(text[:chars])
        if len(ids) >= count + LEAD_MARGIN:
            return ids[:count]
        chars *= 2
    return encode(text)[:count]


def _check_reference(reference: str | os.PathLike) -> None:
    """A reference that names no artifact or model source is refused before the model loads (a source model takes
    15-20 s), in words that name --reference: its errors read as the model's."""
    from fxllm.errors import ArtifactError, ModelSourceError

    if not str(reference).strip():  # as a path, '' would be the working directory
        raise ModelSourceError("--reference: the model path is empty; give an artifact or a model (a path or a "
                               "built-in name)")
    try:
        if (Path(reference) / MANIFEST_FILE).is_file():
            from fxllm.runtime.manifest import load_manifest

            load_manifest(reference, verify=False)
        else:
            from fxllm.compiler.sources import resolve_source

            resolve_source(reference)
    except (ArtifactError, ModelSourceError) as exc:
        raise type(exc)(f"--reference: {exc}") from None


def evaluate(model: str | os.PathLike | Scorer, text_path: str | os.PathLike, ctx: int | None = None,
             max_tokens: int | None = None, reference: str | None = None,
             int8_activations: bool | None = None) -> EvalReport:
    """Perplexity of `model` (a path or name, or a ready Scorer, whose subclasses may score another runtime's
    model) on a UTF-8 text file (or a named public-domain text: 'britannica'). ctx: an int >= 2 and at most the
    context of the model and of the reference (EvaluationError, before any window is scored); None: DEFAULT_CTX, or
    the shorter of those contexts. max_tokens: None (the whole text) or an int >= 2. The arguments and the text are
    checked before any model is loaded: EvaluationError."""
    if ctx is not None:
        ctx = _checked("--ctx", "ctx", ctx)
    if max_tokens is not None:
        max_tokens = _checked("--max-tokens", "max_tokens", max_tokens)
    text = read_text(text_path)
    if reference is not None:
        _check_reference(reference)
    scorer = model if isinstance(model, Scorer) else Scorer(model, int8_activations)
    ref = Scorer(reference) if reference is not None else None  # '' is refused as a path, not dropped
    ctx = _window_length(ctx, scorer, ref)
    ids = leading_ids(scorer.tokenizer.encode, text, max_tokens)
    if len(ids) < 2:
        raise EvaluationError(f"'{text_path}' has fewer than 2 tokens; nothing to score")
    if ref is not None and leading_ids(ref.tokenizer.encode, text, len(ids)) != ids:
        raise FxllmError("the reference tokenizes the text differently; KL and agreement need identical tokens")
    for role, which in (("the model", scorer), ("the reference", ref)):
        vocab_size = getattr(which, "vocab_size", None)  # a Scorer subclass scoring another runtime may not say
        bad = next((token for token in ids if vocab_size is not None and token >= vocab_size), None)
        if bad is not None:
            raise EvaluationError(f"the text tokenizes to id {bad}, outside the vocabulary of {role} '{which.name}' "
                                  f"(0 to {vocab_size - 1}): its tokenizer does not match it")

    nll = ref_nll = kl = 0.0
    agree = predicted = 0
    windows = [ids[start:start + ctx] for start in range(0, len(ids), ctx) if len(ids[start:start + ctx]) >= 2]
    for window in progress(windows, desc="eval", unit="window"):
        targets = np.asarray(window[1:])
        logp = _log_softmax(scorer.logits(window)[:-1])
        nll -= logp[np.arange(len(targets)), targets].sum()
        predicted += len(targets)
        if ref is not None:
            ref_logp = _log_softmax(ref.logits(window)[:-1])
            if ref_logp.shape != logp.shape:  # e.g. a vocabulary padded to a multiple of 64 on one side only
                raise EvaluationError(f"the reference scores {ref_logp.shape[-1]} token ids and the model "
                                      f"{logp.shape[-1]}; KL and agreement need the same vocabulary")
            ref_nll -= ref_logp[np.arange(len(targets)), targets].sum()
            kl += (np.exp(ref_logp) * (ref_logp - logp)).sum()
            agree += int((ref_logp.argmax(-1) == logp.argmax(-1)).sum())
    report = EvalReport(scorer.name, predicted, len(windows), ctx, _perplexity(nll / predicted))
    if ref is not None:
        report.reference = str(reference)
        report.reference_perplexity = _perplexity(ref_nll / predicted)
        report.mean_kl = kl / predicted
        report.top1_agreement = agree / predicted
    return report


def _window_length(ctx: int | None, scorer: Scorer, reference: Scorer | None) -> int:
    """The window length: `ctx`, refused past the model's or the reference's context (an artifact's scorer refuses a
    longer window only when it gets there, after the windows before it; a transformers model would score past the
    positions it was trained for); None: DEFAULT_CTX, shortened to the shorter context."""
    limits = [("model", scorer)] + ([("reference", reference)] if reference is not None else [])
    if ctx is None:
        return min([DEFAULT_CTX] + [limit.max_context for _, limit in limits])
    for role, limit in limits:
        if ctx > limit.max_context:
            raise EvaluationError(f"--ctx {ctx} exceeds the {role}'s context of {limit.max_context} tokens")
    return ctx


def _perplexity(mean_nll: float) -> float:
    """exp(mean NLL), inf past float range (a broken model's, rather than an OverflowError)."""
    return math.exp(mean_nll) if mean_nll < 709.0 else math.inf
