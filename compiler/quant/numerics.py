"""Weight-only quantization math shared by every method: grids (scales, zero points), round-to-nearest, errors.

Layout: a weight is handled as W [out, in] (torch's linear layout); groups run along the input dim. Scales are
[groups, out], group g covering input rows [g*group_size, (g+1)*group_size) (the last group may be shorter: ONNX's
blocked DequantizeLinear allows a ragged last block). group_size 0 means one scale per output channel ([out]).

Symmetric formats: w ≈ s·c with signed codes c in [qmin, qmax]. Asymmetric formats (int4 with a zero point z in
[0, 15]): w ≈ s·(u − z) with u in [0, 15]. Both are stored in one form, signed codes plus an optional per-block
offset: c = u − 8 in [−8, 7] and offset = s·(8 − z), so w ≈ s·c + offset. That is exact for every asymmetric grid
and is what both targets lower (DequantizeLinear of the signed code, plus the offset term; see ops.dequant_linear).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from fxllm.compiler.ops import dequantize

Tensor = torch.Tensor
HALF_SUFFIX = "_f16"  # buffers named so hold float16 values in float32; lowering stores them as float16


@dataclass(frozen=True)
class QuantFormat:
    bits: int
    group_size: int  # 0: per output channel
    symmetric: bool = True
    half_scales: bool = False  # scales rounded to float16 values (stored as float16 where the target allows)

    @property
    def scale_bits(self) -> int:
        return 16 if self.half_scales else 32

    @property
    def qmax(self) -> int:
        return 2 ** (self.bits - 1) - 1  # 127 / 7

    @property
    def qmin(self) -> int:
        return -self.qmax if self.bits == 8 else -(2 ** (self.bits - 1))  # int8 symmetric -127; int4 uses -8

    @property
    def levels(self) -> int:
        """Largest unsigned code of an asymmetric grid (15 for 4 bits)."""
        return 2 ** self.bits - 1

    @property
    def code_shift(self) -> int:
        """Unsigned code u is stored as the signed code u − code_shift."""
        return 2 ** (self.bits - 1)

    def groups(self, in_features: int) -> int:
        return 1 if self.group_size == 0 else -(-in_features // self.group_size)

    def bits_per_weight(self, in_features: int, out_features: int, scale_bits: int | None = None) -> float:
        """Bits per weight element: the code, plus each block's scale (and offset when asymmetric), each of
        `scale_bits` (default: the format's scale width; an asymmetric block's offset s·(8 − z) is counted as wide
        as its scale, though it only carries the 4-bit zero point z)."""
        per_block = (scale_bits or self.scale_bits) * (1 if self.symmetric else 2)
        blocks = self.groups(in_features) * out_features if self.group_size else out_features
        return self.bits + per_block * blocks / (in_features * out_features)


class Quantized(NamedTuple):
    codes: Tensor  # [out, in] int8 (signed; int4 range for 4 bits)
    scales: Tensor  # [groups, out] or [out]
    offsets: Tensor | None  # [groups, out] (asymmetric formats) or None


class Grid(NamedTuple):
    scales: Tensor  # [groups, out] or [out]
    zeros: Tensor | None  # integer-valued zero points (asymmetric), same shape; None when symmetric


def _group_reduce(values: Tensor, fmt: QuantFormat, reduce) -> Tensor:
    """[out, in] → per (group, output channel) reduction: [groups, out] ([out] per channel)."""
    if fmt.group_size == 0:
        return reduce(values, 1)
    return torch.stack([reduce(block, 0) for block in values.t().split(fmt.group_size, 0)])


def group_absmax(weight: Tensor, fmt: QuantFormat) -> Tensor:
    """max |W| per (group, output channel): [groups, out] (or [out] per channel)."""
    return _group_reduce(weight.abs(), fmt, lambda t, d: t.amax(d))


def group_range(weight: Tensor, fmt: QuantFormat) -> tuple[Tensor, Tensor]:
    """(min, max) of W per (group, output channel)."""
    return (_group_reduce(weight, fmt, lambda t, d: t.amin(d)), _group_reduce(weight, fmt, lambda t, d: t.amax(d)))


def scales_from_absmax(absmax: Tensor, fmt: QuantFormat) -> Tensor:
    return stored_scales(absmax.clamp_min(1e-10) / fmt.qmax, fmt)


def stored_scales(scales: Tensor, fmt: QuantFormat) -> Tensor:
    """Scales as the format stores them: rounded to float16 values (kept in the input's dtype) for half-scale
    formats, so the codes are chosen against the scales that will really be used."""
    if not fmt.half_scales:
        return scales
    return scales.clamp(2.0 ** -24, 65504.0).to(torch.float16).to(scales.dtype)


def grid_from_range(low: Tensor, high: Tensor, fmt: QuantFormat) -> Grid:
    """The grid covering [low, high] per group: symmetric around 0, or asymmetric with an integer zero point."""
    if fmt.symmetric:
        return Grid(scales_from_absmax(torch.maximum(low.abs(), high.abs()), fmt), None)
    low, high = low.clamp_max(0), high.clamp_min(0)  # the range holds 0, so the zero point is a code in [0, levels]
    scales = stored_scales((high - low).clamp_min(1e-10) / fmt.levels, fmt)
    zeros = torch.round(-low / scales).clamp(0, fmt.levels)
    return Grid(scales, zeros)


def full_range_grid(weight: Tensor, fmt: QuantFormat, shrink: float | Tensor = 1.0) -> Grid:
    """The grid of each group's (optionally shrunk) range: symmetric absmax, or asymmetric min/max."""
    low, high = group_range(weight, fmt)
    return grid_from_range(low * shrink, high * shrink, fmt)


def expand_scales(scales: Tensor, fmt: QuantFormat, in_features: int) -> Tensor:
    """[groups, out] or [out] → [out, in]: the value of every weight element's block."""
    if fmt.group_size == 0:
        return scales[:, None].expand(-1, in_features)
    return scales.repeat_interleave(fmt.group_size, 0)[:in_features].t()


def quantize_to_grid(weight: Tensor, grid: Grid, fmt: QuantFormat) -> Quantized:
    """W [out, in] → signed codes [out, in] (int8 dtype) with their scales and offsets."""
    full = expand_scales(grid.scales, fmt, weight.shape[1])
    if grid.zeros is None:
        codes = torch.round(weight / full).clamp(fmt.qmin, fmt.qmax)
        return Quantized(codes.to(torch.int8), grid.scales, None)
    zeros = expand_scales(grid.zeros, fmt, weight.shape[1])
    codes = torch.round(weight / full + zeros).clamp(0, fmt.levels) - fmt.code_shift
    return Quantized(codes.to(torch.int8), grid.scales, offsets_of(grid, fmt))


def offsets_of(grid: Grid, fmt: QuantFormat) -> Tensor | None:
    """Per-block offset s·(shift − z) that turns signed codes back into the asymmetric grid's values."""
    return None if grid.zeros is None else grid.scales * (fmt.code_shift - grid.zeros)


def quantize_column(column: Tensor, scale: Tensor, zero: Tensor | None, fmt: QuantFormat) -> tuple[Tensor, Tensor]:
    """One input column [out] on its group's grid → (signed codes, dequantized values); GPTQ's inner step."""
    if zero is None:
        q = torch.round(column / scale).clamp(fmt.qmin, fmt.qmax)
        return q, q * scale
    u = torch.round(column / scale + zero).clamp(0, fmt.levels)
    return u - fmt.code_shift, (u - zero) * scale


def mse_grid(weight: Tensor, fmt: QuantFormat, grid_steps: int = 20, min_shrink: float = 0.5, norm: float = 2.4
             ) -> Grid:
    """Per (group, output channel) grid minimizing Σ|w − q(w)|^norm over shrink factors of the full range in
    [min_shrink, 1]: clipping a few large weights buys a finer step for all the others (GPTQ's `mse` option)."""
    best = full_range_grid(weight, fmt)
    best_error = torch.full_like(best.scales, float("inf"))
    for step in range(grid_steps):
        candidate = full_range_grid(weight, fmt, 1 - (1 - min_shrink) * step / grid_steps)
        quantized = quantize_to_grid(weight, candidate, fmt)
        error = (weight - dequantize_codes(quantized.codes, quantized.scales, fmt, quantized.offsets)).abs().pow(norm)
        error = _group_reduce(error, fmt, lambda t, d: t.sum(d))
        better = error < best_error
        best_error = torch.where(better, error, best_error)
        zeros = None if best.zeros is None else torch.where(better, candidate.zeros, best.zeros)
        best = Grid(torch.where(better, candidate.scales, best.scales), zeros)
    return best


def round_to_nearest(weight: Tensor, fmt: QuantFormat) -> Quantized:
    """W [out, in] → codes, scales (and offsets): each group's grid spans its full range."""
    return quantize_to_grid(weight, full_range_grid(weight, fmt), fmt)


def dequantize_codes(codes: Tensor, scales: Tensor, fmt: QuantFormat, offsets: Tensor | None = None) -> Tensor:
    """codes [out, in] → W [out, in], by the same function the graph's dequant_linear uses."""
    return dequantize(codes.t(), scales, fmt.group_size, offsets).t()


def relative_error(reference: Tensor, approximation: Tensor) -> float:
    """‖reference − approximation‖ / ‖reference‖ (Frobenius)."""
    return float((reference - approximation).norm() / reference.norm().clamp_min(1e-12))
