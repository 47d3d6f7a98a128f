"""Engine behaviour beyond greedy parity: sampling, stop strings, streaming, chat, context limits."""

from __future__ import annotations

import numpy as np
import pytest

import fxllm
from fxllm.errors import GenerationError
from fxllm.runtime.sampler import Sampler, SamplingParams, probabilities
from tests.conftest import PROMPTS


@pytest.fixture(scope="module")
def engine(make_tiny_artifact):
    return fxllm.load(make_tiny_artifact("llama"))


def test_result_fields_and_timings(engine):
    result = engine.generate(PROMPTS[0], max_new_tokens=5)
    assert len(result.token_ids) == 5 and result.finish_reason == "length"
    assert result.text == engine.tokenizer.decode(result.token_ids, skip_special_tokens=True)
    assert result.timings["prefill_ms"] > 0 and result.timings["decode_ms_per_token"] > 0
    # the wall time between tokens holds the decode calls and what runs between them
    assert result.timings["inter_token_ms"] >= result.timings["decode_ms_per_token"] - 0.001
    assert result.timings["ttft_ms"] >= result.timings["prefill_ms"] - 0.001
    assert set(result.to_dict()) >= {"prompt", "token_ids", "text", "timings"}


def test_seeded_sampling_is_reproducible_and_varies(engine):
    kwargs = dict(max_new_tokens=8, temperature=1.0, top_p=0.95)
    a = engine.generate(PROMPTS[0], seed=1, **kwargs).token_ids
    assert engine.generate(PROMPTS[0], seed=1, **kwargs).token_ids == a
    assert any(engine.generate(PROMPTS[0], seed=s, **kwargs).token_ids != a for s in range(2, 6))


def test_stream_pieces_add_up_to_the_generated_text(engine):
    pieces = list(engine.stream(PROMPTS[2], max_new_tokens=12))
    assert len(pieces) > 1
    assert "".join(pieces) == engine.generate(PROMPTS[2], max_new_tokens=12).text


def test_stop_string_ends_generation(engine):
    full = engine.generate(PROMPTS[0], max_new_tokens=16).text
    stop = full.strip()[3:6]
    result = engine.generate(PROMPTS[0], max_new_tokens=16, stop=stop)
    assert result.finish_reason == "stop" and stop not in result.text
    assert full.startswith(result.text)


def test_chat_template_is_applied(engine):
    ids = engine.encode("hi", chat=True)
    text = engine.tokenizer.decode(ids, skip_special_tokens=False)
    assert "<|im_start|>user" in text and text.rstrip().endswith("<|im_start|>assistant")


def test_prompt_longer_than_context_is_refused(engine):
    too_long = [5] * engine.max_context
    with pytest.raises(GenerationError, match=f"the prompt is {engine.max_context} tokens; the model's context is"):
        engine.generate_ids([too_long], max_new_tokens=1)
    with pytest.raises(GenerationError, match="empty"):
        engine.generate_ids([[]])


def test_generation_stops_at_the_context_end(engine):
    prompt = [5] * (engine.max_context - 3)
    result = engine.generate_ids([prompt], max_new_tokens=50)[0]
    assert len(result.token_ids) == 3 and result.finish_reason == "context"
    exact = engine.generate_ids([prompt], max_new_tokens=3)[0]  # what was asked for, ending at the context: "length"
    assert exact.token_ids == result.token_ids and exact.finish_reason == "length"


def test_top_k_and_top_p_restrict_the_distribution():
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]]))
    p = probabilities(logits, SamplingParams(temperature=1.0, top_k=2))
    np.testing.assert_allclose(p, [[0.625, 0.375, 0, 0]])
    p = probabilities(logits, SamplingParams(temperature=1.0, top_p=0.75))
    np.testing.assert_allclose(p, [[0.625, 0.375, 0, 0]])
    p = probabilities(logits, SamplingParams(temperature=1.0, top_p=0.81))
    np.testing.assert_allclose(p, [[0.5, 0.3, 0.15, 0]] / np.float64(0.95))


