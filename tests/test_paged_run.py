"""ort paged-run: a full-attention paged artifact takes its pool as head-major views. Each of its forms — one
sequence whose blocks form a run attending in the pool itself, GroupQueryAttention over the gathered blocks, the
model's Attention over them — gives the standard (unlegalized) form's logits and K/V on the same pool and tables,
and the runtime's steps of a lone sequence really run in place."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fxllm
from fxllm.runtime.contract import cache_input, cache_output
from fxllm.runtime.paged_cache import HeadMajorKVPool
from tests.conftest import TINY_COMMON
from tests.ort_profile import profiled_run

BLOCK = 4
PASSES = f"cleanup,gqa,fuse-projections,select-logits,kv-cache,paged:block_size={BLOCK}"
LAYERS, KV_HEADS, HEAD_DIM, BLOCKS = 2, TINY_COMMON["num_key_value_heads"], 16, 100


@pytest.fixture(scope="module")
def forms(tmp_path_factory, tokenizer):
    """A full-attention model compiled paged for `ort` (head-major, paged-run) and without any ort legalization
    step (the standard form: block-major pool, Gather + Concat + Attention)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(1)
    directory = tmp_path_factory.mktemp("paged-run")
    AutoModelForCausalLM.from_config(LlamaConfig(**TINY_COMMON)).eval().save_pretrained(directory / "model")
    tokenizer.save_pretrained(directory / "model")
    fxllm.compile(directory / "model", directory / "ort", passes=PASSES)
    fxllm.compile(directory / "model", directory / "standard", passes=PASSES, ort_steps=[])
    return directory / "ort", directory / "standard"


def _head_major_view(pool: np.ndarray, first: int) -> np.ndarray:
    """The runtime's view of a block-major pool [blocks, bs, Hkv, D] stored head-major, from block `first` on."""
    slots = pool.shape[0] * pool.shape[1]
    heads = pool.reshape(slots, KV_HEADS, HEAD_DIM).transpose(1, 0, 2)  # [Hkv, slots, D]
    flat = np.zeros((KV_HEADS + 1) * slots * HEAD_DIM, np.float32)
    flat[:heads.size] = heads.ravel()
    return flat[first * BLOCK * HEAD_DIM:][:heads.size].reshape(1, KV_HEADS, slots, HEAD_DIM).copy()


@pytest.mark.parametrize("contexts,new,form", [([37], 3, "run"), ([37], 1, "run"), ([0], 5, "run"),
                                               ([37], 3, "GroupQueryAttention"),
                                               ([5, 22, 13], 1, "GroupQueryAttention"),
                                               ([9, 30], 2, "Attention")],
                         ids=["run-several-tokens", "run-decode", "run-first-prompt", "shuffled-one-row",
                              "rows-one-token", "rows-several-tokens"])
