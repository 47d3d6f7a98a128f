"""Where AWQ's input scaling x → x / s can be folded, so that it costs nothing at run time.

Two producers are recognised (the ones in front of every projection of a Llama-style block):
- mul(activation, w) with w a constant [in] used only there (RMSNorm's weight): w → w / s;
- mul(silu(gate), up) where `up` is (a split slice of) a linear's output used only there: that linear's output
  features are divided by s — through its scales if it is already quantized (float16 scales rounded to float16
  again), else its weight rows (and bias).
Anything else (e.g. attention output feeding o_proj) is not folded; AWQ then only searches clipping there.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch

from fxllm.compiler.projections import SPLITS, split_sizes, constant
from fxllm.compiler.quant.numerics import stored_scales

aten = torch.ops.aten
Node = torch.fx.Node
Folder = Callable[[torch.Tensor], None]


def input_scale_folder(program, group: list[Node], quantized: dict) -> Folder | None:
    """A function applying x / s at x's producer, or None when the producer is not one of the foldable forms."""
    x = group[0].args[0]
    if not isinstance(x, Node) or x.target is not aten.mul.Tensor or len(x.users) != len(group):
        return None
    a, b = x.args
    for vector, other in ((a, b), (b, a)):
        tensor = constant(program, vector)
        if tensor is not None and tensor.dim() == 1 and len(vector.users) == 1 and \
                tensor.shape[0] == _in_features(program, group[0]):
            return lambda s, tensor=tensor: tensor.data.div_(s.to(tensor.dtype))
    for linear_side, gate_side in ((b, a), (a, b)):
        found = _linear_slice(program, linear_side)
        if found is not None and getattr(gate_side, "target", None) is aten.silu.default:
            return _output_feature_folder(program, *found, quantized)
    return None


def _in_features(program, linear: Node) -> int:
    return constant(program, linear.args[1]).shape[1]


def _linear_slice(program, node) -> tuple[Node, int, int] | None:
    """(linear, start, stop) when node is a linear's output, or one split slice of it, used only by its consumer."""
    if not isinstance(node, Node) or len(node.users) != 1:
        return None
    if node.target is aten.linear.default and constant(program, node.args[1]) is not None:
        return node, 0, constant(program, node.args[1]).shape[0]
    if node.target is operator.getitem and getattr(node.args[0], "target", None) in SPLITS:
        split = node.args[0]
        linear = split.args[0]
        dim = split.args[2] if len(split.args) > 2 else 0
        if getattr(linear, "target", None) is not aten.linear.default or constant(program, linear.args[1]) is None:
            return None
        if dim != -1 and ("val" not in linear.meta or dim != linear.meta["val"].dim() - 1):
            return None
        sizes = split_sizes(split)
        start = sum(sizes[: node.args[1]])
        return linear, start, start + sizes[node.args[1]]
    return None


def _output_feature_folder(program, linear: Node, start: int, stop: int, quantized: dict) -> Folder:
    def fold(s: torch.Tensor) -> None:
        if linear in quantized:  # scales (and offsets) are per output feature ([groups, out] or [out])
            done = quantized[linear]
            scales = done.scales[..., start:stop]
            steps = None if done.offsets is None else torch.round(done.offsets[..., start:stop] / scales)  # 8 − z
            # exact, but for float16 scales rounded to float16 again (a relative 2⁻¹¹, far below int4's step)
            scales.copy_(stored_scales(scales / s.to(scales.dtype), done.fmt))
            if steps is not None:
                done.offsets[..., start:stop] = scales * steps
        else:
            constant(program, linear.args[1]).data[start:stop] /= s[:, None]
        bias = constant(program, linear.args[2]) if len(linear.args) > 2 else None
        if bias is not None:
            bias.data[start:stop] /= s
    return fold
