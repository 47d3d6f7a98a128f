"""The calling convention of a Program, in one place: concrete sample inputs and a full-sequence logits runner.

Dims used in signatures: batch, tokens (new tokens this step), past (cached tokens), total (= past + tokens),
select (positions whose logits are computed, with select-logits).
"""

from __future__ import annotations

import torch

from fxllm.compiler.program import Program, TensorSig

DTYPES = {"int64": torch.int64, "float32": torch.float32, "bool": torch.bool}


def make_input(sig: TensorSig, dims: dict[str, int]) -> torch.Tensor:
    shape = [d if isinstance(d, int) else dims[d] for d in sig.dims]
    return torch.zeros(shape, dtype=DTYPES[sig.dtype])


def step_inputs(program: Program, input_ids: torch.Tensor, past: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Inputs for one step over `input_ids` [B,T] after the cached tokens in `past` (no padding)."""
    batch, tokens = input_ids.shape
    past_len = next(iter(past.values())).shape[2] if past else 0
    dims = {"batch": batch, "tokens": tokens, "past": past_len, "total": past_len + tokens}
    values = {
        "input_ids": input_ids,
        "position_ids": torch.arange(past_len, past_len + tokens).expand(batch, tokens).contiguous(),
        "attention_mask": torch.ones(batch, past_len + tokens, dtype=torch.int64),
        "logits_index": torch.arange(tokens),
    }
    def value_for(sig: TensorSig) -> torch.Tensor:
        if sig.name in values:
            return values[sig.name]
        if sig.name.startswith("past_"):
            present = past.get("present_" + sig.name.removeprefix("past_"))
            return present if present is not None else make_input(sig, dims)
        raise ValueError(f"no value for graph input '{sig.name}'")

    return [value_for(sig) for sig in program.inputs]


def run_sequence(program: Program, input_ids: torch.Tensor, split: int | None = None) -> torch.Tensor:
    """Logits [B,T,V] for every position of `input_ids`. With a KV cache, the last `split` tokens (default 3) are
    fed as a second multi-token step over the cache of the first ones, so the cache path is what gets measured."""
    with torch.no_grad():
        if "kv-cache" not in program.facts:
            return _call(program, step_inputs(program, input_ids, {}))[0]
        split = 3 if split is None else split
        first, second = input_ids[:, :-split], input_ids[:, -split:]
        outputs = _call(program, step_inputs(program, first, {}))
        present = {sig.name: value for sig, value in zip(program.outputs, outputs) if sig.name.startswith("present_")}
        outputs2 = _call(program, step_inputs(program, second, present))
        return torch.cat([outputs[0], outputs2[0]], dim=1)


def _call(program: Program, inputs: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    result = program.graph_module(*inputs)
    return tuple(result) if isinstance(result, (tuple, list)) else (result,)


def sample_dims(batch: int = 2, tokens: int = 8, past: int = 4) -> dict[str, int]:
    return {"batch": batch, "tokens": tokens, "past": past, "total": past + tokens, "select": 3}
