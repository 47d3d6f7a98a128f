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

from fxllm.compiler.quant.numerics import Grid, QuantFormat, Quantized, full_range_grid, mse_grid, offsets_of, quantize_column

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
                  block_size: int = 128, mse: bool = False) -> Quantized:
    """W [out, in] and H [in, in] → codes [out, in] int8, scales [groups, out] or [out] (and offsets for
    asymmetric formats). mse: group grids by numerics.mse_grid's clipping search instead of the full range."""
    out_features, in_features = weight.shape
    if fmt.group_size and block_size % fmt.group_size:
        block_size = fmt.group_size  # a group's grid is chosen at its first column: groups must not straddle blocks
    W = weight.detach().to(torch.float64).clone()
    H = hessian.detach().to(torch.float64).clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    static = act_order or fmt.group_size == 0
    choose_grid = (lambda w: mse_grid(w, fmt)) if mse else (lambda w: full_range_grid(w, fmt))
    grid = choose_grid(W)  # [groups, out] or [out]
    order = torch.argsort(torch.diag(H), descending=True) if act_order else torch.arange(in_features)
    W, H = W[:, order], H[order][:, order]
    H += damp * torch.mean(torch.diag(H)) * torch.eye(in_features, dtype=H.dtype)
    upper = _upper_cholesky_of_inverse(H)
    group_of = order // fmt.group_size if fmt.group_size else torch.zeros(in_features, dtype=torch.long)
    codes = torch.zeros_like(W)
    with single_thread():
        _quantize_columns(W, upper, codes, grid, group_of, fmt, block_size, static, choose_grid)
    codes = codes[:, torch.argsort(order)]
    grid = Grid(grid.scales.to(weight.dtype), None if grid.zeros is None else grid.zeros.to(weight.dtype))
    return Quantized(codes.to(torch.int8), grid.scales, offsets_of(grid, fmt))


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


def _quantize_columns(W: Tensor, upper: Tensor, codes: Tensor, grid: Grid, group_of: Tensor, fmt: QuantFormat,
                      block_size: int, static: bool, choose_grid) -> None:
    in_features = W.shape[1]
    for start in range(0, in_features, block_size):
        stop = min(start + block_size, in_features)
        block = W[:, start:stop].clone()
        errors = torch.zeros_like(block)
        for i in range(stop - start):
            column = start + i
            if not static and column % fmt.group_size == 0:
                group_weight = torch.cat([block[:, i:], W[:, stop:]], 1)[:, :fmt.group_size]
                chosen = choose_grid(group_weight)
                grid.scales[column // fmt.group_size] = chosen.scales[0]
                if grid.zeros is not None:
                    grid.zeros[column // fmt.group_size] = chosen.zeros[0]
            group = group_of[column] if fmt.group_size else slice(None)
            zero = None if grid.zeros is None else grid.zeros[group]
            q, dequantized = quantize_column(block[:, i], grid.scales[group], zero, fmt)
            codes[:, column] = q
            error = (block[:, i] - dequantized) / upper[column, column]
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
