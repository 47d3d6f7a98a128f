"""The OpenAI API of `fxllm serve`, driven by the official `openai` client (sync and async) against a real server:
greedy text equals the in-process engine's, streaming equals non-streaming, `n`, stop strings, seeds, logprobs
(equal to the engine's own), usage numbers, and every error status with the OpenAI error body."""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import numpy as np
import openai
import pytest

import fxllm

from fxllm.runtime.request import SamplingParams
from tests.conftest import PROMPTS
from tests.serving.conftest import API_KEY, MODEL, wait_until


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=60)


def greedy(engine, prompt: str, max_tokens: int, chat: bool = False):
    return engine.generate(prompt, max_new_tokens=max_tokens, temperature=0.0, chat=chat)


def token_text(tokenizer):
    """A token as the OpenAI API writes it: its bytes as UTF-8, or `bytes:\\xNN` for part of a character."""

    def text(token_id: int) -> str:
        raw = tokenizer.token_bytes(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    return text


def openai_finish(result) -> str:
    return "length" if result.finish_reason in ("length", "context") else "stop"


# -- completions ------------------------------------------------------------------------------------------------------


def test_completions_greedy_equal_the_engine(client, engine):
    """One prompt per request and all prompts in one request (choice i is prompt i): text, finish reason and usage
    as the in-process engine gives them."""
    expected = [greedy(engine, prompt, 12) for prompt in PROMPTS]
    for prompt, result in zip(PROMPTS, expected):
        response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
        choice = response.choices[0]
        assert (choice.text, choice.finish_reason) == (result.text, openai_finish(result))
        assert response.usage.prompt_tokens == len(engine.encode(prompt))
        assert response.usage.completion_tokens == len(result.token_ids)
        assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens
        assert response.object == "text_completion" and response.model == MODEL
    batch = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=12, temperature=0)
    assert [c.index for c in batch.choices] == list(range(len(PROMPTS)))
    assert [c.text for c in batch.choices] == [r.text for r in expected]
    assert batch.usage.prompt_tokens == sum(len(engine.encode(p)) for p in PROMPTS)
    assert batch.usage.completion_tokens == sum(len(r.token_ids) for r in expected)


def test_token_id_prompts_and_echo(client, engine):
    ids = [engine.encode(prompt) for prompt in PROMPTS[:2]]
    by_text = client.completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=6, temperature=0)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    one = client.completions.create(model=MODEL, prompt=ids[0], max_tokens=6, temperature=0)
    assert [c.text for c in by_ids.choices] == [c.text for c in by_text.choices]
    assert one.choices[0].text == by_text.choices[0].text
    echoed = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPTS[0] + by_text.choices[0].text


def test_streamed_completion_equals_the_response(client):
    prompt = PROMPTS[1]
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text_chunks, usage_chunk = chunks[:-1], chunks[-1]
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert len(text_chunks) > 1  # streamed piece by piece
    assert [c.choices[0].finish_reason for c in text_chunks[:-1]] == [None] * (len(text_chunks) - 1)
    assert text_chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert usage_chunk.choices == [] and usage_chunk.usage == whole.usage


def test_stop_strings(client, engine):
    """A stop string taken from the greedy text cuts it there, streamed or not (finish_reason "stop")."""
    full = greedy(engine, PROMPTS[2], 24)
    cut = len(full.text) // 2
    stop = full.text[cut:cut + 3]
    expected = full.text[:full.text.find(stop)]
    response = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=24, temperature=0, stop=[stop])
    assert (response.choices[0].text, response.choices[0].finish_reason) == (expected, "stop")
    streamed = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=24, temperature=0, stop=stop,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == expected


def test_n_and_seeds(client):
    """n choices sample with seed, seed + 1, ...: the same seed gives the same choices again, choice i equals a
    single request with seed + i, and the choices differ from each other."""
    options = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=1.0)
    first = client.completions.create(n=3, seed=7, **options)
    again = client.completions.create(n=3, seed=7, **options)
    texts = [c.text for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert texts == [c.text for c in again.choices]
    assert len(set(texts)) == 3
    assert client.completions.create(seed=8, **options).choices[0].text == texts[1]
    assert first.usage.completion_tokens == 24
    chat = dict(model=MODEL, messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=8, temperature=1.0)
    assert [c.message.content for c in client.chat.completions.create(n=2, seed=3, **chat).choices] == \
        [c.message.content for c in client.chat.completions.create(n=2, seed=3, **chat).choices]
    prompts = client.completions.create(n=2, seed=7, **{**options, "prompt": PROMPTS[:2]})
    assert [c.index for c in prompts.choices] == [0, 1, 2, 3]
    assert [c.text for c in prompts.choices[:2]] == texts[:2]


def test_completion_logprobs_are_the_engines(client, engine):
    """logprobs=3: every generated token's logprob and its alternatives equal the engine's own (the raw logits'
    log-softmax); with echo, the prompt tokens come first (the first without a logprob)."""
    prompt = PROMPTS[3]
    ids = engine.encode(prompt)
    outputs = list(engine.stream_outputs(ids, SamplingParams(max_tokens=6, logprobs=3, prompt_logprobs=3)))
    generated = [p for out in outputs for p in out.logprobs]
    prompt_positions = outputs[0].prompt_logprobs
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logprobs=3,
                                         echo=True)
    logprobs = response.choices[0].logprobs
    assert logprobs.token_logprobs == [None] + [p.logprob for p in prompt_positions[1:]] + \
        [p.logprob for p in generated]
    text = token_text(engine.tokenizer)
    assert logprobs.tokens == [text(i) for i in ids] + [text(p.token_id) for p in generated]
    for position, top in zip(prompt_positions[1:] + generated, logprobs.top_logprobs[1:]):
        expected = {text(i): lp for i, lp in position.top}
        assert {k: top[k] for k in expected} == expected  # plus the chosen token when it is not among them
        assert len(top) <= 4
    assert logprobs.text_offset == sorted(logprobs.text_offset)
    streamed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logprobs=3,
                                         stream=True)
    assert [lp for c in streamed for lp in c.choices[0].logprobs.token_logprobs] == \
        [p.logprob for p in generated]


