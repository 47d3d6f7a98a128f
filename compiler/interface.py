"""The calling convention of a Program, in one place: concrete sample inputs and a full-sequence logits runner.

Dims used in signatures: batch, tokens (new tokens this step), past (cached tokens), total (= past + tokens),
select (positions whose logits are computed, with select-logits).
"""

from __future__ import annotations

import torch

from fxllm.compiler.program import Program
from fxllm.runtime.contract import (ATTENTION_MASK, BLOCK_TABLES, CONTEXT_LENS, CONTIGUOUS, INPUT_IDS, LOGITS_INDEX,
                                    PAGED, POSITION_IDS, TensorSig, cache_input, cache_output, parse_cache_name)

DTYPES = {"int64": torch.int64, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "bool": torch.bool}


def make_input(sig: TensorSig, dims: dict[str, int]) -> torch.Tensor:
    shape = [d if isinstance(d, int) else dims[d] for d in sig.dims]
    return torch.zeros(shape, dtype=DTYPES[sig.dtype])


def step_inputs(program: Program, input_ids: torch.Tensor, past: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Inputs for one step over `input_ids` [B,T] after the cached tokens in `past` (no padding)."""
    batch, tokens = input_ids.shape
    past_len = next(iter(past.values())).shape[2] if past else 0
    dims = {"batch": batch, "tokens": tokens, "past": past_len, "total": past_len + tokens}
    values = {
        INPUT_IDS: input_ids,
        POSITION_IDS: torch.arange(past_len, past_len + tokens).expand(batch, tokens).contiguous(),
        ATTENTION_MASK: torch.ones(batch, past_len + tokens, dtype=torch.int64),
        LOGITS_INDEX: torch.arange(tokens),
    }

    def value_for(sig: TensorSig) -> torch.Tensor:
        if sig.name in values:
            return values[sig.name]
        role = parse_cache_name(sig.name)
        if role is not None and role.cache == CONTIGUOUS:
            present = past.get(cache_output(CONTIGUOUS, role.kind, role.layer))
            return present if present is not None else make_input(sig, dims)
        raise ValueError(f"no value for graph input '{sig.name}'")

    return [value_for(sig) for sig in program.inputs]


def run_sequence(program: Program, input_ids: torch.Tensor, split: int | None = None) -> torch.Tensor:
    """Logits [B,T,V] for every position of `input_ids`. With a KV cache, the last `split` tokens (default 3) are
    fed as a second multi-token step over the cache of the first ones, so the cache path is what gets measured."""
    with torch.no_grad():
        if "paged" in program.facts:
            return _run_paged(program, input_ids, 3 if split is None else split)
        if "kv-cache" not in program.facts:
            return _call(program, step_inputs(program, input_ids, {}))[0]
        split = 3 if split is None else split
        first, second = input_ids[:, :-split], input_ids[:, -split:]
        outputs = _call(program, step_inputs(program, first, {}))
        present = {sig.name: value for sig, value in zip(program.outputs, outputs) if parse_cache_name(sig.name)}
        outputs2 = _call(program, step_inputs(program, second, present))
        return torch.cat([outputs[0], outputs2[0]], dim=1)


def _run_paged(program: Program, input_ids: torch.Tensor, split: int) -> torch.Tensor:
    """Two steps through a block pool, the way the runtime drives it: sequence b owns blocks b*n..b*n+n-1, listed
    in reverse so a wrong table order cannot go unnoticed; each step's new K/V are written into their slots."""
    batch, length = input_ids.shape
    pool_sig = next(sig for sig in program.inputs if sig.name == cache_input(PAGED, "key", 0))
    block_size = pool_sig.dims[1]
    per_sequence = -(-length // block_size)
    tables = torch.stack([torch.arange(per_sequence).flip(0) + b * per_sequence for b in range(batch)])
    pools = {sig.name: torch.zeros(batch * per_sequence, *pool_sig.dims[1:], dtype=DTYPES[sig.dtype])
             for sig in program.inputs if parse_cache_name(sig.name)}
    logits = []
    for start, stop in ((0, length - split), (length - split, length)):
        chunk = input_ids[:, start:stop]
        values = {INPUT_IDS: chunk, POSITION_IDS: torch.arange(start, stop).expand(batch, -1).contiguous(),
                  BLOCK_TABLES: tables, CONTEXT_LENS: torch.full((batch,), start, dtype=torch.int64),
                  LOGITS_INDEX: torch.arange(stop - start), **pools}
        outputs = _call(program, [values[sig.name] for sig in program.inputs])
        for sig, value in zip(program.outputs, outputs):
            role = parse_cache_name(sig.name)
            if role is not None:
                pool = pools[cache_input(PAGED, role.kind, role.layer)]
                positions = torch.arange(start, stop)
                blocks = tables[:, positions // block_size]  # [B, T]
                pool[blocks, positions % block_size] = value.transpose(1, 2)  # [B, T, Hkv, D]
        logits.append(outputs[0])
    return torch.cat(logits, dim=1)


def _call(program: Program, inputs: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    result = program.graph_module(*inputs)
    return tuple(result) if isinstance(result, (tuple, list)) else (result,)


def sample_dims(batch: int = 2, tokens: int = 8, past: int = 4) -> dict[str, int]:
    return {"batch": batch, "tokens": tokens, "past": past, "total": past + tokens, "select": 3, "blocks": 6,
            "table": 3}
