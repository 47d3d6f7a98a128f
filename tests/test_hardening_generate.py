"""Hardening of generation and the CLI (issue #16 items 2, 6, 8): every bad argument, from the Python API or the
command line, is a one-line FxllmError / exit status 1 naming it; nothing returns silent garbage (all-zero ids from
non-finite probabilities); `fxllm eval` and the engine's load options refuse nonsense; exit status 2 is for bugs."""

from __future__ import annotations

import io
import json
import math
import re
import shutil
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import fxllm
from fxllm.cli import main
from fxllm.errors import ArtifactError, FxllmError, GenerationError, InvalidArgumentError
from fxllm.runtime.sampler import Sampler, SamplingParams, probabilities

# Only names the code before issue #16 already had are imported at module level: run against that code, every
# regression test here fails on its own assertion rather than on an import.
MANIFEST = "manifest.json"

FINISH_REASONS = {"eos", "stop", "length", "context"}


@pytest.fixture(scope="module")
def contiguous(make_tiny_artifact) -> Path:
    return make_tiny_artifact("llama")


@pytest.fixture(scope="module")
def paged(tiny_paged_artifact) -> Path:
    return tiny_paged_artifact


@pytest.fixture(scope="module")
def engines(contiguous, paged) -> dict:
    return {"contiguous": fxllm.load(contiguous), "paged": fxllm.load(paged, kv_blocks=512)}