# -- chat -------------------------------------------------------------------------------------------------------------


def test_chat_greedy_equals_the_engine(client, engine):
    for prompt in PROMPTS[:2]:
        expected = greedy(engine, prompt, 10, chat=True)
        messages = [{"role": "user", "content": prompt}]
        response = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
        choice = response.choices[0]
        assert (choice.message.role, choice.message.content) == ("assistant", expected.text)
        assert choice.finish_reason == openai_finish(expected)
        assert response.usage.prompt_tokens == len(engine.encode(prompt, chat=True))
        assert response.usage.completion_tokens == len(expected.token_ids)
        chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=10,
                                                     temperature=0, stream=True))
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
        assert chunks[-1].choices[0].finish_reason == choice.finish_reason


def test_chat_conversation_and_logprobs(client, engine):
    """A system message, content parts and top_logprobs: the engine's logprobs on the template's token ids."""
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": [{"type": "text", "text": "Name a colour."}]}]
    text = engine.tokenizer.apply_chat_template([{"role": "system", "content": "You are terse."},
                                                 {"role": "user", "content": "Name a colour."}])
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    outputs = list(engine.stream_outputs(ids, SamplingParams(max_tokens=5, logprobs=2)))
    response = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0,
                                              logprobs=True, top_logprobs=2)
    content = response.choices[0].logprobs.content
    positions = [p for out in outputs for p in out.logprobs]
    assert response.choices[0].message.content == "".join(out.text_delta for out in outputs)
    # Equal up to float rounding: a prompt prefix cached by an earlier request is not recomputed, and a prefill of
    # fewer tokens sums in another order (the tokens themselves are compared exactly).
    assert [lp for c in content for lp in [c.logprob] + [t.logprob for t in c.top_logprobs]] == \
        pytest.approx([lp for p in positions for lp in [p.logprob] + [lp for _, lp in p.top]], abs=1e-5)
    assert [bytes(c.bytes) for c in content] == [engine.tokenizer.token_bytes(p.token_id) for p in positions]
    assert response.usage.prompt_tokens == len(ids)


def test_async_client_runs_requests_together(server, engine):
    """Concurrent requests from the async client (chat streams and completions at once) each equal the engine's."""

    async def main():
        async with openai.AsyncOpenAI(base_url=server.url, api_key=API_KEY, max_retries=0) as client:
            async def complete(prompt):
                response = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0)
                return response.choices[0].text

            async def chat(prompt):
                stream = await client.chat.completions.create(model=MODEL, messages=[{"role": "user",
                                                                                      "content": prompt}],
                                                              max_tokens=10, temperature=0, stream=True)
                return "".join([c.choices[0].delta.content or "" async for c in stream])

            return await asyncio.gather(*[complete(p) for p in PROMPTS], *[chat(p) for p in PROMPTS])

    texts = asyncio.run(main())
    assert texts == [greedy(engine, p, 10).text for p in PROMPTS] + [greedy(engine, p, 10, chat=True).text
                                                                     for p in PROMPTS]


