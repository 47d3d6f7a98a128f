"""vLLM's bad_words and skip_special_tokens: the ban rule row by row against a direct reading of it, the engine's greedy
tokens with bad words against a loop that scores the whole sequence at every token and bans by hand (contiguous,
paged, and with prompt-lookup speculation, which must give the same tokens), the checks, and special tokens' text
kept or dropped. Over HTTP: tests/serving/test_openai_api.py."""

from __future__ import annotations

import re

import numpy as np
import pytest

import fxllm
from fxllm.errors import InvalidArgumentError
from fxllm.runtime.bad_words import BadWords
from fxllm.runtime.logits_adjustment import LogitsAdjuster
from fxllm.runtime.request import MAX_BAD_WORD_CHARS, MAX_BAD_WORDS, SamplingParams


def reference_banned(sequences: list[list[int]], history: list[int]) -> set[int]:
    """A sequence's last token is banned when the history ends with the rest of it (a one-token sequence: always)."""
    return {s[-1] for s in sequences if len(history) >= len(s) - 1 and history[len(history) - len(s) + 1:] == s[:-1]}


def test_a_sequence_bans_its_last_token_after_the_rest_row_by_row():
    """Row i of a speculative round follows the output and drafts[:i]; one-token sequences ban at every row; a
    prefix in the prompt does not count (vLLM v1 matches the output only)."""
    sequences = [[4], [7, 8], [7, 9], [1, 2, 3], [2, 3, 5], [9, 9]]
    rng = np.random.default_rng(0)
    for _ in range(200):
        output = rng.integers(0, 10, size=int(rng.integers(0, 6))).tolist()
        drafts = rng.integers(0, 10, size=int(rng.integers(0, 4))).tolist()
        params = SamplingParams(bad_words=["unused"])  # the sequences come from BadWords, not from these words
        logits = rng.normal(size=(len(drafts) + 1, 10)).astype(np.float32)
        adjusted = LogitsAdjuster(params, [1, 2], bad_words=BadWords(sequences))(logits, output, drafts)
        for row in range(len(drafts) + 1):
            banned = reference_banned(sequences, output + drafts[:row])
            assert set(np.flatnonzero(np.isinf(adjusted[row]))) == banned, (output, drafts, row)
            kept = sorted(set(range(10)) - banned)
            np.testing.assert_array_equal(adjusted[row, kept], logits[row, kept])


def test_words_become_their_bare_and_spaced_token_sequences(tiny_paged_artifact):
    """vLLM's rule: the bare form always; the spaced one where it is as many tokens and starts with another token."""
    tokenizer = fxllm.load(tiny_paged_artifact).tokenizer

    def encode(text):
        return tokenizer.encode(text, add_special_tokens=False)

    words = ("  Paris", "hello world", "\u4e00\u4e8c\u4e09")
    expected = []
    for word in words:
        bare, spaced = encode(word.lstrip()), encode(" " + word.lstrip())
        expected += [bare] + ([spaced] if len(spaced) == len(bare) and spaced[0] != bare[0] else [])
    bad = BadWords.from_words(words, encode)
    assert [list(s) for s in bad.sequences] == [s for i, s in enumerate(expected) if s not in expected[:i]]
    assert [encode("Paris"), encode(" Paris")] == [list(s) for s in bad.sequences[:2]]  # both one token here
    assert bad.conditional == any(len(s) > 1 for s in expected)


