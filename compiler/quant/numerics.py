"""Symmetric weight-only quantization math shared by every method: scales, round-to-nearest, error measures.

Layout: a weight is handled as W [out, in] (torch's linear layout); groups run along the input dim. Scales are
[groups, out], group g covering input rows [g*group_size, (g+1)*group_size) (the last group may be shorter: ONNX's
blocked DequantizeLinear allows a ragged last block). group_size 0 means one scale per output channel ([out]).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fxllm.compiler.ops import dequantize

Tensor = torch.Tensor


@dataclass(frozen=True)
class QuantFormat:
    bits: int
    group_size: int  # 0: per output channel

    @property
    def qmax(self) -> int:
        return 2 ** (self.bits - 1) - 1  # 127 / 7

    @property
    def qmin(self) -> int:
        return -self.qmax if self.bits == 8 else -(2 ** (self.bits - 1))  # int8 symmetric -127; int4 uses -8

    def groups(self, in_features: int) -> int:
        return 1 if self.group_size == 0 else -(-in_features // self.group_size)


def group_absmax(weight: Tensor, fmt: QuantFormat) -> Tensor:
    """max |W| per (group, output channel): [groups, out] (or [out] per channel)."""
    if fmt.group_size == 0:
        return weight.abs().amax(1)
    columns = weight.abs().t()  # [in, out]
    return torch.stack([block.amax(0) for block in columns.split(fmt.group_size, 0)])


def scales_from_absmax(absmax: Tensor, fmt: QuantFormat) -> Tensor:
    return absmax.clamp_min(1e-10) / fmt.qmax


def mse_scales(weight: Tensor, fmt: QuantFormat, grid: int = 20, min_shrink: float = 0.5, norm: float = 2.4
               ) -> Tensor:
    """Per (group, output channel) scale minimizing Σ|w − q(w)|^norm over shrink factors of the absmax scale in
    [min_shrink, 1]: clipping a few large weights buys a finer step for all the others (GPTQ's `mse` option)."""
    absmax = group_absmax(weight, fmt)
    best_scales = scales_from_absmax(absmax, fmt)
    best_error = torch.full_like(absmax, float("inf"))
    for step in range(grid):
        scales = scales_from_absmax(absmax * (1 - (1 - min_shrink) * step / grid), fmt)
        full = expand_scales(scales, fmt, weight.shape[1])
        error = (weight - torch.round(weight / full).clamp(fmt.qmin, fmt.qmax) * full).abs().pow(norm)
        error = _group_sum(error, fmt)
        better = error < best_error
        best_error = torch.where(better, error, best_error)
        best_scales = torch.where(better, scales, best_scales)
    return best_scales


def _group_sum(values: Tensor, fmt: QuantFormat) -> Tensor:
    """[out, in] → sums per (group, out) ([groups, out]; [out] per channel)."""
    if fmt.group_size == 0:
        return values.sum(1)
    return torch.stack([block.sum(0) for block in values.t().split(fmt.group_size, 0)])


def expand_scales(scales: Tensor, fmt: QuantFormat, in_features: int) -> Tensor:
    """[groups, out] or [out] → [out, in]: the scale of every weight element."""
    if fmt.group_size == 0:
        return scales[:, None].expand(-1, in_features)
    return scales.repeat_interleave(fmt.group_size, 0)[:in_features].t()


def quantize_with_scales(weight: Tensor, scales: Tensor, fmt: QuantFormat) -> Tensor:
    """W [out, in] → integer codes [out, in] (int8 dtype, int4 range when bits=4)."""
    full = expand_scales(scales, fmt, weight.shape[1])
    return torch.round(weight / full).clamp(fmt.qmin, fmt.qmax).to(torch.int8)


def round_to_nearest(weight: Tensor, fmt: QuantFormat) -> tuple[Tensor, Tensor]:
    """W [out, in] → (codes [out, in], scales): the scale of each group maps its largest |w| to qmax."""
    scales = scales_from_absmax(group_absmax(weight, fmt), fmt)
    return quantize_with_scales(weight, scales, fmt), scales


def dequantize_codes(codes: Tensor, scales: Tensor, fmt: QuantFormat) -> Tensor:
    """codes [out, in] → W [out, in], by the same function the graph's dequant_linear uses."""
    return dequantize(codes.t(), scales, fmt.group_size).t()


def relative_error(reference: Tensor, approximation: Tensor) -> float:
    """‖reference − approximation‖ / ‖reference‖ (Frobenius)."""
    return float((reference - approximation).norm() / reference.norm().clamp_min(1e-12))
