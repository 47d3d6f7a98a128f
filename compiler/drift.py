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


def compare_logits(reference: torch.Tensor, logits: torch.Tensor) -> Drift:
    reference, logits = reference.double(), logits.double()
    ref_logp = torch.log_softmax(reference, -1)
    logp = torch.log_softmax(logits, -1)
    kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1).mean()
    agree = (reference.argmax(-1) == logits.argmax(-1)).double().mean()
    return Drift(float((reference - logits).abs().max()), float(kl.clamp_min(0)), float(agree))

