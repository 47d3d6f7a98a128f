"""A prompt prefilled in several calls (max_tokens_per_step) gives what one call gives; the calls before the last
compute no logits on ONNX Runtime (an empty logits_index: the lm_head does not run for them)."""

from __future__ import annotations

import numpy as np
import pytest

import fxllm
from fxllm.runtime.contract import INPUT_IDS, LOGITS_INDEX
from fxllm.runtime.engine import Engine
from fxllm.runtime.request import SamplingParams
from tests.backend_wrapper import WrappedBackend


class RecordingBackend(WrappedBackend):
    """Wraps a real backend and records each call's fed shape and logits_index."""

    def __init__(self, inner):
        super().__init__(inner)
        self.calls: list[tuple[tuple[int, ...], list[int] | None]] = []

    def run(self, feeds):
        index = feeds[LOGITS_INDEX].tolist() if LOGITS_INDEX in feeds else None
        self.calls.append((tuple(feeds[INPUT_IDS].shape), index))
        return self.inner.run(feeds)


def recorded(artifact, empty_selection: bool | None = None, **options) -> tuple[Engine, RecordingBackend]:
    """An engine over the artifact whose backend records its calls (optionally claiming it cannot run an empty
    logits_index)."""
    loaded = fxllm.load(artifact, threads=1)
    backend = RecordingBackend(loaded.backend)
    if empty_selection is not None:
        backend.allows_empty_selection = empty_selection
    return Engine(loaded.directory, loaded.manifest, backend, loaded.tokenizer, **options), backend


def prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(100, 40000, n)] for n in lengths]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])  # GroupQueryAttention on a shared buffer; Attention on Concat
def test_a_contiguous_prompt_prefilled_in_chunks_decodes_as_in_one_call(make_tiny_artifact, arch):
    artifact = make_tiny_artifact(arch)
    whole = fxllm.load(artifact, threads=1, max_tokens_per_step=4096)
    chunked, calls = recorded(artifact, max_tokens_per_step=15)
    assert not chunked.paged and chunked.selects_logits
    for row in prompts([50, 45, 13]):
        calls.calls.clear()
        expected = whole.generate_ids([row], max_new_tokens=16)[0].token_ids
        assert chunked.generate_ids([row], max_new_tokens=16)[0].token_ids == expected
        spans = -(-len(row) // 15)
        size = -(-len(row) // spans)  # equal spans: 50 tokens -> 4 calls of 13, 13, 13, 11
        prefill = calls.calls[:spans]
        assert [shape for shape, _ in prefill] == [(1, size)] * (spans - 1) + [(1, len(row) - size * (spans - 1))]
        assert [index for _, index in prefill] == [[]] * (spans - 1) + [[prefill[-1][0][1] - 1]]
        assert all(shape == (1, 1) for shape, _ in calls.calls[spans:])


def test_a_batch_of_rows_is_prefilled_in_one_call(make_tiny_artifact):
    """GroupQueryAttention takes several tokens after a past for one row only: a batch keeps one call."""
    artifact = make_tiny_artifact("llama")
    whole = fxllm.load(artifact, threads=1, max_tokens_per_step=4096)
    chunked, calls = recorded(artifact, max_tokens_per_step=15)
    rows = prompts([37, 50, 13], seed=3)
    assert [r.token_ids for r in chunked.generate_ids(rows, max_new_tokens=8)] == \
        [r.token_ids for r in whole.generate_ids(rows, max_new_tokens=8)]
    assert calls.calls[0] == ((3, 50), [12, 36, 49])  # right-padded rows: the logits of each row's last token


def test_prompt_logprobs_come_from_every_chunk(make_tiny_artifact):
    artifact = make_tiny_artifact("llama")
    whole = fxllm.load(artifact, threads=1, max_tokens_per_step=4096)
    chunked, calls = recorded(artifact, max_tokens_per_step=16)
    prompt = prompts([41], seed=1)[0]
    params = SamplingParams(max_tokens=4, logprobs=2, prompt_logprobs=3)
    want = list(whole.stream_outputs(prompt, params))
    got = list(chunked.stream_outputs(prompt, params))
    assert [index for _, index in calls.calls[:3]] == [list(range(14))] * 2 + [list(range(13))]
    assert [t for out in got for t in out.new_token_ids] == [t for out in want for t in out.new_token_ids]
    first, reference = got[0].prompt_logprobs, want[0].prompt_logprobs
    assert first[0] is None and len(first) == len(prompt) == len(reference)
    for mine, theirs in zip(first[1:], reference[1:]):
        assert mine.token_id == theirs.token_id
        assert mine.logprob == pytest.approx(theirs.logprob, abs=1e-5)
        assert [t for t, _ in mine.top] == [t for t, _ in theirs.top]


def test_paged_chunks_before_the_last_select_no_logits(tiny_paged_artifact):
    whole = fxllm.load(tiny_paged_artifact, threads=1, max_tokens_per_step=4096)
    chunked, calls = recorded(tiny_paged_artifact, max_tokens_per_step=8, prefix_caching=False)
    prompt = prompts([30], seed=2)
    expected = whole.generate_ids(prompt, max_new_tokens=10)[0].token_ids
    assert chunked.generate_ids(prompt, max_new_tokens=10)[0].token_ids == expected
    assert [(shape, index) for shape, index in calls.calls[:4]] == [((1, 8), [])] * 3 + [((1, 6), [5])]


def test_a_backend_that_cannot_select_nothing_is_asked_for_one_position(make_tiny_artifact):
    engine, calls = recorded(make_tiny_artifact("llama"), empty_selection=False, max_tokens_per_step=20)
    rows = prompts([33])
    reference = fxllm.load(make_tiny_artifact("llama"), threads=1).generate_ids(rows, max_new_tokens=6)
    assert engine.generate_ids(rows, max_new_tokens=6)[0].token_ids == reference[0].token_ids
    assert [index for _, index in calls.calls[:2]] == [[16], [15]]  # 33 tokens: spans of 17 and 16


def test_a_paged_iteration_admits_its_budget_in_calls_of_the_call_size(tiny_paged_artifact):
    """The admission budget and the prefill call size are apart: two 20-token prompts fit one iteration's budget of
    48 and are each prefilled in calls of at most 8 tokens before the iteration's one decode call."""
    from fxllm.runtime.block_manager import BlockManager
    from fxllm.runtime.request import Request
    from fxllm.runtime.scheduler import DECODE, PREFILL, PagedScheduler

    engine = fxllm.load(tiny_paged_artifact, threads=1, prefix_caching=False)
    scheduler = PagedScheduler(BlockManager(64, engine.block_size, False), max_batch=4, max_tokens_per_step=48,
                               prefill_call_tokens=8)
    rows = prompts([20, 20], seed=4)
    for i, row in enumerate(rows):
        scheduler.add(Request(f"r{i}", row, SamplingParams(max_tokens=4), engine.tokenizer, seq_id=i))
    calls = []
    for _ in range(7):
        batch = scheduler.schedule()
        calls.append((batch.kind, [r.request_id for r in batch.requests], [len(t) for t in batch.token_ids]))
        for request in batch.requests:
            if batch.kind == DECODE or batch.sample:
                request.output_token_ids.append(5)
        scheduler.update(batch)
    prefill = [(["r0"], [8])] * 2 + [(["r0"], [4])] + [(["r1"], [8])] * 2 + [(["r1"], [4])]
    assert calls == [(PREFILL, *call) for call in prefill] + [(DECODE, ["r0", "r1"], [1, 1])]


def test_by_default_a_paged_engine_admits_512_prompt_tokens_an_iteration_in_calls_of_256(tiny_paged_artifact):
    from fxllm.runtime.engine import DEFAULT_PAGED_ADMISSION_TOKENS, DEFAULT_TOKENS_PER_STEP

    scheduler = fxllm.load(tiny_paged_artifact, threads=1).core.scheduler
    assert (scheduler.max_tokens_per_step, scheduler.prefill_call_tokens) == (DEFAULT_PAGED_ADMISSION_TOKENS,
                                                                                DEFAULT_TOKENS_PER_STEP) == (512, 256)
    chosen = fxllm.load(tiny_paged_artifact, threads=1, max_tokens_per_step=64).core.scheduler
    assert (chosen.max_tokens_per_step, chosen.prefill_call_tokens) == (64, 64)
