"""GPTQ (Frantar et al., 2022): quantize W column by column, pushing each column's rounding error onto the columns
not yet quantized through the inverse Hessian of the layer's inputs, so the layer's output error stays small.

Hessian H = 2/n Σ x xᵀ over calibration inputs x [in]. Dampening adds `damp` × mean(diag H) to the diagonal.
With act-order, columns are processed by decreasing diag(H); group scales are then fixed up front from the float
weight ("static groups"), because a group's scale must cover contiguous input rows for ONNX's blocked
DequantizeLinear (act-order with groups formed in processing order would need a per-row group index, g_idx).
Without act-order each group's scale is taken from the already-updated weights when its first column comes up.
Lazy block updates: errors are applied inside a block of `block_size` columns at once, to the rest after the block.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from fxllm.compiler.quant.numerics import QuantFormat, group_absmax, mse_scales, scales_from_absmax

Tensor = torch.Tensor


class HessianAccumulator:
    """Running H = 2/n Σ x xᵀ over batches of inputs [..., in]: products in float32 (fast), the running sum in
    float64 (so long calibration sets don't drift)."""

    def __init__(self, in_features: int):
        self.hessian = torch.zeros(in_features, in_features, dtype=torch.float64)
        self.count = 0

    def add(self, inputs: Tensor) -> None:
        rows = inputs.reshape(-1, inputs.shape[-1]).float()
        total = self.count + rows.shape[0]
        self.hessian *= self.count / total
        self.hessian += (rows.t() @ rows).double() * (2.0 / total)
        self.count = total


def gptq_quantize(weight: Tensor, hessian: Tensor, fmt: QuantFormat, damp: float = 0.01, act_order: bool = True,
                  block_size: int = 128, mse: bool = False) -> tuple[Tensor, Tensor]:
    """W [out, in] and H [in, in] → (codes [out, in] int8, scales [groups, out] or [out]). mse: group scales by
    the clipping search of quant_math.mse_scales instead of the plain absmax."""
    out_features, in_features = weight.shape
    if fmt.group_size and block_size % fmt.group_size:
        block_size = fmt.group_size  # a group's scale is chosen at its first column: groups must not straddle blocks
    W = weight.detach().to(torch.float64).clone()
    H = hessian.detach().to(torch.float64).clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    static = act_order or fmt.group_size == 0
    choose_scales = (lambda w: mse_scales(w, fmt)) if mse else (lambda w: scales_from_absmax(group_absmax(w, fmt), fmt))
    scales = choose_scales(W)  # [groups, out] or [out]
    order = torch.argsort(torch.diag(H), descending=True) if act_order else torch.arange(in_features)
    W, H = W[:, order], H[order][:, order]
    H += damp * torch.mean(torch.diag(H)) * torch.eye(in_features, dtype=H.dtype)
    upper = _upper_cholesky_of_inverse(H)
    group_of = order // fmt.group_size if fmt.group_size else torch.zeros(in_features, dtype=torch.long)
    codes = torch.zeros_like(W)
    with single_thread():
        _quantize_columns(W, upper, codes, scales, group_of, fmt, block_size, static, choose_scales)
    codes = codes[:, torch.argsort(order)]
    return codes.to(torch.int8), scales.to(weight.dtype)


@contextmanager
def single_thread():
    """The column loop is thousands of small ops: threads only add synchronisation (10x slower on a busy 2-core
    machine), so it runs on one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _quantize_columns(W: Tensor, upper: Tensor, codes: Tensor, scales: Tensor, group_of: Tensor, fmt: QuantFormat,
                      block_size: int, static: bool, choose_scales) -> None:
    in_features = W.shape[1]
    for start in range(0, in_features, block_size):
        stop = min(start + block_size, in_features)
        block = W[:, start:stop].clone()
        errors = torch.zeros_like(block)
        for i in range(stop - start):
            column = start + i
            if not static and column % fmt.group_size == 0:
                group_weight = torch.cat([block[:, i:], W[:, stop:]], 1)[:, :fmt.group_size]
                scales[column // fmt.group_size] = choose_scales(group_weight)[0]
            scale = scales[group_of[column]] if fmt.group_size else scales
            q = torch.round(block[:, i] / scale).clamp(fmt.qmin, fmt.qmax)
            codes[:, column] = q
            error = (block[:, i] - q * scale) / upper[column, column]
            block[:, i:] -= error[:, None] * upper[column, column:stop][None, :]
            errors[:, i] = error
        W[:, stop:] -= errors @ upper[start:stop, stop:]


def _upper_cholesky_of_inverse(hessian: Tensor) -> Tensor:
    """U with H⁻¹ = Uᵀ U: row i of U, divided by U[i, i], gives the update GPTQ applies after quantizing column i."""
    try:
        lower = torch.linalg.cholesky(hessian)
    except torch.linalg.LinAlgError:  # not positive definite even after dampening: add more, once
        hessian = hessian + 0.1 * torch.mean(torch.diag(hessian)) * torch.eye(len(hessian), dtype=hessian.dtype)
        lower = torch.linalg.cholesky(hessian)
    inverse = torch.cholesky_inverse(lower)
    return torch.linalg.cholesky(inverse, upper=True)