def test_each_form_equals_the_standard_form(forms, tmp_path, contexts, new, form):
    """Garbage fills every slot a row does not own or has not filled yet, so a form reading one would differ."""
    ort_artifact, standard = forms
    rng = np.random.default_rng(len(contexts) + new)
    pools = {cache_input("paged", kind, layer): rng.standard_normal((BLOCKS, BLOCK, KV_HEADS, HEAD_DIM)).astype(
        np.float32) for layer in range(LAYERS) for kind in ("key", "value")}
    entries = max(-(-(context + new) // BLOCK) for context in contexts)
    first = 20
    if form == "run":
        table = np.arange(first, first + entries)[None]
    else:  # distinct blocks for every row, anywhere in the pool from `first` on
        order = first + rng.permutation(BLOCKS - first)
        table = np.stack([order[row * entries:(row + 1) * entries] for row in range(len(contexts))])
    lens = np.asarray(contexts)
    common = {"input_ids": rng.integers(3, 1000, (len(contexts), new)), "position_ids": lens[:, None] + np.arange(new),
              "logits_index": np.arange(new), "context_lens": lens}
    expected, _, _ = profiled_run(standard / "model.onnx", {**common, "block_tables": table, **pools}, tmp_path)
    views = {name: _head_major_view(pool, first) for name, pool in pools.items()}
    feeds = {**common, "block_tables": table - first, **views}
    got, ops, names = profiled_run(ort_artifact / "model.onnx", feeds, tmp_path)
    assert "GroupQueryAttention" in ops if form != "Attention" else "Attention" in ops
    assert ("GatherElements" in ops) == (form == "GroupQueryAttention")  # the step's K/V out of a gathered present
    branches = {"run": None, "GroupQueryAttention": "paged_run_gqa_", "Attention": "paged_run_gathered_"}
    for branch, prefix in branches.items():  # a run gathers nothing: no node of the other branches ran
        if prefix is not None:
            assert any(name.startswith(prefix) for name in names) == (form == branch), prefix
    np.testing.assert_allclose(got["logits"], expected["logits"], rtol=1e-4, atol=1e-5)
    for layer in range(LAYERS):
        for kind in ("key", "value"):
            step = expected[cache_output("paged", kind, layer)]  # [B, Hkv, T, D]
            returned = got[cache_output("paged", kind, layer)]
            if form != "run":
                np.testing.assert_allclose(returned, step, rtol=1e-4, atol=1e-5)
                continue
            # a run step returns the pool view with its K/V at rows context .. context + T, the rest as it was
            context = contexts[0]
            np.testing.assert_allclose(returned[:, :, context:context + new], step, rtol=1e-4, atol=1e-5)
            view = views[cache_input("paged", kind, layer)]
            np.testing.assert_array_equal(returned[:, :, :context], view[:, :, :context])


def test_a_lone_sequence_runs_in_the_pool_and_a_batch_gathers(tiny_paged_artifact, make_tiny_artifact):
    """The runtime binds a lone sequence's new K/V outputs to the pool views it feeds (the kernel writes in place,
    nothing is written after the call); a batch of two gets staging buffers. Both equal the contiguous artifact."""
    engine = fxllm.load(tiny_paged_artifact, prefix_caching=False)
    backend, steps = engine.backend, []
    run = backend.run

    def spy(feeds):
        steps.append(all(feeds.outputs[cache_output("paged", kind, i)] is feeds.state[cache_input("paged", kind, i)]
                         for kind in ("key", "value") for i in range(LAYERS)))
        return run(feeds)

    backend.run = spy
    prompts = ["The quick brown fox jumps over the lazy dog", "Once upon a time"]
    alone = [engine.generate(prompt, max_new_tokens=12).token_ids for prompt in prompts]
    assert len(steps) == 24 and all(steps)
    steps.clear()
    together = [r.token_ids for r in engine.generate(prompts, max_new_tokens=12)]
    assert steps[:2] == [True, True] and not any(steps[2:])  # each prompt's prefill alone, then rows of two
    contiguous = fxllm.load(make_tiny_artifact("llama"))
    expected = [contiguous.generate(prompt, max_new_tokens=12).token_ids for prompt in prompts]
    assert alone == expected and together == expected


def test_the_head_major_pool_writes_and_copies_blocks_where_the_views_read_them():
    pool = HeadMajorKVPool(num_layers=2, num_blocks=6, block_size=BLOCK, kv_heads=KV_HEADS, head_dim=HEAD_DIM)
    rng = np.random.default_rng(0)
    staging = pool.new_kv_buffers(batch=2, tokens=3)
    for array in staging.values():
        array[...] = rng.standard_normal(array.shape)
    slots = np.asarray([[9, 10, 11], [20, 21, -1]])  # -1: a padding position, written nowhere
    pool.write(staging, slots)
    pool.copy_blocks([(2, 4)])  # block 2 holds slots 8-11
    view = pool.feeds(first=2)[cache_input("paged", "value", 1)]  # from slot 8 on
    new = staging[cache_output("paged", "value", 1)]  # [B, Hkv, T, D]
    np.testing.assert_array_equal(view[0, :, 1:4], new[0])
    np.testing.assert_array_equal(view[0, :, 12:14], new[1, :, :2])
    np.testing.assert_array_equal(view[0, :, 14], 0)
    np.testing.assert_array_equal(view[0, :, 8 + 1:8 + 4], new[0])  # block 4 = slots 16-19, 8 rows into the view
    run = pool.run_outputs(first=2)
    assert all(run[cache_output("paged", kind, i)] is pool.feeds(first=2)[cache_input("paged", kind, i)]
               for kind in ("key", "value") for i in range(2))
    before = view.copy()
    pool.write(run, np.asarray([[8]]))  # a run step's outputs are the views: nothing to write
    np.testing.assert_array_equal(view, before)


def test_prompts_sharing_a_cached_prefix_still_run_in_the_pool(tiny_paged_artifact, make_tiny_artifact):
    """With prefix caching, a later prompt's hits are followed by the earlier request's cached blocks: its hits are
    copied into a fresh run (block manager keep_runs), so every step still attends in place, the prefix is still
    not recomputed, and the tokens equal the contiguous artifact's."""
    engine = fxllm.load(tiny_paged_artifact)  # prefix caching on
    backend, steps = engine.backend, []
    run = backend.run

    def spy(feeds):
        steps.append(all(feeds.outputs[cache_output("paged", "key", i)] is feeds.state[cache_input("paged", "key", i)]
                         for i in range(LAYERS)))
        return run(feeds)

    backend.run = spy
    system = "You answer questions about animals in one short sentence, and you never make anything up. "
    prompts = [system + question for question in ("What do cats eat?", "Where do owls live?", "Can fish sleep?")]
    got = [engine.generate(prompt, max_new_tokens=10).token_ids for prompt in prompts]
    assert engine.stats().prefix_cache_hits > 0 and len(steps) == 30 and all(steps)
    contiguous = fxllm.load(make_tiny_artifact("llama"))
    assert got == [contiguous.generate(prompt, max_new_tokens=10).token_ids for prompt in prompts]
