"""A contiguous artifact's KV budget (kv_cache_memory): a static batch takes only the rows whose cache fits it, the
shared buffers stop doubling at what the batch can need, and a request that alone needs more is refused in one line.
Without it a batch of 64 long rows could grow to 64 full contexts of cache (SmolLM2: 24 GB)."""

from __future__ import annotations

import pytest
import torch

import fxllm
from fxllm.errors import InvalidArgumentError
from fxllm.runtime.kv_cache import SharedKVCache
from fxllm.runtime.scheduler import PREFILL
from tests.conftest import PROMPTS, TINY_COMMON


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


def recorded_moves(monkeypatch) -> list[int]:
    """The capacity of every buffer move of every SharedKVCache from now on (the test's own monkeypatch undoes it)."""
    capacities = []
    move = SharedKVCache._move
    monkeypatch.setattr(SharedKVCache, "_move", lambda cache, *args: (capacities.append(args[1]), move(cache, *args)))
    return capacities


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
    what the budget counted) it would hold rows nobody can use. A step's own total is always honoured, and past the
    ceiling (a count that was short) doubling resumes rather than moving the buffers every step."""
    cache = SharedKVCache.empty(layers=2, batch=3, kv_heads=2, head_dim=4)
    cache.ceiling = 300
    cache.reserve(257)
    assert cache.capacity == 300  # not 512
    cache.reserve(301)
    assert cache.capacity == 600
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


@pytest.fixture(scope="module")
def left_padded(tokenizer, tmp_path_factory):
    """A tiny sliding-window Mistral with a 1,024-token context: a left-padded shared buffer, whose rows keep their
    padding columns, so a batch's columns may pass the context."""
    from transformers import AutoModelForCausalLM, MistralConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(MistralConfig(**{**TINY_COMMON, "max_position_embeddings": 1024},
                                                           sliding_window=128)).eval()
    directory = tmp_path_factory.mktemp("left-padded")
    model.save_pretrained(directory / "hf")
    tokenizer.save_pretrained(directory / "hf")
    fxllm.compile(directory / "hf", directory / "artifact")
    return directory / "artifact"


def test_a_left_padded_batch_is_counted_past_the_context_and_stays_within_its_budget(left_padded, monkeypatch):
    """Rows of 700 and 4 prompt tokens, up to 1,000 new tokens (the long row is cut at the context): 1,700 columns,
    past the 1,024-token context. The budget counted them capped at the context, so it took three rows where two
    fit and their buffers outgrew it (2 rows x 2,048 columns once the long row left), and the buffers' doubling
    stopped at the capped count, so each step past it moved the whole buffer."""
    per_token = fxllm.load(left_padded, huge_pages=False).spec.kv_bytes_per_token()
    moves = recorded_moves(monkeypatch)
    engine = fxllm.load(left_padded, kv_cache_memory=3400 * per_token, huge_pages=False)
    assert engine.io.shared_buffer and not engine.io.right_padded and engine.capacity_tokens() == 3400
    engine.eos_token_ids = set()
    rows, peak = watched(engine)
    long, *short = engine.generate_ids([[7] * 700, [8] * 4, [9] * 4, [10] * 4], max_new_tokens=1000)
    assert (len(long.token_ids), long.finish_reason) == (324, "context")
    assert [len(r.token_ids) for r in short] == [1000] * 3
    assert rows == [2, 2] and max(peak) <= 3400 * per_token
    assert len(moves) <= 8, moves  # each batch's prefill sizing, a doubling or two, rows leaving; never one a step


def test_speculative_decoding_s_cache_stops_doubling_at_its_request_s_need(left_padded, monkeypatch):
    """Prompt lookup on a contiguous artifact keeps its own cache per request; it doubled past what the request
    could need (to 1,024 rows for 8 + 582 tokens)."""
    capacities = recorded_moves(monkeypatch)
    engine = fxllm.load(left_padded, speculative="ngram", huge_pages=False)
    engine.eos_token_ids = set()
    prompt = [9, 10, 11, 12] * 2
    assert len(engine.generate_ids([prompt], max_new_tokens=582)[0].token_ids) == 582
    assert capacities and max(capacities) <= len(prompt) + 582 + engine.speculator.k, capacities


def test_the_default_budget_never_refuses_what_the_context_takes(make_tiny_artifact, monkeypatch):
    """Half the memory available can read near nothing right after the weights load (a cgroup's usage counts page
    cache); the default then still holds one full context, so it only ever bounds batching."""
    monkeypatch.setattr("fxllm.runtime.engine.available_memory", lambda: 1000)
    engine = fxllm.load(make_tiny_artifact("llama"), huge_pages=False)
    assert engine.capacity_tokens() == engine.max_context
    assert len(engine.generate("Paris is", max_new_tokens=200).token_ids) > 0
    with pytest.raises(InvalidArgumentError, match="^kv_cache_memory must be a positive size, got -1$"):
        fxllm.load(make_tiny_artifact("llama"), kv_cache_memory=-1)
