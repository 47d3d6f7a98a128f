"""ort paged-attention (the block-major pool that sliding-window models keep; full attention takes paged-run,
tests/test_paged_run.py): the pool-reading form (one sequence, a slice about its size) and the gathered form (the
whole pool) give the same logits and new K/V on the same inputs — shuffled blocks, a block listed twice (a
released block's stand-in), a partly filled last block — and each form really ran."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fxllm
from tests.conftest import TINY_COMMON
from tests.ort_profile import profiled_run

BLOCK = 4
PASSES = f"cleanup,gqa,fuse-projections,select-logits,kv-cache,paged:block_size={BLOCK}"


@pytest.fixture(scope="module")
def artifact(tmp_path_factory, tokenizer):
    from transformers import AutoModelForCausalLM, MistralConfig

    window = 6
    config = MistralConfig(**TINY_COMMON, sliding_window=window)
    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp(f"paged-attention-w{window}")
    AutoModelForCausalLM.from_config(config).eval().save_pretrained(directory / "model")
    tokenizer.save_pretrained(directory / "model")
    fxllm.compile(directory / "model", directory / "artifact", passes=PASSES)
    return directory / "artifact"


def test_the_pool_form_equals_the_gathered_form(artifact, tmp_path):
    rng = np.random.default_rng(0)
    layers, kv_heads, head_dim, blocks = 2, TINY_COMMON["num_key_value_heads"], 16, 100
    pools = {f"{kind}_cache_{layer}": rng.standard_normal((blocks, BLOCK, kv_heads, head_dim)).astype(np.float32)
             for layer in range(layers) for kind in ("key", "value")}
    context, new = 149, 3  # the last cached block partly filled; slots past the context hold garbage to hide
    entries = -(-(context + new) // BLOCK)  # 38 table entries
    first, end = 10, 80  # the slice the sequence spans: 70 blocks (at most twice its 38, >= 128 slots)
    table = rng.permutation(np.arange(first, end))[:entries]
    table[:30] = table[30]  # released blocks' entries hold a stand-in: the first kept block
    table = table[None]
    common = {"input_ids": rng.integers(3, 1000, (1, new)), "position_ids": np.arange(context, context + new)[None],
              "logits_index": np.arange(new), "context_lens": np.asarray([context])}
    model = artifact / "model.onnx"
    gathered, gathered_ops, _ = profiled_run(model, {**common, "block_tables": table, **pools}, tmp_path)
    sliced = {name: pool[first:end] for name, pool in pools.items()}
    viewed, viewed_ops, _ = profiled_run(model, {**common, "block_tables": table - first, **sliced}, tmp_path)
    assert "FusedMatMul" in viewed_ops and "FusedMatMul" not in gathered_ops and "Attention" in gathered_ops
    assert np.isfinite(gathered["logits"]).all()
    for name, value in gathered.items():
        np.testing.assert_allclose(viewed[name], value, rtol=1e-4, atol=1e-5, err_msg=name)


def test_sequences_alone_generate_what_they_generate_in_a_batch(artifact):
    """Alone, a sequence's slice is its own blocks (the pool form, once its context reaches 128 slots); in a batch
    of six the slice spans all six (the gathered form)."""
    prompts = [f"{i} The quick brown fox jumps over the lazy dog " * (3 + 4 * (i % 3)) for i in range(6)]
    batched = [r.token_ids for r in fxllm.load(artifact).generate(prompts, max_new_tokens=40)]
    engine = fxllm.load(artifact)
    assert [engine.generate(prompt, max_new_tokens=40).token_ids for prompt in prompts] == batched


def test_a_paged_step_writes_its_new_kv_into_the_pools_reused_arrays(artifact):
    """OrtBackend writes new_key_i / new_value_i into the arrays StepFeeds.outputs names (the pool's staging
    array, one per batch shape), so a decode step fetches no K/V output from ONNX Runtime."""
    engine = fxllm.load(artifact)
    backend, calls = engine.backend, []
    run = backend.run

    def spy(feeds):
        outputs = run(feeds)
        calls.append((feeds.outputs, outputs))
        return outputs

    backend.run = spy
    engine.generate("The quick brown fox", max_new_tokens=6)
    decodes = calls[1:]
    assert len(decodes) == 5 and all(given is decodes[0][0] for given, _ in decodes)  # one dict while B, T hold
    for given, outputs in decodes:
        assert all(outputs[name] is array for name, array in given.items())
        assert set(given) == {name for name in outputs if name.startswith("new_")}