def test_chat_stop_strings(client, engine):
    """A stop string taken from the greedy reply cuts the chat reply there, streamed or not."""
    messages = [{"role": "user", "content": PROMPTS[1]}]
    full = greedy(engine, PROMPTS[1], 24, chat=True)
    cut = len(full.text) // 2
    stop = full.text[cut:cut + 3]
    expected = full.text[:full.text.find(stop)]
    response = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                              stop=[stop, "never-in-the-text"])
    assert (response.choices[0].message.content, response.choices[0].finish_reason) == (expected, "stop")
    streamed = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                                   stop=stop, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == expected
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_top_k_extension(client, engine):
    """top_k=1 samples the most likely token at any temperature (so equals greedy); 0 and -1 mean no limit; a
    negative top_k is the engine's 400."""
    expected = greedy(engine, PROMPTS[0], 12).text
    for seed in (1, 2):
        response = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=1.5,
                                             seed=seed, extra_body={"top_k": 1})
        assert response.choices[0].text == expected
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPTS[0]}],
                                          max_tokens=8, temperature=1.5, extra_body={"top_k": 1})
    assert chat.choices[0].message.content == greedy(engine, PROMPTS[0], 8, chat=True).text
    unlimited = [client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, seed=5,
                                           extra_body={"top_k": k}).choices[0].text for k in (0, -1)]
    assert unlimited[0] == unlimited[1] == client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8,
                                                                      seed=5).choices[0].text
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=2, extra_body={"top_k": -3})
    assert raised.value.body["param"] == "top_k"


def test_penalties_logit_bias_and_min_p_equal_the_engine(client, engine):
    """OpenAI's presence/frequency penalties and logit_bias and vLLM's repetition_penalty and min_p give the
    in-process engine's tokens with the same settings, streamed and not, on both endpoints; logit_bias -100 bans
    a token; the logprobs stay the model's own (before the adjustments, as vLLM's raw logprobs)."""
    plain = greedy(engine, PROMPTS[1], 12)
    banned = plain.token_ids[0]
    settings = dict(presence_penalty=0.5, frequency_penalty=0.7, logit_bias={str(banned): -100})
    vllm = {"repetition_penalty": 1.3, "min_p": 0.05}
    expected = engine.generate(PROMPTS[1], max_new_tokens=12, presence_penalty=0.5, frequency_penalty=0.7,
                               logit_bias={banned: -100}, repetition_penalty=1.3, min_p=0.05)
    assert banned not in expected.token_ids and expected.text != plain.text
    response = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=12, temperature=0, logprobs=0,
                                         extra_body=vllm, **settings)
    assert response.choices[0].text == expected.text
    scores = engine.score(engine.encode(PROMPTS[1]) + expected.token_ids)
    first = scores[len(engine.encode(PROMPTS[1])) - 1]
    raw = float(first[expected.token_ids[0]] - np.log(np.exp(first - first.max()).sum()) - first.max())
    assert response.choices[0].logprobs.token_logprobs[0] == pytest.approx(raw, abs=1e-3)
    streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(
        model=MODEL, prompt=PROMPTS[1], max_tokens=12, temperature=0, stream=True, extra_body=vllm, **settings))
    assert streamed == expected.text
    chat_expected = engine.generate(PROMPTS[1], max_new_tokens=8, chat=True, presence_penalty=0.5,
                                    frequency_penalty=0.7, logit_bias={banned: -100}, repetition_penalty=1.3,
                                    min_p=0.05)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPTS[1]}],
                                          max_tokens=8, temperature=0, extra_body=vllm, **settings)
    assert chat.choices[0].message.content == chat_expected.text


def test_min_tokens_stop_token_ids_and_allowed_token_ids(client, engine):
    """vLLM's min_tokens, stop_token_ids and allowed_token_ids give the in-process engine's tokens; an EOS forced by
    logit_bias comes at min_tokens; a stop id ends the choice with finish_reason "stop"."""
    eos = min(engine.core.eos_token_ids)
    forced = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                       logit_bias={str(eos): 100}, extra_body={"min_tokens": 5})
    assert forced.usage.completion_tokens == 6 and forced.choices[0].finish_reason == "stop"
    plain = greedy(engine, PROMPTS[0], 12)
    allowed = sorted(set(plain.token_ids[1:8]) | set(range(300, 340)))
    expected = engine.generate(PROMPTS[0], max_new_tokens=12, allowed_token_ids=allowed)
    response = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                         extra_body={"allowed_token_ids": allowed})
    assert response.choices[0].text == expected.text and set(expected.token_ids) <= set(allowed)
    stop = expected.token_ids[2]
    stopped = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                        extra_body={"allowed_token_ids": allowed, "stop_token_ids": [stop]})
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage.completion_tokens == expected.token_ids.index(stop) + 1
    cut = expected.text[len(expected.text) // 2:][:3]  # a stop string from the text's second half
    kept = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                     stop=[cut], extra_body={"allowed_token_ids": allowed,
                                                             "include_stop_str_in_output": True})
    assert kept.choices[0].text == expected.text[:expected.text.index(cut) + len(cut)]


