"""Numeric drift of a Program against the captured model on a fixed sample: what each pass costs in accuracy."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch


SAMPLE_BATCH, SAMPLE_TOKENS = 2, 16


@dataclass(frozen=True)
class Drift:
    max_abs_logit: float
    mean_kl: float  # KL(reference ‖ program) of the next-token distribution, averaged over positions
    greedy_agreement: float  # fraction of positions whose argmax matches the reference

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def drift_sample(vocab_size: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (SAMPLE_BATCH, SAMPLE_TOKENS), generator=torch.Generator().manual_seed(1234))


@dataclass(frozen=True)
class Logits:
    """Logits in float64 with what a comparison reads from them, computed once: the pass manager compares each
    pass's logits with the captured model's and with the previous pass's, so each set is reduced once, not per
    comparison (four float64 log-softmaxes over the vocabulary per pass before, one now)."""

    values: torch.Tensor
    log_probs: torch.Tensor
    probs: torch.Tensor
    greedy: torch.Tensor

    @classmethod
    def of(cls, logits: torch.Tensor) -> Logits:
        values = logits.double()
        log_probs = torch.log_softmax(values, -1)
        return cls(values, log_probs, log_probs.exp(), values.argmax(-1))


def compare_logits(reference: Logits, logits: Logits) -> Drift:
    kl = (reference.probs * (reference.log_probs - logits.log_probs)).sum(-1).mean()
    agree = (reference.greedy == logits.greedy).double().mean()
    return Drift(float((reference.values - logits.values).abs().max()), float(kl.clamp_min(0)), float(agree))
