"""A model whose tokenizer reaches past its vocabulary (here: SmolLM2's 49,152-token tokenizer on a 1,000-row
embedding): the compile warns, and a text that tokenizes to an id outside the vocabulary is refused with a message
about the tokenizer, not about token ids the caller never gave — in the Python API (one prompt, a batch naming its
row, chat), and over HTTP (400 naming `prompt` or `messages`). Ids within the vocabulary still generate."""

from __future__ import annotations

import socket

import openai
import pytest
import torch

import fxllm
from fxllm.errors import InvalidArgumentError
from tests.conftest import TINY_COMMON
from tests.serving.conftest import app_on_uvicorn

ROWS = 1000
MISMATCH = "the artifact's tokenizer does not match its model"


@pytest.fixture(scope="module")
def compiled(tmp_path_factory, tokenizer):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**{**TINY_COMMON, "vocab_size": ROWS})).eval()
    source = tmp_path_factory.mktemp("small-vocab")
    model.save_pretrained(source)
    tokenizer.save_pretrained(source)
    output = tmp_path_factory.mktemp("small-vocab-artifact") / "artifact"
    report = fxllm.compile(source, output)
    return report, output


@pytest.fixture(scope="module")
def engine(compiled):
    return fxllm.load(compiled[1], threads=1)


def out_of_range(engine, text: str) -> bool:
    return any(token >= ROWS for token in engine.tokenizer.encode(text))


def test_the_compile_warns_that_the_tokenizer_reaches_past_the_vocabulary(compiled):
    report, _ = compiled
    assert any("past the model's vocabulary of 1,000" in note for note in report.notes), report.notes


def test_a_text_beyond_the_vocabulary_is_refused_naming_the_tokenizer(engine):
    assert out_of_range(engine, "Hello world")
    with pytest.raises(InvalidArgumentError, match=MISMATCH) as refused:
        engine.generate("Hello world", max_new_tokens=2)
    assert refused.value.param == "prompt" and "prompt_ids" not in str(refused.value)
    with pytest.raises(InvalidArgumentError, match=MISMATCH):
        engine.generate("Hello world", max_new_tokens=2, chat=True)
    with pytest.raises(InvalidArgumentError, match=MISMATCH):
        engine.stream("Hello world", max_new_tokens=2)


def test_a_batch_names_the_row_whose_text_is_beyond_the_vocabulary(engine):
    inside = next(text for text in ("a", "b", "c", "the", "1") if not out_of_range(engine, text))
    with pytest.raises(InvalidArgumentError, match=r"^prompts\[1\]: .*" + MISMATCH):
        engine.generate([inside, "Hello world"], max_new_tokens=2)
    # nothing was left running: the engine still generates, from ids within the vocabulary
    result = engine.generate_ids([[1, 5, 7, 11]], max_new_tokens=3)[0]
    assert len(result.token_ids) == 3 and all(0 <= t < ROWS for t in result.token_ids)


def test_over_http_a_text_beyond_the_vocabulary_is_a_400(engine):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    with app_on_uvicorn(engine, "small", listener):
        host, port = listener.getsockname()
        client = openai.OpenAI(base_url=f"http://{host}:{port}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError) as completion:
            client.completions.create(model="small", prompt="Hello world", max_tokens=2)
        with pytest.raises(openai.BadRequestError) as chat:
            client.chat.completions.create(model="small", messages=[{"role": "user", "content": "Hello world"}],
                                           max_tokens=2)
        ids = client.completions.create(model="small", prompt=[1, 5, 7, 11], max_tokens=2, temperature=0)
    listener.close()
    assert completion.value.body["param"] == "prompt" and MISMATCH in completion.value.body["message"]
    assert chat.value.body["param"] == "messages" and MISMATCH in chat.value.body["message"]
    assert ids.choices[0].finish_reason == "length"


def test_eval_names_the_model_whose_tokenizer_does_not_match(compiled, make_tiny_artifact, tmp_path):
    """`fxllm eval` scored the first window and failed on `token_ids[0] = 19556 is not a token id` (an artifact) or
    an IndexError inside torch (a transformers directory); the text is checked against both vocabularies first."""
    from fxllm.errors import EvaluationError
    from fxllm.evaluation import evaluate

    text = tmp_path / "text.txt"
    text.write_text("Hello world, the weather is fine today. " * 4)
    with pytest.raises(EvaluationError, match="outside the vocabulary of the model .* does not match it"):
        evaluate(compiled[1], text)
    with pytest.raises(EvaluationError, match="outside the vocabulary of the reference .* does not match it"):
        evaluate(make_tiny_artifact("llama"), text, reference=compiled[1])