def test_bad_words_and_skip_special_tokens(client, engine):
    """vLLM's bad_words give the in-process engine's text, streamed and not, on both endpoints, and the word is gone;
    skip_special_tokens=false keeps a generated special token's text (EOS forced by logit_bias with ignore_eos)."""
    plain = greedy(engine, PROMPTS[0], 12)

    def occurs(sequence, ids) -> bool:
        return any(list(ids[i:i + len(sequence)]) == list(sequence) for i in range(len(ids)))

    # a word of the output whose tokens (as bad_words reads the word) the output holds
    spans = (engine.tokenizer.decode(plain.token_ids[i:j]).strip() for i in range(12) for j in range(i + 1, i + 4))
    word = next(w for w in spans
                if w and any(occurs(s, plain.token_ids) for s in engine.core.tokenized_bad_words((w,)).sequences))
    expected = engine.generate(PROMPTS[0], max_new_tokens=12, bad_words=[word])
    assert not any(occurs(s, expected.token_ids) for s in engine.core.tokenized_bad_words((word,)).sequences)
    assert expected.text != plain.text
    response = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                         extra_body={"bad_words": [word]})
    assert response.choices[0].text == expected.text
    streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0, stream=True, extra_body={"bad_words": [word]}))
    assert streamed == expected.text
    chat_expected = engine.generate(PROMPTS[0], max_new_tokens=8, chat=True, bad_words=[word])
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPTS[0]}],
                                          max_tokens=8, temperature=0, extra_body={"bad_words": [word]})
    assert chat.choices[0].message.content == chat_expected.text
    eos = min(engine.core.eos_token_ids)
    eos_text = engine.tokenizer.decode([eos], skip_special_tokens=False)
    forced = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=3, temperature=0, logit_bias={str(eos): 100})
    kept = client.completions.create(**forced, extra_body={"ignore_eos": True, "skip_special_tokens": False})
    skipped = client.completions.create(**forced, extra_body={"ignore_eos": True})
    assert (kept.choices[0].text, skipped.choices[0].text) == (eos_text * 3, "")
    ended = client.completions.create(**forced, extra_body={"skip_special_tokens": False})
    assert (ended.choices[0].text, ended.choices[0].finish_reason) == ("", "stop")  # the EOS that ends it: no text


def test_structured_outputs(client, engine):
    """OpenAI's response_format (json_schema, json_object) and vLLM's guided_choice, guided_regex, guided_json and
    structured_outputs: the in-process engine's text with the same structure, streamed and not, on both endpoints,
    and the text follows the structure."""
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["answer", "n"], "additionalProperties": False}
    messages = [{"role": "user", "content": PROMPTS[0]}]
    expected = engine.generate(PROMPTS[0], max_new_tokens=30, chat=True, structured_outputs={"json": schema})
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0,
                                          response_format={"type": "json_schema",
                                                           "json_schema": {"name": "answer", "schema": schema}})
    assert chat.choices[0].message.content == expected.text and chat.choices[0].finish_reason == "stop"
    assert json.loads(expected.text)["answer"] in ("yes", "no")
    for body in ({"guided_json": schema}, {"structured_outputs": {"json": schema}}):
        same = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0,
                                              extra_body=body)
        assert same.choices[0].message.content == expected.text, body
    obj = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                         response_format={"type": "json_object"})
    assert obj.choices[0].message.content == engine.generate(PROMPTS[0], max_new_tokens=8, chat=True,
                                                             structured_outputs={"json_object": True}).text
    choice = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=10, temperature=0,
                                       extra_body={"guided_choice": ["red", "green", "blue"]})
    assert choice.choices[0].text in ("red", "green", "blue") and choice.choices[0].finish_reason == "stop"
    regex = r"[0-9]{3}-[a-c]{2}"
    streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(
        model=MODEL, prompt=PROMPTS[1], max_tokens=10, temperature=0, stream=True, extra_body={"guided_regex": regex}))
    assert streamed == engine.generate(PROMPTS[1], max_new_tokens=10, structured_outputs={"regex": regex}).text
    assert re.fullmatch(regex, streamed)


def test_streamed_chat_usage_and_logprobs(client, engine):
    """stream_options.include_usage: every chunk has `usage: null` and a last chunk without choices has the usage of
    the unstreamed reply; streamed logprobs equal the unstreamed ones position by position."""
    options = dict(model=MODEL, messages=[{"role": "user", "content": PROMPTS[2]}], max_tokens=10, temperature=0,
                   logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**options)
    chunks = list(client.chat.completions.create(**options, stream=True, stream_options={"include_usage": True}))
    *content_chunks, usage_chunk = chunks
    assert usage_chunk.choices == [] and usage_chunk.usage == whole.usage
    assert all(c.usage is None for c in content_chunks)
    assert "".join(c.choices[0].delta.content or "" for c in content_chunks) == whole.choices[0].message.content
    streamed = [p for c in content_chunks if c.choices[0].logprobs for p in c.choices[0].logprobs.content]
    whole_content = whole.choices[0].logprobs.content
    assert [(p.token, p.bytes) for p in streamed] == [(p.token, p.bytes) for p in whole_content]
    # The second request's prompt is served from the prefix cache: logprobs equal up to float rounding.
    assert [lp for p in streamed for lp in [p.logprob] + [t.logprob for t in p.top_logprobs]] == \
        pytest.approx([lp for p in whole_content for lp in [p.logprob] + [t.logprob for t in p.top_logprobs]], abs=1e-5)
    assert len(streamed) == whole.usage.completion_tokens
    no_usage = list(client.chat.completions.create(**options, stream=True))
    assert all(c.usage is None and c.choices for c in no_usage)


