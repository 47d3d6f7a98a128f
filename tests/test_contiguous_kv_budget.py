"""A contiguous artifact's KV budget (kv_cache_memory): a static batch takes only the rows whose cache fits it, the
shared buffers stop doubling at what the batch can need, and a request that alone needs more is refused in one line.
Without it a batch of 64 long rows could grow to 64 full contexts of cache (SmolLM2: 24 GB)."""

from __future__ import annotations

import pytest

import fxllm
from fxllm.errors import InvalidArgumentError
from fxllm.runtime.kv_cache import SharedKVCache
from fxllm.runtime.scheduler import PREFILL
from tests.conftest import PROMPTS


def watched(engine) -> tuple[list[int], list[int]]:
    """Record every prefill batch's row count and the cache's bytes after every model call."""
    rows, peak = [], []
    scheduler, runner = engine.core.scheduler, engine.runner
    schedule, execute = scheduler.schedule, runner.execute

    def counted_schedule():
        batch = schedule()
        if batch is not None and batch.kind == PREFILL:
            rows.append(len(batch.requests))
        return batch

    def measured_execute(batch):
        output = execute(batch)
        peak.append(runner._cache.nbytes())
        return output

    scheduler.schedule, runner.execute = counted_schedule, measured_execute
    return rows, peak


@pytest.fixture(scope="module")
def standard_form(make_tiny_model, tmp_path_factory):
    """The tiny llama in the standard ONNX form: a cache that grows by Concat (no 256-row minimum)."""
    output = tmp_path_factory.mktemp("standard-form") / "artifact"
    fxllm.compile(make_tiny_model("llama"), output, ort_steps=())
    return output


def test_a_batch_takes_only_the_rows_its_kv_budget_holds(make_tiny_artifact):
    artifact = make_tiny_artifact("llama")
    unbounded = fxllm.load(artifact, huge_pages=False)
    per_token = unbounded.spec.kv_bytes_per_token()
    assert unbounded.io.shared_buffer
    bounded = fxllm.load(artifact, kv_cache_memory=600 * per_token, huge_pages=False)
    assert bounded.capacity_tokens() == 600
    rows, peak = watched(bounded)
    expected = unbounded.generate(PROMPTS, max_new_tokens=24)
    results = bounded.generate(PROMPTS, max_new_tokens=24)
    assert [r.token_ids for r in results] == [r.token_ids for r in expected]
    # each row's buffers hold at least 256 positions, so 600 positions take two rows a batch
    assert rows == [2, 2] and max(peak) <= 600 * per_token


def test_the_buffers_stop_doubling_at_what_the_batch_can_need():
    """A shared buffer doubles when a step outgrows it; past the batch's longest prompt + generation (its ceiling,
    what the budget counted) it would hold rows nobody can use. A step's own total is always honoured."""
    cache = SharedKVCache.empty(layers=2, batch=3, kv_heads=2, head_dim=4)
    cache.ceiling = 300
    cache.reserve(257)
    assert cache.capacity == 300  # not 512
    cache.reserve(301)
    assert cache.capacity == 301
    unbounded = SharedKVCache.empty(layers=2, batch=3, kv_heads=2, head_dim=4)
    unbounded.reserve(257)
    assert unbounded.capacity == 512


def test_a_request_the_budget_cannot_hold_is_refused_in_one_line(standard_form):
    engine = fxllm.load(standard_form, huge_pages=False)
    per_token = engine.spec.kv_bytes_per_token()
    assert not engine.io.shared_buffer
    bounded = fxllm.load(standard_form, kv_cache_memory=100 * per_token, huge_pages=False)
    prompt = len(bounded.encode("Paris is"))
    with pytest.raises(InvalidArgumentError, match=rf"^a request of {prompt} prompt \+ 200 new tokens needs room for "
                                                   rf"{prompt + 200} tokens of KV cache, but the engine's KV budget "
                                                   r"holds 100 \(kv_cache_memory, --kv-cache-memory\): ask for fewer "
                                                   r"tokens$") as caught:
        bounded.generate("Paris is", max_new_tokens=200)
    assert caught.value.param == "max_tokens"
    with pytest.raises(InvalidArgumentError) as caught:
        bounded.generate_ids([[5] * 150], max_new_tokens=1)
    assert caught.value.param == "prompt"
    rows, peak = watched(bounded)
    results = bounded.generate(PROMPTS, max_new_tokens=8)  # the engine goes on; rows batched as the budget holds
    assert [r.token_ids for r in results] == [r.token_ids for r in engine.generate(PROMPTS, max_new_tokens=8)]
    assert sum(rows) == len(PROMPTS) and len(rows) > 1 and max(peak) <= 100 * per_token


def test_a_kv_budget_below_the_smallest_cache_is_refused_at_load(make_tiny_artifact):
    artifact = make_tiny_artifact("llama")
    per_token = fxllm.load(artifact, huge_pages=False).spec.kv_bytes_per_token()
    with pytest.raises(InvalidArgumentError, match=rf"^a KV budget of {100 * per_token} holds 100 positions of this "
                                                   rf"model's cache \({per_token:,} bytes each\); its contiguous "
                                                   r"cache needs at least 256$"):
        fxllm.load(artifact, kv_cache_memory=100 * per_token)
