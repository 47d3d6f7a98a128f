"""Mixture-of-experts capture: each transformers experts module (`use_experts_implementation`, transformers 5) calls
fxllm::moe_experts through transformers' ExpertsInterface, so the graph holds one node per MoE layer with the
expert weights as its inputs; the router (a linear, softmax, top-k) stays in the graph as ordinary ops.

The expert's gate is recognized by what it computes, not by the model's name: the module's own gate function is
run on a probe tensor and compared with each form fxllm::moe_experts implements (compiler/ops.apply_gate); a gate
that matches none is refused.
"""

from __future__ import annotations

import torch

from fxllm.compiler import ops
from fxllm.errors import UnsupportedModelError

EXPERTS_IMPLEMENTATION = "fxllm"


def experts_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The experts modules of the model (those transformers' experts interface dispatches), in module order."""
    return [m for m in model.modules() if hasattr(m, "has_gate") and hasattr(m, "down_proj")]


def register_moe_experts(model: torch.nn.Module) -> None:
    """Route every experts module of `model` to fxllm::moe_experts (nothing to do for dense models)."""
    modules = experts_modules(model)
    if not modules:
        return
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(EXPERTS_IMPLEMENTATION, _fxllm_experts)
    for module in modules:
        _check_supported(module)
        module.config._experts_implementation = EXPERTS_IMPLEMENTATION
    model.config._experts_implementation = EXPERTS_IMPLEMENTATION


def _fxllm_experts(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                   top_k_weights: torch.Tensor) -> torch.Tensor:
    gate, activation, alpha, limit = self._fxllm_gate
    up = self.gate_up_proj if self.has_gate else self.up_proj
    up_bias = (self.gate_up_proj_bias if self.has_gate else self.up_proj_bias) if self.has_bias else None
    down_bias = self.down_proj_bias if self.has_bias else None
    return torch.ops.fxllm.moe_experts(hidden_states, top_k_index, top_k_weights, up, up_bias, self.down_proj,
                                       down_bias, bool(self.is_transposed), gate, activation, alpha, limit)


def _check_supported(module: torch.nn.Module) -> None:
    name = type(module).__name__
    if getattr(module, "has_post_expert_norm", False):
        raise UnsupportedModelError(f"{name}: experts with a norm after each expert, which fxllm cannot express")
    if getattr(module, "_is_expert_parallel", False):
        raise UnsupportedModelError(f"{name}: expert-parallel experts; load the model on one device")
    module._fxllm_gate = _recognize_gate(module)


def _recognize_gate(module: torch.nn.Module) -> tuple[str, str, float, float]:
    """(gate, activation, alpha, limit) of ops.apply_gate computing what the module's own gate computes."""
    width = 16
    probe = torch.randn(3, 2 * width, generator=torch.Generator().manual_seed(0)) * 4
    if module.has_gate:
        expected = module._apply_gate(probe)
        forms = [(gate, activation) for gate in ("concatenated", "interleaved") for activation in ops.ACTIVATIONS]
    else:
        expected = module.act_fn(probe)
        forms = [("none", activation) for activation in ops.ACTIVATIONS]
    alpha, limit = float(getattr(module, "alpha", 0.0) or 0.0), float(getattr(module, "limit", 0.0) or 0.0)
    if module.has_gate and alpha and limit:
        forms.insert(0, ("clamped-swiglu", "silu"))
    for gate, activation in forms:
        got = ops.apply_gate(probe, gate, activation, alpha, limit)
        if got.shape == expected.shape and torch.allclose(got, expected, rtol=1e-5, atol=1e-6):
            return gate, activation, alpha, limit
    raise UnsupportedModelError(f"{type(module).__name__}: an expert gate function fxllm cannot express "
                                f"({type(module).__qualname__}._apply_gate)")


def moe_layer_shapes(model: torch.nn.Module, graph_module: torch.fx.GraphModule) -> list[dict | None]:
    """Per layer: {"experts": E, "top_k": k} for a layer with an fxllm.moe_experts node, else None; a MoE node
    belongs to the layer of the attention node before it."""
    shapes: list[dict | None] = []
    for node in graph_module.graph.nodes:
        if node.target is torch.ops.fxllm.attention.default:
            shapes.append(None)
        elif node.target is torch.ops.fxllm.moe_experts.default and shapes:
            index, up = node.args[1], node.args[3]
            shapes[-1] = {"experts": int(up.meta["val"].shape[0]), "top_k": int(index.meta["val"].shape[-1])}
    return shapes