def test_stream_options_need_stream(server):
    """As OpenAI answers: stream_options with stream false (or absent) is a 400 naming the field."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    for route, body in (("/completions", {"prompt": "x"}),
                        ("/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
        for stream in ({}, {"stream": False}):
            response = httpx.post(f"{server.url}{route}", headers=headers,
                                  json={"model": MODEL, "max_tokens": 2, "stream_options": {"include_usage": True},
                                        **body, **stream})
            assert response.status_code == 400 and error_of(response)["param"] == "stream_options", response.text


# -- other routes -----------------------------------------------------------------------------------------------------


def test_models_health_and_metrics(client, server, engine):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    assert httpx.get(f"{server.root}/health").json() == {"status": "ok"}
    metrics = server.metrics()
    assert metrics["fxllm_kv_blocks_total"] > 0 and metrics["fxllm_generation_tokens_total"] > 0
    for name in ("fxllm_num_requests_running", "fxllm_num_requests_waiting", "fxllm_kv_blocks_used",
                 "fxllm_prefix_cache_hit_rate", "fxllm_preemptions_total", "fxllm_prompt_tokens_total",
                 "fxllm_time_to_first_token_seconds_count", "fxllm_inter_token_latency_seconds_count",
                 "fxllm_num_requests_admitted", "fxllm_requests_total{finish_reason=length}",
                 "fxllm_prefill_computed_tokens_total", "fxllm_model_calls_total{kind=prefill}",
                 "fxllm_model_calls_total{kind=decode}", "fxllm_model_call_seconds_total{kind=decode}"):
        assert name in metrics, name


def test_model_calls_are_counted_by_kind(client, server):
    """One request alone: one prefill call computing its whole (uncached) prompt, then a decode call a token."""
    assert wait_until(lambda: server.metrics()["fxllm_num_requests_running"] == 0)
    before = server.metrics()
    response = client.completions.create(model=MODEL, prompt="Zebra counting " + PROMPTS[2], max_tokens=6,
                                         temperature=0, extra_body={"ignore_eos": True})
    after = server.metrics()
    grew = {name: after[name] - before.get(name, 0) for name in after if name.startswith("fxllm_model_call")
            or name == "fxllm_prefill_computed_tokens_total"}
    assert grew["fxllm_model_calls_total{kind=prefill}"] == 1 and grew["fxllm_model_calls_total{kind=decode}"] == 5
    assert grew["fxllm_prefill_computed_tokens_total"] == response.usage.prompt_tokens
    assert grew["fxllm_model_call_seconds_total{kind=prefill}"] > 0
    assert grew["fxllm_model_call_seconds_total{kind=decode}"] > 0


# -- errors -----------------------------------------------------------------------------------------------------------


def error_of(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert "\n" not in body["error"]["message"] and "Traceback" not in body["error"]["message"]
    return body["error"]


@pytest.mark.parametrize("body, status, param", [
    ({"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 10_000}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "n": 0}, 400, "n"),
    ({"model": MODEL, "prompt": "x", "frequency_penalty": 2.5}, 400, "frequency_penalty"),
    ({"model": MODEL, "prompt": "x", "presence_penalty": -3}, 400, "presence_penalty"),
    ({"model": MODEL, "prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ({"model": MODEL, "prompt": "x", "min_p": 1.5}, 400, "min_p"),
    ({"model": MODEL, "prompt": "x", "logit_bias": {"hello": 1}}, 400, "logit_bias"),
    ({"model": MODEL, "prompt": "x", "logit_bias": {"-5": 1}}, 400, "logit_bias"),
    ({"model": MODEL, "prompt": "x", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ({"model": MODEL, "prompt": "x", "logit_bias": {"5": "up"}}, 400, "logit_bias"),
    ({"model": MODEL, "prompt": "x", "logit_bias": {"10000000": 1}}, 400, "logit_bias"),
    ({"model": MODEL, "prompt": "x", "logit_bias": {"9" * 5000: 1}}, 400, "logit_bias"),  # int() refuses: was a 500
    ({"model": MODEL, "prompt": "x", "logit_bias": {"\u0663": 1}}, 400, "logit_bias"),  # int() would read 3
    ({"model": MODEL, "prompt": "x", "repetition_penalty": 1e-40}, 400, "repetition_penalty"),  # was inf logits
    ({"model": MODEL, "prompt": "x", "max_tokens": 4, "min_tokens": 5}, 400, "min_tokens"),
    ({"model": MODEL, "prompt": "x", "allowed_token_ids": []}, 400, "allowed_token_ids"),
    ({"model": MODEL, "prompt": "x", "allowed_token_ids": [1, 10 ** 7]}, 400, "allowed_token_ids"),
    ({"model": MODEL, "prompt": "x", "allowed_token_ids": [2], "min_tokens": 1}, 400, "allowed_token_ids"),
    ({"model": MODEL, "prompt": "x", "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    ({"model": MODEL, "prompt": "x", "stop_token_ids": list(range(49152)), "min_tokens": 1}, 400, "stop_token_ids"),
    ({"model": MODEL, "prompt": "x", "stop_token_ids": list(range(65537))}, 400, "stop_token_ids"),
    ({"model": MODEL, "prompt": "x", "logit_bias": {str(i): 1 for i in range(1025)}}, 400, "logit_bias"),
    ({"model": MODEL, "prompt": "x", "bad_words": "Paris"}, 400, "bad_words"),  # a list, as vLLM's
    ({"model": MODEL, "prompt": "x", "bad_words": ["ok", " "]}, 400, "bad_words"),
    ({"model": MODEL, "prompt": "x", "bad_words": ["x"] * 257}, 400, "bad_words"),
    ({"model": MODEL, "prompt": "x", "bad_words": ["x"], "allowed_token_ids": [104, 1792]}, 400,
     "bad_words"),  # the ids of "x" and " x"
    ({"model": MODEL, "prompt": "x", "skip_special_tokens": "no"}, 400, "skip_special_tokens"),
    ({"model": MODEL, "prompt": "x", "guided_regex": "a(b"}, 400, "guided_regex"),
    ({"model": MODEL, "prompt": "x", "guided_json": {"type": "foo"}}, 400, "guided_json"),
    ({"model": MODEL, "prompt": "x", "guided_json": "{not json"}, 400, "guided_json"),
    ({"model": MODEL, "prompt": "x", "guided_choice": "yes"}, 400, "guided_choice"),
    ({"model": MODEL, "prompt": "x", "guided_choice": ["a"], "min_tokens": 1}, 400, "guided_choice"),
    ({"model": MODEL, "prompt": "x", "guided_grammar": "root ::= ("}, 400, "guided_grammar"),
    ({"model": MODEL, "prompt": "x", "guided_json": {"type": "number", "maximum": float("nan")}}, 400,
     "guided_json"),  # JSON's NaN, which the body parser takes: was a 500
    ({"model": MODEL, "prompt": "x", "guided_regex": "a\ud800"}, 400, "guided_regex"),  # a lone surrogate: was a 500
    ({"model": MODEL, "prompt": "x", "structured_outputs": {"jsn": {}}}, 400, "structured_outputs"),
    ({"model": MODEL, "prompt": "x", "response_format": {"type": "xml"}}, 400, "response_format"),
    ({"model": MODEL, "prompt": "x", "response_format": {"type": "json_schema"}}, 400, "response_format"),
    ({"model": MODEL, "prompt": "x", "response_format": {"type": "json_object"}, "guided_regex": "a"}, 400,
     "guided_regex"),
    ({"model": MODEL, "prompt": []}, 400, "prompt"),
    ({"model": MODEL, "prompt": [1, 2, 10 ** 9]}, 400, "prompt"),
    ({"model": "gpt-4", "prompt": "x"}, 404, "model"),
    ({"model": MODEL, "prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": {"text": "x"}}, 400, "prompt"),
    ({"model": MODEL}, 400, "prompt"),
    ({"model": MODEL, "prompt": "x", "max_tokens": True}, 400, "max_tokens"),  # no bool is a number
    ({"model": MODEL, "prompt": "x", "temperature": True}, 400, "temperature"),
    ({"model": MODEL, "prompt": "x", "stream": "yes"}, 400, "stream"),
    ({"model": MODEL, "prompt": [True, False]}, 400, "prompt.0"),  # the element at fault
])
def test_completion_errors(server, body, status, param):
    # JSON as Python writes it: NaN and lone-surrogate escapes too, which the server's parser takes (httpx's refuses)
    response = httpx.post(f"{server.url}/completions", content=json.dumps(body),
                          headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
    assert response.status_code == status, response.text
    assert error_of(response)["param"] == param


def test_errors_name_the_field_the_client_sent(server):
    """A refusal names the request's own field: chat's max_completion_tokens (the engine's max_tokens), and the
    prompt of a list by its index."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
    for field in ("max_completion_tokens", "max_tokens"):
        response = httpx.post(f"{server.url}/chat/completions", headers=headers, json={**chat, field: 0})
        error = error_of(response)
        assert response.status_code == 400 and error["param"] == field and error["message"].startswith(field), error
    response = httpx.post(f"{server.url}/completions", headers=headers,
                          json={"model": MODEL, "prompt": [[1], [2, 10 ** 9]], "max_tokens": 2})
    error = error_of(response)
    assert response.status_code == 400 and error["param"] == "prompt" and "prompt[1][1] = 1000000000" in \
        error["message"], error


def test_a_small_kv_pool_bounds_the_longest_sequence_served(serve_artifact):
    """/v1/models reports the longest sequence the KV pool holds where it is less than the context, and a request
    the pool cannot hold is refused naming max_tokens (the field a client sets; not the Python API's
    max_new_tokens)."""
    from fxllm.runtime.async_engine import AsyncEngine
    from fxllm.serving.errors import APIError
    from fxllm.serving.service import Choice, OpenAIService, ServingConfig

    engine = AsyncEngine(fxllm.load(serve_artifact, kv_blocks=8))
    try:
        service = OpenAIService(engine, ServingConfig(model_names=(MODEL,)))
        longest = asyncio.run(service.card(MODEL)).max_model_len
        assert longest == 8 * engine.engine.block_size < engine.engine.max_context
        with pytest.raises(APIError) as refused:
            service.start([Choice(0, [1, 2], SamplingParams(max_tokens=longest))], "too-long")
        assert refused.value.param == "max_tokens" and "KV blocks" in refused.value.message
        assert "max_new_tokens" not in refused.value.message
    finally:
        asyncio.run(engine.shutdown(0))


@pytest.mark.parametrize("top", [21, -1])
def test_chat_top_logprobs_out_of_range_names_it(server, top):
    response = httpx.post(f"{server.url}/chat/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                          json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
                                "logprobs": True, "top_logprobs": top})
    assert response.status_code == 400 and error_of(response)["param"] == "top_logprobs", response.text