def test_sampler_frequencies_follow_probabilities():
    logits = np.log(np.array([[0.6, 0.3, 0.1]]))
    sampler = Sampler(SamplingParams(temperature=1.0, seed=0))
    draws = np.array([sampler(logits)[0] for _ in range(20000)])
    np.testing.assert_allclose(np.bincount(draws, minlength=3) / len(draws), [0.6, 0.3, 0.1], atol=0.015)


def test_bad_sampling_parameters():
    with pytest.raises(GenerationError, match="top_p"):
        SamplingParams(temperature=1.0, top_p=0)
    with pytest.raises(GenerationError, match="temperature"):
        SamplingParams(temperature=-1)


def test_streamed_text_never_shows_what_a_stop_string_cuts(engine):
    full = engine.generate(PROMPTS[1], max_new_tokens=24).text
    stop = full[len(full) // 2: len(full) // 2 + 4]  # likely to straddle tokens
    pieces = list(engine.stream(PROMPTS[1], max_new_tokens=24, stop=stop))
    result = engine.generate(PROMPTS[1], max_new_tokens=24, stop=stop)
    assert "".join(pieces) == result.text and stop not in result.text


def test_a_seed_samples_the_same_alone_or_in_a_batch(engine):
    kwargs = dict(max_new_tokens=10, temperature=1.0, seed=7)
    alone = engine.generate(PROMPTS[1], **kwargs).token_ids
    batch = engine.generate([PROMPTS[0], PROMPTS[1], PROMPTS[3]], **kwargs)
    assert batch[1].token_ids == alone


def test_rows_leaving_the_batch_do_not_change_the_others(engine):
    long_prompt = [5] * (engine.max_context - 4)  # reaches the context after 4 tokens and leaves the batch
    short_prompt = engine.encode(PROMPTS[0])
    both = engine.generate_ids([long_prompt, short_prompt], max_new_tokens=12)
    assert both[0].finish_reason == "context" and len(both[0].token_ids) == 4
    assert both[1].token_ids == engine.generate_ids([short_prompt], max_new_tokens=12)[0].token_ids


def test_default_threads_follow_omp_num_threads(make_tiny_artifact, monkeypatch):
    """Without `threads`, ONNX Runtime gets OMP_NUM_THREADS where it is a positive integer, else every CPU; an
    explicit `threads` wins."""
    import os

    from fxllm.runtime.backend_ort import default_threads

    def session_threads(**options) -> int:
        return fxllm.load(make_tiny_artifact("llama"), **options).backend.session.get_session_options() \
            .intra_op_num_threads

    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert default_threads() == 3 and session_threads() == 3 and session_threads(threads=2) == 2
    for unusable in ("0", "two", "", "-1"):
        monkeypatch.setenv("OMP_NUM_THREADS", unusable)
        assert default_threads() == (os.cpu_count() or 1)
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert session_threads() == (os.cpu_count() or 1)


def test_the_earliest_of_several_stop_strings_cuts_the_text(engine):
    """The same text cut the same way however its tokens split: the stop string that starts first wins, not the
    first one listed (which was searched first, the others then only in the text it left)."""
    from fxllm.runtime.detokenizer import IncrementalDetokenizer

    def cut(pieces, stop):
        detokenizer = IncrementalDetokenizer(engine.tokenizer, stop)
        for piece in pieces:
            for token in engine.tokenizer.encode(piece, add_special_tokens=False):
                detokenizer.add(token)
        return detokenizer.text, detokenizer.stop_string

    assert cut(["xeN", "ative"], ["at", "eNa"]) == cut(["xeNa", "tive"], ["at", "eNa"]) == ("x", "eNa")
    full = engine.generate(PROMPTS[1], max_new_tokens=24).text
    late, early = full[len(full) // 2: len(full) // 2 + 3], full[2:5]
    assert engine.generate(PROMPTS[1], max_new_tokens=24, stop=[late, early]).text == full[:full.index(early)]