@pytest.mark.parametrize("kind", ["contiguous", "paged", "paged-ngram", "contiguous-ngram"])
def test_greedy_tokens_with_bad_words_match_a_loop_by_hand(kind, make_tiny_artifact, tiny_paged_artifact):
    """Words taken from the plain output (one of its single tokens' text and a phrase of its text) are never
    produced, and every token equals the by-hand loop's over the engine's own sequences (a logit_bias favouring a
    prompt token makes the output repeat, so that prompt lookup has something to propose)."""
    artifact = tiny_paged_artifact if kind.startswith("paged") else make_tiny_artifact("llama")
    engine = fxllm.load(artifact, speculative="ngram" if kind.endswith("ngram") else False)
    prompts = [engine.encode(text) for text in ("The capital of France is", "def fibonacci(n):\n    return")]
    plain = engine.generate_ids(prompts, max_new_tokens=16)
    words = [engine.tokenizer.decode(plain[0].token_ids[2:3]).strip() or "x",
             engine.tokenizer.decode(plain[1].token_ids[3:6]).strip() or "y"]
    sequences = [list(s) for s in engine.core.tokenized_bad_words(tuple(words)).sequences]
    favoured = prompts[1][-1]
    results = engine.generate_ids(prompts, max_new_tokens=16, bad_words=words, logit_bias={favoured: 3.0})
    for prompt, result in zip(prompts, results):
        output: list[int] = []
        for _ in range(16):
            logits = engine.score(prompt + output)[-1].copy()
            logits[sorted(reference_banned(sequences, output))] = -np.inf
            logits[favoured] += 3.0
            output.append(int(np.argmax(logits)))
        assert result.token_ids == output, kind
        for s in sequences:
            assert all(result.token_ids[i:i + len(s)] != s for i in range(len(result.token_ids))), (kind, s)
    assert [r.token_ids for r in results] != [r.token_ids for r in plain]  # the words changed something
    if kind.endswith("ngram"):
        assert engine.stats().speculative.proposed > 0


def test_sampled_requests_never_produce_a_banned_token(tiny_paged_artifact):
    engine = fxllm.load(tiny_paged_artifact)
    prompt = engine.encode("The capital of France is")
    plain = engine.generate_ids([prompt] * 8, max_new_tokens=12, temperature=1.0, seed=0)
    counts = {}
    for result in plain:
        for token in result.token_ids:
            counts[token] = counts.get(token, 0) + 1
    # the most frequent token that is a whole word's one-token form
    word, token = next((w, t) for t in sorted(counts, key=counts.get, reverse=True)
                       if (w := engine.tokenizer.decode([t]).strip())
                       and (t,) in engine.core.tokenized_bad_words((w,)).sequences)
    results = engine.generate_ids([prompt] * 8, max_new_tokens=12, temperature=1.0, seed=0, bad_words=[word])
    assert all(token not in r.token_ids for r in results) and any(token in r.token_ids for r in plain)


def test_bad_words_are_checked(tiny_paged_artifact):
    engine = fxllm.load(tiny_paged_artifact)
    prompt = engine.encode("The capital of France is")
    for words, message in [(["ok", "  "], "bad_words[1] is empty or only whitespace"),
                           ([""], "bad_words[0] is empty or only whitespace"),
                           (["ok", 3], "bad_words[1] must be a string, got int 3"),
                           (["x"] * (MAX_BAD_WORDS + 1), f"bad_words holds more than {MAX_BAD_WORDS} strings"),
                           (["x" * (MAX_BAD_WORD_CHARS + 1)], f"bad_words[0] has {MAX_BAD_WORD_CHARS + 1:,} "
                                                              "characters")]:
        with pytest.raises(InvalidArgumentError, match=re.escape(message)) as caught:
            engine.generate_ids([prompt], max_new_tokens=2, bad_words=words)
        assert caught.value.param == "bad_words"
    digits = [engine.tokenizer.encode(str(d), add_special_tokens=False)[0] for d in range(10)]
    assert all(engine.core.tokenized_bad_words((str(d),)).always.tolist() == [digits[d]] for d in range(10))
    with pytest.raises(InvalidArgumentError, match=re.escape("bad_words ban every token that could be sampled "
                                                             "(allowed_token_ids)")) as caught:
        engine.generate_ids([prompt], max_new_tokens=2, bad_words=["3", "4"], allowed_token_ids=digits[3:5])
    assert caught.value.param == "bad_words"
    eos = sorted(engine.core.eos_token_ids)
    with pytest.raises(InvalidArgumentError, match="allowed_token_ids holds only end-of-sequence or stop token ids, "
                                                   r"which min_tokens \(1\) forbids for the first tokens, or ids "
                                                   "bad_words ban"):
        engine.generate_ids([prompt], max_new_tokens=2, min_tokens=1, bad_words=["3"],
                            allowed_token_ids=[digits[3]] + eos)
    result = engine.generate_ids([prompt], max_new_tokens=2, bad_words=["3"], allowed_token_ids=[digits[3]] + eos)[0]
    assert result.token_ids[0] in eos  # without min_tokens the EOS is left to sample: nothing lost
    # "no digit twice in a row": each step leaves nine digits, so it is served (a ban that depends on the output
    # is not counted up front)
    result = engine.generate_ids([prompt], max_new_tokens=8, allowed_token_ids=digits,
                                 bad_words=[str(d) * 2 for d in range(10)])[0]
    assert len(result.token_ids) == 8 and set(result.token_ids) <= set(digits)
    assert all(a != b for a, b in zip(result.token_ids, result.token_ids[1:]))