def test_lone_surrogates_are_refused_in_one_line(server):
    """A lone surrogate (legal in JSON as `\\ud800`, not encodable as UTF-8) in the model name is its 404, with the
    name escaped; in a chat message a 400 naming `messages`, as in a completion prompt one naming `prompt`. The
    keep-alive connection keeps serving."""
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=60) as client:
        for route, content, status, param in (
                ("/completions", '{"model": "\\ud800", "prompt": "hi", "max_tokens": 2}', 404, "model"),
                ("/chat/completions", '{"model": "\\ud800", "messages": [{"role": "user", "content": "hi"}]}', 404,
                 "model"),
                ("/chat/completions", '{"model": "%s", "max_tokens": 2, "messages": [{"role": "user", "content": '
                                      '"hi \\ud800"}]}' % MODEL, 400, "messages"),
                ("/chat/completions", '{"model": "%s", "max_tokens": 2, "messages": [{"role": "user", "content": '
                                      '[{"type": "text", "text": "\\udc00"}]}]}' % MODEL, 400, "messages"),
                ("/completions", '{"model": "%s", "prompt": "a\\ud800", "max_tokens": 2}' % MODEL, 400, "prompt")):
            response = client.post(route, content=content)
            assert response.status_code == status and error_of(response)["param"] == param, response.text
        assert "\\ud800" in client.post("/completions", content='{"model": "\\ud800", "prompt": "x"}').json()[
            "error"]["message"]
        assert client.post("/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2}).status_code == 200


def test_an_unknown_model_name_is_not_repeated_whole(server):
    response = httpx.post(f"{server.url}/completions", json={"model": "m" * 60_000, "prompt": "x"},
                          headers={"Authorization": f"Bearer {API_KEY}"})
    assert response.status_code == 404 and len(error_of(response)["message"]) < 300


def test_text_offsets_count_characters_of_the_text(client):
    """text_offset is where each token starts in the choice's text, in characters: tokens holding part of a
    multi-byte character (emoji, CJK) add no character until the one that completes it."""
    for prompt, echo in (("I love 🦜🦜 and 中文 ok", True), ("Emoji list: 🦜", False)):
        choice = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, logprobs=1,
                                           echo=echo).choices[0]
        offsets, tokens, text = choice.logprobs.text_offset, choice.logprobs.tokens, choice.text
        assert offsets == sorted(offsets) and offsets[-1] <= len(text), (offsets, text)
        for offset, token in zip(offsets, tokens):
            if not token.startswith("bytes:"):
                assert text[offset: offset + len(token)] == token, (offset, token, text)
        if echo:
            assert any(token.startswith("bytes:") for token in tokens)  # the emoji came in pieces


