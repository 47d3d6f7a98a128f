"""AWQ (Lin et al., 2023): protect the weights that meet large activations by scaling input channels before
quantization, W' = W·diag(s), x' = x / s (folded into the op that produces x), then search per-group clipping.

Scale search: s = mean|x|^α / mean|Ŵ|^(1-α) per input channel (Ŵ: |W| normalised per group), α on a grid over
[0, 1), normalised so that √(max·min) = 1; the α whose quantized layer output is closest to the float output wins
(s = 1, plain round-to-nearest, is a candidate too, so the search never does worse than RTN on its sample).
Clipping search: per (output channel, group), shrink the largest |w| by a ratio in [min_clip, 1] and keep the one
minimizing that group's output error.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fxllm.compiler.quant.numerics import (Grid, QuantFormat, Quantized, dequantize_codes, expand_scales, group_absmax,
                                          group_range, grid_from_range, quantize_column, quantize_to_grid,
                                          round_to_nearest)

Tensor = torch.Tensor


@dataclass(frozen=True)
class ScaleSearch:
    scales: Tensor  # [in]: divide the input by it, multiply the weight's input channels by it
    ratio: float | None  # the chosen α; None when no scaling (s = 1) won
    errors: tuple[float, ...]  # output MSE with s = 1 (errors[0]), then for every α on the grid


def fake_quantize(weight: Tensor, fmt: QuantFormat) -> Tensor:
    """Round-to-nearest quantize then dequantize, W [out, in] → W [out, in]."""
    codes, scales, offsets = round_to_nearest(weight, fmt)
    return dequantize_codes(codes, scales, fmt, offsets)


def normalized_weight_magnitude(weight: Tensor, fmt: QuantFormat) -> Tensor:
    """mean over output channels of |W| / max|W| of its group: [in]."""
    absmax = expand_scales(group_absmax(weight, fmt), fmt, weight.shape[1])
    return (weight.abs() / absmax.clamp_min(1e-10)).mean(0)


def search_scales(inputs: Tensor, weight: Tensor, fmt: QuantFormat, grid: int = 20, max_tokens: int = 2048
                  ) -> ScaleSearch:
    """inputs [n, in] (a calibration sample), W [out, in] → the per-input-channel scale with least output error.
    The activation statistic uses every row; the error is measured on up to max_tokens evenly spaced rows."""
    x = inputs.reshape(-1, inputs.shape[-1]).float()
    x_mean = x.abs().mean(0)
    x = _spread_rows(x, max_tokens)
    reference = x @ weight.t()
    w_mean = normalized_weight_magnitude(weight, fmt)
    best: tuple[float, float | None, Tensor] | None = None
    errors = []
    for step in range(-1, grid):
        ratio = step / grid if step >= 0 else None  # step -1: s = 1, plain round-to-nearest, always a candidate
        if ratio is None:
            scales = torch.ones_like(x_mean)
        else:
            scales = (x_mean.pow(ratio) / w_mean.pow(1 - ratio).clamp_min(1e-4)).clamp_min(1e-4)
            scales = scales / (scales.max() * scales.min()).sqrt()
        quantized = fake_quantize(weight * scales, fmt) / scales
        error = float(((x @ quantized.t() - reference) ** 2).mean())
        errors.append(error)
        if best is None or error < best[0]:
            best = (error, ratio, scales)
    assert best is not None
    return ScaleSearch(best[2], best[1], tuple(errors))


def search_clipping(inputs: Tensor, weight: Tensor, fmt: QuantFormat, grid: int = 20, min_clip: float = 0.5,
                    max_tokens: int = 512) -> Grid:
    """Per (group, output channel) grid after clipping ([groups, out]): the range shrink ratio with least output
    error of that group (x_g · (w_g − q(w_g))) over up to max_tokens calibration rows."""
    x = inputs.reshape(-1, inputs.shape[-1]).float()
    x = _spread_rows(x, max_tokens)
    size = fmt.group_size or weight.shape[1]
    w_groups = weight.split(size, 1)  # each [out, g]
    x_groups = x.split(size, 1)  # each [n, g]
    low, high = (bound.reshape(-1, weight.shape[0]) for bound in group_range(weight, fmt))  # [groups, out]
    best = grid_from_range(low, high, fmt)
    scales, zeros = best.scales.clone(), None if best.zeros is None else best.zeros.clone()
    for g, (w, xg) in enumerate(zip(w_groups, x_groups)):
        best_error = torch.full((weight.shape[0],), float("inf"))
        for step in range(grid):
            ratio = 1 - (1 - min_clip) * step / grid
            candidate = grid_from_range(low[g] * ratio, high[g] * ratio, fmt)
            zero = None if candidate.zeros is None else candidate.zeros[:, None]
            _, q = quantize_column(w, candidate.scales[:, None], zero, fmt)
            error = ((xg @ (w - q).t()) ** 2).mean(0)  # [out]
            better = error < best_error
            best_error = torch.where(better, error, best_error)
            scales[g] = torch.where(better, candidate.scales, scales[g])
            if zeros is not None:
                zeros[g] = torch.where(better, candidate.zeros, zeros[g])
    if not fmt.group_size:
        return Grid(scales[0], None if zeros is None else zeros[0])
    return Grid(scales, zeros)


def _spread_rows(x: Tensor, count: int) -> Tensor:
    return x if len(x) <= count else x[torch.linspace(0, len(x) - 1, count).long()]


def clip_and_quantize(inputs: Tensor, weight: Tensor, fmt: QuantFormat, grid: int = 20) -> Quantized:
    """→ codes [out, in], scales (and offsets) with each group's range clipped where that lowers its output error."""
    return quantize_to_grid(weight, search_clipping(inputs, weight, fmt, grid), fmt)