def test_a_row_bad_words_leave_empty_ends_its_request_alone(tiny_paged_artifact):
    """After "0" the words "00" and "01" ban both allowed digits: that request ends there ("stop", stop_reason
    "bad_words", its text kept), while the request batched with it runs on."""
    engine = fxllm.load(tiny_paged_artifact)
    prompt = engine.encode("The capital of France is")
    zero, one = (engine.tokenizer.encode(d, add_special_tokens=False)[0] for d in ("0", "1"))
    plain = engine.generate_ids([prompt], max_new_tokens=4)[0].token_ids
    core = engine.core
    core.add_request("starved", prompt, SamplingParams(max_tokens=4, allowed_token_ids=[zero, one],
                                                       bad_words=["00", "01"], logit_bias={zero: 100.0}))
    core.add_request("plain", prompt, SamplingParams(max_tokens=4))
    outputs: dict[str, list] = {}
    while core.has_unfinished():
        for output in core.step():
            outputs.setdefault(output.request_id, []).append(output)
    starved, other = outputs["starved"], outputs["plain"]
    assert (starved[-1].finish_reason, starved[-1].stop_reason, starved[-1].error) == ("stop", "bad_words", None)
    assert [t for out in starved for t in out.new_token_ids] == [zero]
    assert "".join(out.text_delta for out in starved) == "0"
    assert [t for out in other for t in out.new_token_ids] == plain and other[-1].finish_reason == "length"


def test_skip_special_tokens_false_keeps_their_text(tiny_paged_artifact):
    """EOS forced by logit_bias with ignore_eos: its text is in the output only with skip_special_tokens=False
    (streamed and final-only alike); a stop id that ends the request is never in it."""
    engine = fxllm.load(tiny_paged_artifact)
    eos = min(engine.core.eos_token_ids)
    eos_text = engine.tokenizer.decode([eos], skip_special_tokens=False)
    assert eos_text and engine.tokenizer.decode([eos]) == ""
    prompt = engine.encode("The capital of France is")
    options = dict(max_new_tokens=6, ignore_eos=True, logit_bias={eos: 100.0})
    skipped = engine.generate_ids([prompt], **options)[0]
    kept = engine.generate_ids([prompt], skip_special_tokens=False, **options)[0]
    assert kept.token_ids == skipped.token_ids == [eos] * 6
    assert (skipped.text, kept.text) == ("", eos_text * 6)
    streamed = "".join(engine.stream("The capital of France is", skip_special_tokens=False, **options))
    assert streamed == eos_text * 6
    stopped = engine.generate_ids([prompt], max_new_tokens=6, logit_bias={eos: 100.0}, skip_special_tokens=False)[0]
    assert stopped.token_ids == [eos] and stopped.text == ""  # the EOS that ends it is not text
    with pytest.raises(InvalidArgumentError, match="skip_special_tokens must be True or False, got str"):
        SamplingParams(skip_special_tokens="no")