def test_a_generated_special_token_adds_no_character(engine):
    """A generated text is decoded without special tokens, so a special token's text_offset is the next
    character's (it pointed past the text's end); an echoed prompt's text keeps them, and counts them."""
    from fxllm.runtime.request import TokenLogprobs
    from fxllm.serving.logprobs import TextOffsets, TokenTexts, completion_logprobs

    tokenizer = engine.tokenizer
    special = min(tokenizer.all_special_ids)
    ids = tokenizer.encode("Hi there", add_special_tokens=False)
    ids = [ids[0], special, *ids[1:]]
    positions = [TokenLogprobs(i, -1.0) for i in ids]
    texts = TokenTexts(tokenizer)
    generated = completion_logprobs(texts, positions, TextOffsets())
    text = tokenizer.decode(ids)
    assert generated.tokens[1] == tokenizer.token_bytes(special).decode()  # listed with its text
    assert generated.text_offset[1] == generated.text_offset[2] <= len(text)
    for offset, token in zip(generated.text_offset[2:], generated.tokens[2:]):
        assert text[offset:offset + len(token)] == token
    echoed = completion_logprobs(texts, positions, TextOffsets(), generated=False)
    prompt_text = tokenizer.decode(ids, skip_special_tokens=False)
    for offset, token in zip(echoed.text_offset, echoed.tokens):
        assert prompt_text[offset:offset + len(token)] == token