def cli(*argv: str) -> tuple[int, str, str]:
    """fxllm.cli.main in this process, with stdout and stderr captured."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def assert_one_line_error(code: int, err: str, pattern: str = "") -> None:
    assert code == 1, (code, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fxllm: error: "), err
    assert pattern in lines[0], lines[0]


# -- 2: silent garbage ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["contiguous", "paged"])
@pytest.mark.parametrize("temperature", [float("nan"), float("inf"), -float("inf"), -1.0])
def test_non_finite_or_negative_temperature_is_refused(engines, kind, temperature):
    with pytest.raises(FxllmError, match="temperature must be") as caught:
        engines[kind].generate("Paris is", max_new_tokens=3, temperature=temperature)
    assert getattr(caught.value, "param", None) == "temperature"


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
@pytest.mark.parametrize("temperature", [1e-320, 1e-308, 5e-6])
def test_tiny_temperature_is_greedy(engines, kind, temperature):
    """Documented choice: 0 < temperature < 1e-5 samples greedily (the limit of the distribution), never overflows."""
    engine = engines[kind]
    greedy = engine.generate("Paris is", max_new_tokens=6).token_ids
    assert engine.generate("Paris is", max_new_tokens=6, temperature=temperature, seed=0).token_ids == greedy
    assert SamplingParams(temperature=temperature).greedy and not SamplingParams(temperature=1e-5).greedy


def test_cli_nan_temperature_is_an_error(contiguous):
    assert_one_line_error(*cli("generate", str(contiguous), "--prompt", "hi", "--temperature", "nan")[::2],
                          "temperature must be a finite number, got nan")


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_sampler_refuses_non_finite_logits(bad):
    logits = np.random.default_rng(0).standard_normal((2, 16)).astype(np.float32)
    logits[1, 3] = bad
    for params in (SamplingParams(), SamplingParams(temperature=0.7, seed=0)):
        with pytest.raises(GenerationError, match="non-finite logits"):
            Sampler(params, 2)(logits)
    masked = np.full((1, 16), -np.inf, dtype=np.float32)
    masked[0, 5] = 1.0  # -inf is a masked token, not an error
    assert probabilities(masked, SamplingParams(temperature=1.0))[0, 5] == 1.0
    with pytest.raises(GenerationError, match="non-finite logits"):
        probabilities(np.full((1, 16), -np.inf, dtype=np.float32), SamplingParams(temperature=1.0))
    with pytest.raises(GenerationError, match="non-finite logits"):  # greedy: a row with no finite value
        Sampler(SamplingParams(), 2)(np.stack([logits[0], np.full(16, -np.inf, dtype=np.float32)]))


class _FixedDraw:
    """A random stream that always draws `value`: the edges of the inverse-CDF draw, which real streams hit rarely."""

    def __init__(self, value: float):
        self.value = value

    def random(self) -> float:
        return self.value


@pytest.mark.parametrize("draw", [0.0, 1.0])
def test_sampler_never_picks_a_zero_probability_token(draw):
    logits = np.asarray([[0.0, 3.0, 2.0, -1.0]], dtype=np.float32)
    sampler = Sampler(SamplingParams(temperature=1.0, top_k=2), 1)
    sampler.rngs = [_FixedDraw(draw)]  # 0.0 is a possible draw; 1.0 stands for a draw that rounds up to the total
    token = int(sampler(logits)[0])
    assert probabilities(logits, sampler.params)[0, token] > 0


# -- 8 (generate part): token ids, types, max_new_tokens ---------------------------------------------------------

@pytest.mark.parametrize("kind", ["contiguous", "paged"])
@pytest.mark.parametrize("ids, message", [
    ([[-1, 5]], r"prompt_ids\[0\]\[0\] = -1 is not a token id of this model \(0 to 49151\)"),
    ([[5, 49152]], r"prompt_ids\[0\]\[1\] = 49152 is not a token id"),
    ([[5, 10**6]], r"prompt_ids\[0\]\[1\] = 1000000 is not a token id"),
    ([[1.5, 5]], r"prompt_ids\[0\]\[0\] must be an integer, got float 1.5"),
    ([[True, 5]], r"prompt_ids\[0\]\[0\] must be an integer, got bool True"),
    (["ab"], r"prompt_ids\[0\] must be a list of token ids, got str 'ab'"),
    ([5], r"prompt_ids\[0\] must be a list of token ids, got int 5"),
    ([], "no prompts given"),
])
def test_generate_ids_checks_every_id(engines, kind, ids, message):
    with pytest.raises(FxllmError, match=message) as caught:
        engines[kind].generate_ids(ids, 2)
    assert getattr(caught.value, "param", None) == "prompt_ids"


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
def test_generate_ids_takes_numpy(engines, kind):
    engine = engines[kind]
    ids = engine.encode("Paris is")
    expected = engine.generate_ids([ids], 3)[0].token_ids
    assert engine.generate_ids(np.asarray([ids], dtype=np.int64), np.int64(3))[0].token_ids == expected


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
@pytest.mark.parametrize("arguments, param", [
    (dict(max_new_tokens=2.5), "max_new_tokens"),
    (dict(max_new_tokens=True), "max_new_tokens"),
    (dict(max_new_tokens="3"), "max_new_tokens"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(temperature="1"), "temperature"),
    (dict(temperature=None), "temperature"),
    (dict(top_k=1.5), "top_k"),
    (dict(top_k=-1), "top_k"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=float("nan")), "top_p"),
    (dict(seed=1.5), "seed"),
    (dict(seed=-2**63 - 1), "seed"),
    (dict(seed=True), "seed"),
    (dict(stop=5), "stop"),
    (dict(stop=[5]), "stop"),
    (dict(stop="a\ud800"), "stop"),
    (dict(stop=["a"] * 17), "stop"),
    (dict(stop="a" * 1025), "stop"),
    (dict(chat="yes"), "chat"),
])
def test_wrong_types_and_ranges_name_the_parameter(engines, kind, arguments, param):
    """Before: raw TypeError/ValueError, and max_new_tokens=2.5 ran on the paged engine but not the contiguous one."""
    engine = engines[kind]
    calls = [lambda: engine.generate("Paris is", **arguments), lambda: engine.stream("Paris is", **arguments)]
    if "chat" not in arguments:  # generate_ids has no chat argument
        calls.append(lambda: engine.generate_ids([[5, 6]], **arguments))
    for call in calls:
        with pytest.raises(FxllmError, match=param) as caught:
            call()
        assert getattr(caught.value, "param", None) == param and "\n" not in str(caught.value)


def test_stop_strings_are_bounded_and_counted_before_they_are_checked():
    """A stop string is searched for after every token; a request's list is counted before its strings are checked,
    so a generator of a million never gets walked."""
    from fxllm.runtime.request import SamplingParams

    with pytest.raises(FxllmError, match=r"^stop holds more than 16 strings$"):
        SamplingParams(stop=(f"s{i}" for i in range(10**6)))
    with pytest.raises(FxllmError, match=r"^stop\[1\] has 1,025 characters; at most 1,024$"):
        SamplingParams(stop=["ok", "y" * 1025])
    with pytest.raises(FxllmError, match=r"^stop has 1,025 characters; at most 1,024$"):
        SamplingParams(stop="y" * 1025)
    assert SamplingParams(stop=["z" * 1024] * 16).stop == ("z" * 1024,) * 16


@pytest.mark.parametrize("prompts", [None, 5, b"bytes", {"a": 1}, [5], ["ok", None], "a\ud800b", ["ok", "\udcff"]])
def test_bad_prompts_are_refused(engines, prompts):
    with pytest.raises(FxllmError, match="prompt") as caught:
        engines["contiguous"].generate(prompts, max_new_tokens=2)
    assert getattr(caught.value, "param", None) in ("prompt", "prompts")


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
def test_a_refused_prompt_of_a_batch_is_named(engines, kind, contiguous):
    """Each prompt of a batch is checked alone ("the prompt is 301 tokens"): the refusal names which one, in the
    Python API and on the command line (three --prompt flags), and nothing of the batch runs."""
    engine = engines[kind]
    finished = engine.stats().requests_finished
    with pytest.raises(FxllmError, match=r"^prompts\[1\]: the prompt is 301 tokens") as caught:
        engine.generate(["hi", "hi " * 300, "yo"], max_new_tokens=2)
    assert caught.value.param == "prompt"
    with pytest.raises(FxllmError, match=r"^prompt_ids\[2\]: the prompt is empty after tokenization"):
        engine.generate_ids([[5], [6], []], max_new_tokens=2)
    with pytest.raises(FxllmError, match=r"^the prompt is 301 tokens"):  # a single prompt: no index
        engine.generate("hi " * 300, max_new_tokens=2)
    assert engine.stats().requests_finished == finished
    assert_one_line_error(*cli("generate", str(contiguous), "--prompt", "x", "--prompt", "", "--prompt", "y")[::2],
                          "fxllm: error: prompts[1]: the prompt is empty after tokenization")


def test_a_prompt_of_megabytes_is_refused_from_its_head(engines, monkeypatch):
    """A text far longer than the context (1.2 MB, a 256-token model) is refused by its first 32 characters per
    context token alone, in one line, as a chat message too; the tokenizer never sees the rest of it."""
    from fxllm.runtime.request_validation import HEAD_CHARS_PER_TOKEN
    engine = engines["contiguous"]
    seen = []
    encode = engine.tokenizer.encode
    monkeypatch.setattr(engine.tokenizer, "encode", lambda text, **kw: seen.append(len(text)) or encode(text, **kw))
    for chat in (False, True):
        with pytest.raises(InvalidArgumentError, match=r"^the prompt is more than [\d,]+ tokens \(its first 8,192 of "
                                                       r"1,2\d\d,\d+ characters alone are") as caught:
            engine.generate("hello " * 200_000, max_new_tokens=2, chat=chat)
        assert caught.value.param == "prompt" and "\n" not in str(caught.value)
    assert seen and max(seen) <= HEAD_CHARS_PER_TOKEN * engine.max_context, seen
    assert engine.generate("hello " * 10, max_new_tokens=2).token_ids  # a short one still runs


def test_stream_checks_its_arguments_when_called(engines):
    """stream() raises at the call, not at the first next(): a server can answer the error before streaming."""
    with pytest.raises(FxllmError, match="seed"):
        engines["paged"].stream("Paris is", temperature=1.0, seed=-2**64)
    pieces = list(engines["paged"].stream("Paris is", max_new_tokens=5))
    assert "".join(pieces) == engines["paged"].generate("Paris is", max_new_tokens=5).text


# -- 6: user errors are exit status 1 -----------------------------------------------------------------------------

def test_a_seed_below_int64_is_a_user_error_and_a_negative_one_samples(contiguous):
    """OpenAI's API and vLLM take any int64 seed: -1 was refused ("seed must be >= 0"), which failed clients that
    send one. A negative seed samples reproducibly, as seed mod 2**64; one below -2**63 is an error."""
    assert_one_line_error(*cli("generate", str(contiguous), "--prompt", "hi", "--temperature", "1", "--seed",
                               str(-2**63 - 1))[::2], f"seed must be >= {-2**63}, got {-2**63 - 1}")
    runs = [json.loads(cli("generate", str(contiguous), "--prompt", "hi", "--temperature", "1", "--seed", seed,
                           "--max-new-tokens", "8", "--json")[1])["token_ids"] for seed in ("-1", "-1", str(2**64 - 1))]
    assert runs[0] == runs[1] == runs[2]


def test_prompt_that_is_not_utf8_is_a_user_error(contiguous):
    """Invalid UTF-8 in argv reaches Python as lone surrogates (surrogateescape)."""
    assert_one_line_error(*cli("generate", str(contiguous), "--prompt", "\udcff\udcfe")[::2],
                          "prompt is not valid Unicode")


@pytest.mark.parametrize("options, param", [
    ({"verify": "no"}, "verify"), ({"prefix_caching": "yes"}, "prefix_caching"), ({"spin": 0}, "spin"),
    ({"int8_activations": "yes"}, "int8_activations"), ({"unrolled_draft": "x"}, "unrolled_draft"),
    ({"providers": "CPUExecutionProvider"}, "providers"), ({"providers": [3]}, "providers"),
    ({"device": "cuda"}, "device"), ({"torch_compile": True}, "torch_compile"),
])
def test_load_switches_are_booleans_and_apply_to_their_backend(contiguous, options, param):
    """A truthy string is not a switch, and an option of another backend is refused rather than ignored."""
    with pytest.raises(InvalidArgumentError) as refused:
        fxllm.load(contiguous, **options)
    assert refused.value.param == param and "\n" not in str(refused.value)


def test_an_execution_provider_this_build_lacks_is_refused(contiguous):
    """ONNX Runtime itself prints a banner and falls back to the CPU; the engine says so in one line."""
    with pytest.raises(ArtifactError, match="execution provider NopeExecutionProvider is not in this ONNX Runtime"):
        fxllm.load(contiguous, providers=["NopeExecutionProvider"])
    assert fxllm.load(contiguous, providers=["CPUExecutionProvider"]).backend.providers == ["CPUExecutionProvider"]


def test_huge_kv_pool_is_refused_before_allocating(paged):
    assert_one_line_error(*cli("generate", str(paged), "--prompt", "hi", "--kv-blocks", "1000000000000")[::2],
                          "of memory available; ask for fewer blocks")
    with pytest.raises(GenerationError, match="a KV budget of 1000000GiB needs"):
        fxllm.load(paged, kv_cache_memory="1000000GiB")


def test_manifest_that_is_not_utf8_is_a_user_error(contiguous, tmp_path):
    copy = tmp_path / "artifact"
    shutil.copytree(contiguous, copy)
    (copy / MANIFEST).write_bytes(b"\xff\xfe{")
    for command in ("generate", "inspect"):
        argv = [command, str(copy)] + (["--prompt", "hi"] if command == "generate" else [])
        assert_one_line_error(*cli(*argv)[::2], "manifest.json is corrupt")


@pytest.mark.parametrize("argv, message", [
    (["--threads", "0"], "threads must be >= 1, got 0"),
    (["--threads", "-1"], "threads must be >= 1, got -1"),
    (["--max-batch", "0"], "max_batch must be >= 1, got 0"),
    (["--max-tokens-per-step", "0"], "max_tokens_per_step must be >= 1, got 0"),
    (["--max-new-tokens", "abc"], "argument --max-new-tokens/--max-tokens: invalid int value: 'abc'"),
    (["--temperature", ""], "argument --temperature: invalid float value: ''"),
    (["--kv-blocks", "4"], "kv_blocks applies to paged artifacts"),
    (["--kv-blocks", "4", "--kv-cache-memory", "1MB"],
     "kv_blocks and kv_cache_memory both size the KV cache; give one"),
    (["--bogus"], "unrecognized arguments: --bogus"),
])
def test_hostile_command_lines_are_user_errors(contiguous, argv, message):
    assert_one_line_error(*cli("generate", str(contiguous), "--prompt", "hi", *argv)[::2], message)


def test_usage_errors_are_one_line_and_exit_1():
    assert_one_line_error(*cli()[::2], "the following arguments are required: COMMAND")
    assert_one_line_error(*cli("frobnicate")[::2], "invalid choice: 'frobnicate'")


# -- 8 (eval part) --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("eval-text") / "text.txt"
    path.write_text("The quick brown fox jumps over the lazy dog. " * 8)
    return path


@pytest.mark.parametrize("max_tokens", ["0", "-3", "1"])
def test_eval_max_tokens_below_two_is_refused(contiguous, text_file, max_tokens):
    """Before: 0 scored the whole text, -3 silently dropped the last 3 tokens."""
    assert_one_line_error(*cli("eval", str(contiguous), "--text", str(text_file), "--ctx", "64", "--max-tokens",
                               max_tokens)[::2], f"--max-tokens must be an integer of at least 2, got {max_tokens}")


def test_eval_scores_exactly_max_tokens(contiguous, text_file):
    code, out, _ = cli("eval", str(contiguous), "--text", str(text_file), "--ctx", "64", "--max-tokens", "20", "--json")
    assert code == 0 and json.loads(out)["tokens"] == 19  # 20 tokens, one window: 19 predicted


def test_eval_text_that_is_a_directory_or_binary(contiguous, tmp_path):
    assert_one_line_error(*cli("eval", str(contiguous), "--text", str(tmp_path), "--ctx", "64")[::2],
                          "is a directory; --text takes a UTF-8 text file")
    binary = tmp_path / "binary.bin"
    binary.write_bytes(bytes(range(256)) * 4)
    assert_one_line_error(*cli("eval", str(contiguous), "--text", str(binary), "--ctx", "64")[::2],
                          "is not UTF-8 text (byte 0x80 at offset 128)")
    from fxllm.evaluation import evaluate

    with pytest.raises(FxllmError, match="--ctx must be an integer of at least 2, got 2.5"):
        evaluate(str(contiguous), binary, ctx=2.5)


def test_eval_text_with_a_byte_order_mark_scores_the_text_without_it(contiguous, text_file, tmp_path):
    """A leading UTF-8 byte-order mark (Windows editors write one) is not part of the text: it was scored as a
    token. Past it, a byte that is not UTF-8 is still named at its offset in the file."""
    marked = tmp_path / "marked.txt"
    marked.write_bytes(b"\xef\xbb\xbf" + text_file.read_bytes())
    runs = [json.loads(cli("eval", str(contiguous), "--text", str(path), "--ctx", "64", "--max-tokens", "40",
                           "--json")[1]) for path in (text_file, marked)]
    assert runs[0]["tokens"] == runs[1]["tokens"] and runs[0]["perplexity"] == runs[1]["perplexity"]
    marked.write_bytes(b"\xef\xbb\xbfab\xff")
    assert_one_line_error(*cli("eval", str(contiguous), "--text", str(marked), "--ctx", "64")[::2],
                          "is not UTF-8 text (byte 0xff at offset 5)")


def test_eval_text_that_is_not_a_regular_file(contiguous):
    """/dev/null exists: it is "not a regular file", not "does not exist" (a FIFO would hang a read)."""
    assert_one_line_error(*cli("eval", str(contiguous), "--text", "/dev/null", "--ctx", "64")[::2],
                          "'/dev/null' is not a regular file; --text takes a UTF-8 text file")


@pytest.mark.parametrize("prompts, message", [
    (["a"], "prompts holds 1 strings for 2 rows of prompt_ids; give one per row"),
    ("ab", "prompts must be a list of strings, one per row of prompt_ids"),
    ([5, 6], "prompts[0] must be a string"),
])
def test_generate_ids_checks_its_prompt_labels(engines, prompts, message):
    """generate_ids' `prompts` labels the rows' results: one string a row (a short list raised IndexError, a string
    was split into one-character labels, ints were taken as labels)."""
    with pytest.raises(InvalidArgumentError, match=re.escape(message)) as caught:
        engines["contiguous"].generate_ids([[1, 2], [3, 4]], max_new_tokens=2, prompts=prompts)
    assert caught.value.param == "prompts"
    labelled = engines["contiguous"].generate_ids([[1, 2], [3, 4]], max_new_tokens=2, prompts=["x", "y"])
    assert [result.prompt for result in labelled] == ["x", "y"]


def test_sampling_params_checks_its_prompt_ids(engines):
    with pytest.raises(InvalidArgumentError, match="prompt_ids") as caught:
        engines["contiguous"].sampling_params("hi")
    assert caught.value.param == "prompt_ids"
    assert engines["contiguous"].sampling_params([1, 2, 3], max_new_tokens=5).max_tokens == 5


# -- the properties -------------------------------------------------------------------------------------------------

ANYTHING = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(), st.text(max_size=4),
                     st.lists(st.integers(-3, 3), max_size=2), st.sampled_from([np.float32(0.5), np.int64(3)]))
VALID = {
    "max_new_tokens": st.one_of(st.integers(1, 5), st.just(np.int64(3))),
    "temperature": st.one_of(st.sampled_from([0, 0.0, 1e-320, 1e-6, 1e-5, 0.7, 5.0, 1e308, np.float32(0.5)]),
                             st.floats(0.0, 3.0)),
    "top_k": st.integers(0, 60),
    "top_p": st.one_of(st.floats(1e-9, 1.0), st.just(1)),
    "seed": st.one_of(st.none(), st.integers(0, 2**64)),
    "stop": st.one_of(st.none(), st.text(max_size=2), st.lists(st.text(max_size=2), max_size=2)),
    "chat": st.booleans(),
}
TEXT_PROMPTS = st.one_of(st.text(min_size=1, max_size=24), st.sampled_from(["Paris is", "def f(x):", " "]))
PROMPT_SHAPES = {"text": TEXT_PROMPTS, "list": st.lists(TEXT_PROMPTS, min_size=1, max_size=3),
                 "odd": st.one_of(st.sampled_from(["a\ud800b", "\udcff", "", []]), ANYTHING)}


@st.composite
def requests(draw) -> tuple[object, dict]:
    """(prompts, keyword arguments): mostly valid, so that both outcomes are well covered; in about one request of
    four one argument is replaced by an arbitrary value of an arbitrary type, and one in five prompts is odd."""
    arguments = draw(st.fixed_dictionaries({}, optional=VALID))
    if draw(st.sampled_from([True, False, False, False])):
        arguments[draw(st.sampled_from(sorted(VALID)))] = draw(ANYTHING)
    prompts = draw(PROMPT_SHAPES[draw(st.sampled_from(["text", "text", "text", "list", "odd"]))])
    return prompts, arguments


def check_result(engine, result, arguments: dict) -> None:
    """A successful generation is a correct one: 1..max_new_tokens ids of the vocabulary, text that is their
    decoding (cut at a stop string), and a first token the requested distribution allows."""
    max_new_tokens = int(arguments.get("max_new_tokens", 64))
    assert 1 <= len(result.token_ids) <= max_new_tokens, result
    assert all(0 <= t < engine.spec.vocab_size for t in result.token_ids)
    assert result.finish_reason in FINISH_REASONS
    assert (len(result.token_ids) == max_new_tokens) >= (result.finish_reason == "length")
    full = engine.tokenizer.decode(result.token_ids, skip_special_tokens=True)
    stops = arguments.get("stop") or []
    stops = [s for s in ([stops] if isinstance(stops, str) else stops) if s]
    if result.finish_reason == "stop":
        assert result.text == full[:min(full.find(s) for s in stops if s in full)]
    else:
        assert result.text == full  # never an empty text the tokens do not decode to
    logits = engine.score(result.prompt_token_ids)[-1:].astype(np.float64)
    params = SamplingParams(arguments.get("temperature", 0.0), arguments.get("top_k", 0), arguments.get("top_p", 1.0))
    probs = probabilities(logits, params)
    assert np.isfinite(probs).all() and math.isclose(probs.sum(), 1.0, rel_tol=1e-9)
    first = result.token_ids[0]
    # Allowed by the distribution, up to a boundary tie: score() and generation run different step shapes, whose
    # logits differ in the last bits.
    assert probs[0, first] > 0 or logits[0, first] >= logits[0][probs[0] > 0].min() - 1e-3


@settings(max_examples=80, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(["contiguous", "paged"]), method=st.sampled_from(["generate", "stream", "ids"]),
       request=requests())
def test_generate_with_arbitrary_arguments(engines, kind, method, request):
    """Python API: any argument values and types give a correct result or a one-line FxllmError — never another
    exception, non-finite probabilities, or an empty output nobody asked for."""
    engine = engines[kind]
    prompts, arguments = request
    try:
        if method == "generate":
            results = engine.generate(prompts, **arguments)
            results = [results] if isinstance(prompts, str) else results
        elif method == "stream":
            text = "".join(engine.stream(prompts, **arguments))
        else:  # token ids: the prompts' encodings where they are text, else whatever was drawn
            texts = [prompts] if isinstance(prompts, str) else prompts
            if isinstance(texts, list) and all(isinstance(p, str) for p in texts):
                prompts = [engine.encode(p) for p in texts]
            arguments.pop("chat", None)
            results = engine.generate_ids(prompts, **arguments)
    except FxllmError as exc:
        assert str(exc) and "\n" not in str(exc), repr(exc)
        event(f"refused: {type(exc).__name__}")
        return
    event(f"generated ({method})")
    if method == "stream":
        params = SamplingParams(arguments.get("temperature", 0.0), seed=arguments.get("seed"))
        if params.greedy or params.seed is not None:  # reproducible: the same text as generate()
            assert text == engine.generate(prompts, **arguments).text
        return
    for result in results:
        check_result(engine, result, arguments)


CLI_WEIRD = st.one_of(st.sampled_from(["0", "-1", "2.5", "nan", "inf", "-inf", "", "abc", "99999999999999999999",
                                       "1_0", " 3", "0x10", "\udcff", "-"]),
                      st.integers(-5, 70).map(str), st.floats().map(str), st.text(max_size=4))
CLI_VALID = [(flag, value) for flag, values in {
    "--max-new-tokens": ["1", "3", "5"], "--temperature": ["0", "0.7", "1e-320", "1e-6", "1.5", "1e308"],
    "--top-k": ["0", "1", "40"], "--top-p": ["0.1", "0.9", "1"], "--seed": ["0", "7", "18446744073709551615"],
    "--stop": ["", " ", "e", "\n"], "--threads": ["1", "2"], "--max-batch": ["1", "8"],
    "--max-tokens-per-step": ["1", "3", "4096"],
    "--kv-blocks": ["128", "512"], "--kv-cache-memory": ["1MB", "64MiB"],  # --kv-blocks: exit 1 on contiguous
}.items() for value in values]


@settings(max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(["contiguous", "paged"]),
       prompt=st.one_of(st.text(max_size=16), st.sampled_from(["Paris is", "\udcff", "-x", ""])),
       options=st.lists(st.sampled_from(CLI_VALID), max_size=4),
       weird=st.lists(st.tuples(st.sampled_from(sorted({flag for flag, _ in CLI_VALID})), CLI_WEIRD), max_size=1),
       switches=st.lists(st.sampled_from(["--chat", "--json"]), unique=True))
def test_cli_generate_with_arbitrary_arguments(contiguous, paged, kind, prompt, options, weird, switches):
    """The CLI in-process with drawn argument strings: exit 0 with correct output, or exit 1 with one line."""
    artifact = contiguous if kind == "contiguous" else paged
    argv = ["generate", str(artifact), "--prompt", prompt, "--max-new-tokens", "4"]
    argv += [part for option in options + weird for part in option] + switches
    code, out, err = cli(*argv)
    event(f"exit {code}")
    if code != 0:
        assert_one_line_error(code, err)
        return
    if "--json" in switches:
        result = json.loads(out)
        assert result["token_ids"] and result["finish_reason"] in FINISH_REASONS
        assert all(0 <= t < 49152 for t in result["token_ids"])
        assert result["text"] == fxllm_tokenizer(artifact).decode(result["token_ids"], skip_special_tokens=True) \
            or result["finish_reason"] == "stop"
    else:
        assert "ms/token]" in err.splitlines()[-1]


def fxllm_tokenizer(artifact: Path):
    if artifact not in _TOKENIZERS:
        _TOKENIZERS[artifact] = fxllm.load(artifact, verify=False).tokenizer  # the runtime's own tokenizer
    return _TOKENIZERS[artifact]


_TOKENIZERS: dict = {}


@pytest.mark.parametrize("argv, code, stderr", [
    ([b"--prompt", b"\xff\xfe"], 1, b"fxllm: error: prompt is not valid Unicode"),
    ([b"--prompt", b"hi", b"--temperature", b"nan"], 1, b"fxllm: error: temperature must be a finite number"),
    ([b"--prompt", b"hi", b"--max-new-tokens", b"2.5"], 1,
     b"fxllm: error: argument --max-new-tokens/--max-tokens: invalid int"),
    ([b"--prompt", b"hi", b"--max-new-tokens", b"3", b"--json"], 0, b""),
])
def test_console_script_exit_status(contiguous, argv, code, stderr):
    """A few real processes: the exit status the shell sees, and stderr as bytes (argv given as raw bytes)."""
    fxllm_bin = str(Path(sys.executable).parent / "fxllm").encode()
    proc = subprocess.run([fxllm_bin, b"generate", str(contiguous).encode(), *argv], capture_output=True, timeout=300)
    assert proc.returncode == code, proc.stderr
    if code:
        assert proc.stderr.count(b"\n") == 1 and proc.stderr.startswith(stderr), proc.stderr
    else:
        assert len(json.loads(proc.stdout)["token_ids"]) == 3


def test_generated_text_on_an_ascii_only_stdout(contiguous, monkeypatch):
    """LANG=C / PYTHONIOENCODING=ascii: characters the stream cannot encode are escaped, never an internal error;
    --json output stays valid JSON."""
    for argv in (["--json"], []):
        raw = io.BytesIO()
        monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(raw, encoding="ascii", errors="strict"))
        code = main(["generate", str(contiguous), "--prompt", "héllo wörld 式", "--max-new-tokens", "6", *argv])
        sys.stdout.flush()
        assert code == 0
        if argv:
            assert json.loads(raw.getvalue().decode("ascii"))["prompt"] == "héllo wörld 式"


def test_error_messages_are_one_line_and_survive_pickling():
    import pickle

    wrapped = FxllmError("cannot load the tokenizer: Couldn't instantiate from one of:\n  (1) a file,\n  (2) a class")
    assert str(wrapped) == "cannot load the tokenizer: Couldn't instantiate from one of: (1) a file, (2) a class"
    from fxllm.errors import InvalidArgumentError

    error = pickle.loads(pickle.dumps(InvalidArgumentError("seed", "seed must be >= 0, got -1")))
    assert error.param == "seed" and str(error) == "seed must be >= 0, got -1"