def test_a_list_of_more_prompts_than_the_server_admits_is_refused_before_tokenizing(client):
    """The number of choices (prompts × n) is known before any prompt is tokenized: 100,000 one-word prompts are
    refused at once (they were tokenized one by one first, then built into choices on the event loop), naming the
    prompt when it alone is too many, n when n > 1."""
    for prompt, n, param in ((["a"] * 100_000, 1, "prompt"), ([[5]] * 40, 2, "n")):
        started = time.perf_counter()
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model=MODEL, prompt=prompt, n=n, max_tokens=1)
        assert refused.value.body["param"] == param and f"asks for {len(prompt) * n} completions" in \
            refused.value.body["message"], refused.value.body
        print(f"{len(prompt)} prompts × {n} refused in {time.perf_counter() - started:.2f} s")


def test_a_long_prompt_is_tokenized_off_the_event_loop(server):
    """A conversation near the body limit takes seconds to render and tokenize; meanwhile the server answers others
    (before it, /health waited until that prompt's 400). Many messages: one long one is refused from its head."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    huge = {"model": MODEL, "messages": [{"role": "user", "content": "word " * 8}] * 60_000}
    finished = []

    async def main():
        async with httpx.AsyncClient(base_url=server.url, headers=headers, timeout=120) as client:
            async def request(name, coroutine):
                response = await coroutine
                finished.append((name, response.status_code))

            big = asyncio.create_task(request("huge", client.post("/chat/completions", json=huge)))
            await asyncio.sleep(0.3)  # the body has arrived: its tokenization is under way
            await request("health", client.get(f"{server.root}/health"))
            await big

    asyncio.run(main())
    assert finished == [("health", 200), ("huge", 400)]


def test_error_statuses_through_the_client(client, server):
    """Each status as the openai client reports it, and the server keeps serving after all of them."""
    cases = [
        (openai.BadRequestError, lambda: client.chat.completions.create(model=MODEL, messages=[])),
        (openai.BadRequestError, lambda: client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], top_logprobs=2)),
        (openai.AuthenticationError, lambda: openai.OpenAI(base_url=server.url, api_key="wrong", max_retries=0)
         .models.list()),
        (openai.NotFoundError, lambda: client.completions.create(model="nope", prompt="x")),
        (openai.BadRequestError, lambda: client.chat.completions.create(  # a schema error: 400, as OpenAI answers
            model=MODEL, messages=[{"role": "wizard", "content": "x"}])),
    ]
    for error, call in cases:
        with pytest.raises(error) as raised:
            call()
        assert raised.value.body["message"], raised.value.body
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    assert httpx.post(f"{server.url}/completions", content=b'{"model": ', headers=headers).status_code == 400
    empty = httpx.post(f"{server.url}/completions", content=b"", headers=headers)
    assert empty.status_code == 400 and error_of(empty)["message"] == "the request has no body (a JSON object)"
    assert error_of(httpx.post(f"{server.url}/completions", content=b"{}"))["code"] == "invalid_api_key"
    for header, status in ((f"bearer {API_KEY}", 400), (f"BEARER  {API_KEY}", 400), (f"Basic {API_KEY}", 401),
                           (f"Bearer {API_KEY}x", 401), ("Bearer", 401)):  # the scheme in any case (RFC 7235)
        sent = {"Authorization": header, "Content-Type": "application/json"}
        assert httpx.post(f"{server.url}/completions", content=b"{}", headers=sent).status_code == status, header
    too_big = httpx.post(f"{server.url}/completions", headers=headers,
                         content=json.dumps({"model": MODEL, "prompt": "x" * (5 << 20)}))
    assert (too_big.status_code, error_of(too_big)["code"]) == (413, "request_too_large")

    def chunked():
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(5):
            yield b"x" * (1 << 20)
        yield b'"}'

    assert httpx.post(f"{server.url}/completions", headers=headers, content=chunked()).status_code == 413
    assert error_of(httpx.get(f"{server.url}/nowhere", headers=headers))["param"] is None
    assert client.completions.create(model=MODEL, prompt="still serving", max_tokens=2).choices[0].text is not None


def test_two_services_in_one_process_keep_their_own_metrics(engine):
    """Each service has a registry of its own (Ray runs several replicas' apps per process): no name collides, and
    each renders its own counters."""
    from fxllm.serving.metrics import ServingMetrics

    first, second = ServingMetrics(engine.stats, {"model_name": "a"}), ServingMetrics(engine.stats, {"model_name": "a"})
    first.finished("stop")
    texts = [metrics.render()[0].decode() for metrics in (first, second)]
    assert all("fxllm_kv_blocks_total" in text for text in texts)
    assert 'fxllm_requests_total{finish_reason="stop",model_name="a"} 1.0' in texts[0]
    assert "fxllm_requests_total{" not in texts[1]
