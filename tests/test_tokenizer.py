"""The runtime's tokenizer (runtime/tokenizer.py, no transformers) against transformers' AutoTokenizer on the same
directory: token ids, decoding, special tokens and chat templates, for SmolLM2's tokenizer, a tiny artifact's, and
tokenizers of other families built offline (byte-level BPE, SentencePiece-style BPE, WordPiece with a hand-written
config)."""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

import pytest

from fxllm.errors import ArtifactError, GenerationError
from fxllm.runtime.detokenizer import FinalDetokenizer, IncrementalDetokenizer
from fxllm.runtime.tokenizer import load_tokenizer
from tests.tokenizer_families import CONVERSATIONS, build_family, parity_strings

FAMILIES = ["gpt2-bpe", "llama-spm", "wordpiece-raw"]
BYTE_LEVEL = {"smollm2", "tiny-artifact", "gpt2-bpe-source", "gpt2-bpe-artifact"}
STRINGS = parity_strings()


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenizer-families")
    dirs = {}
    for name in FAMILIES:
        dirs[f"{name}-source"], dirs[f"{name}-artifact"] = build_family(name, root)
    return dirs


@pytest.fixture(scope="module", params=["smollm2", "tiny-artifact", *(f"{n}-{kind}" for n in FAMILIES
                                                                       for kind in ("source", "artifact"))])
def pair(request, tokenizer_dir, make_tiny_artifact, family_dirs):
    """(name, the runtime's tokenizer, transformers' tokenizer) for one directory."""
    from transformers import AutoTokenizer

    name = request.param
    directory = {"smollm2": tokenizer_dir, "tiny-artifact": make_tiny_artifact("llama") / "tokenizer",
                 **family_dirs}[name]
    return name, load_tokenizer(directory), AutoTokenizer.from_pretrained(directory)


def test_token_ids_match_transformers(pair):
    name, ours, reference = pair
    assert len(STRINGS) >= 300
    mismatches = [(text, special) for text in STRINGS for special in (True, False)
                  if ours.encode(text, add_special_tokens=special)
                  != reference.encode(text, add_special_tokens=special)]
    assert not mismatches, f"{name}: {len(mismatches)} mismatches, first {mismatches[:3]}"


def test_decoding_matches_transformers_and_round_trips(pair):
    name, ours, reference = pair
    round_trips = 0
    for text in STRINGS:
        ids = reference.encode(text)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip), \
                (name, text, skip)
        plain = ours.encode(text, add_special_tokens=False)
        round_trips += ours.decode(plain, skip_special_tokens=False) == text
    if name in BYTE_LEVEL:  # byte-level BPE is lossless
        assert round_trips == len(STRINGS)
    else:  # normalizers (lowercasing, '▁' handling) lose some text; transformers loses exactly the same
        assert round_trips == sum(reference.decode(reference.encode(t, add_special_tokens=False)) == t
                                  for t in STRINGS)


def test_incremental_detokenizer_is_the_whole_decode_at_every_token(pair):
    """Fed one token at a time, the streaming detokenizer's text equals a decode of every token so far at every
    token that completes a character (and after finish()), for every parity string (special tokens, byte-level
    characters split over tokens, '▁' and '##' pieces, cleaned-up spaces) and for random id sequences mixing in
    special tokens (invalid bytes among byte-fallback tokens, which the decoder resolves over their whole run);
    what it streams adds up to that text."""
    import random

    name, ours, _ = pair
    rng = random.Random(0)
    specials = sorted({i for i in (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) if i is not None})
    texts = [ours.encode(text) for text in STRINGS]
    texts.append(specials * 4 + ours.encode(" after several special tokens", add_special_tokens=False))
    drawn = [[rng.choice(specials) if specials and rng.random() < 0.15 else rng.randrange(ours.vocab_size)
              for _ in range(rng.randrange(1, 60))] for _ in range(60)]
    for ids in texts + drawn:
        detokenizer, streamed = IncrementalDetokenizer(ours), ""
        for count, token in enumerate(ids, 1):
            streamed += detokenizer.add(token)
            whole = ours.decode(ids[:count])
            if whole.endswith("\ufffd"):  # an open character: the detokenizer's text ends in one too
                assert detokenizer.text.endswith("\ufffd"), (name, ids[:count])
            else:
                assert detokenizer.text == whole, (name, ids[:count])
        streamed += detokenizer.finish()
        assert streamed == detokenizer.text == ours.decode(ids), (name, ids)
        final = FinalDetokenizer(ours)  # a final-only request's: nothing until finish(), then the same text
        assert [final.add(token) for token in ids] == [""] * len(ids) and final.text == ""
        assert final.finish() == streamed == final.text and final.finish() == "", (name, ids)


def test_a_stop_string_matches_only_characters_already_decoded(pair):
    """A character split over tokens decodes as U+FFFD until its last byte arrives: a stop string holding U+FFFD
    matches a real one only, never that placeholder (it ended a generation of emoji after one token with no text),
    in the streamed text and at finish()."""
    name, ours, _ = pair
    split = 0  # texts whose decode passed through an open character
    for text in ("Three: \U0001f389\U0001f389\U0001f389 done", "a \u6c49\u5b57 b \u00e9", "x \ufffd y \U0001f389"):
        ids = ours.encode(text, add_special_tokens=False)
        whole = ours.decode(ids)
        split += any(ours.decode(ids[:count]).endswith("\ufffd") for count in range(1, len(ids)))
        for stop in (["\ufffd"], ["\U0001f389\ufffd"], ["\u6c49\ufffd", "\ufffd"]):
            detokenizer = IncrementalDetokenizer(ours, stop)
            streamed = "".join(detokenizer.add(token) for token in ids if not detokenizer.stopped)
            streamed += detokenizer.finish()
            cut = min((whole.find(s) for s in stop if s in whole), default=len(whole))
            assert streamed == detokenizer.text == whole[:cut], (name, text, stop)
            assert detokenizer.stopped == (cut < len(whole)), (name, text, stop)
    if name in BYTE_LEVEL:
        assert split, name
    # a character the vocabulary spells in bytes (byte fallback: <0xE2><0x9C><0x93>; Llama 2 spells "\n" so) ends
    # the generation at the token that completes it, not at the next one, which closes the byte run
    ids = ours.encode("one \u2713 two three", add_special_tokens=False)
    whole = ours.decode(ids)
    if "\u2713" in whole:
        detokenizer = IncrementalDetokenizer(ours, ["\u2713"])
        used = next(count for count, token in enumerate(ids, 1) if detokenizer.add(token) is not None
                    and detokenizer.stopped)
        assert detokenizer.text == whole[:whole.index("\u2713")], name
        assert "\u2713" not in ours.decode(ids[:used - 1]) and "\u2713" in ours.decode(ids[:used]), name


def test_stop_strings_wait_for_min_tokens_and_may_stay_in_the_text(tokenizer_dir):
    """As vLLM v1: no stop string ends the text before min_tokens tokens (a match must end past their text), and
    include_stop keeps the stop string; streamed deltas add up to the text either way."""
    tokenizer = load_tokenizer(tokenizer_dir)
    text = "the cat sat on the mat, the dog sat on the log, then all sat down"
    ids = tokenizer.encode(text, add_special_tokens=False)
    whole = tokenizer.decode(ids)
    for min_tokens in range(len(ids)):
        floor = len(tokenizer.decode(ids[:min_tokens]))
        at = whole.find("sat", max(0, floor - len("sat") + 1))
        for include in (False, True):
            detokenizer, streamed = IncrementalDetokenizer(tokenizer, ["sat"], include_stop=include,
                                                           min_tokens=min_tokens), ""
            for token in ids:
                streamed += detokenizer.add(token)
                if detokenizer.stopped:
                    break
            streamed += detokenizer.finish()
            expected = whole if at == -1 else whole[:at + len("sat") * include]
            assert detokenizer.text == streamed == expected, (min_tokens, include)


def test_a_long_generation_detokenizes_in_windows(tokenizer_dir):
    """A token's text comes from decoding a few tokens, not the whole text: the decoder sees at most 2 x
    WINDOW_TOKENS + 1 ids a call however long the text grows (each decode of all ids made a generation
    quadratic)."""
    from fxllm.runtime.detokenizer import WINDOW_TOKENS

    tokenizer = load_tokenizer(tokenizer_dir)
    ids = tokenizer.encode(" ".join(STRINGS), add_special_tokens=False)
    assert len(ids) > 2000
    lengths = []  # ids in each decode call
    decode = tokenizer.decode

    def counting_decode(chunk, **options):
        lengths.append(len(chunk))
        return decode(chunk, **options)

    tokenizer.decode = counting_decode
    detokenizer = IncrementalDetokenizer(tokenizer)
    for token in ids:
        detokenizer.add(token)
    assert detokenizer.text == decode(ids)
    assert max(lengths[2 * WINDOW_TOKENS:]) <= 2 * WINDOW_TOKENS + 1, max(lengths)


def test_special_tokens_and_vocabulary_match_transformers(pair):
    name, ours, reference = pair
    for attribute in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        assert getattr(ours, attribute) == getattr(reference, attribute), (name, attribute)
    assert ours.vocab_size == len(reference)
    assert ours.special_tokens == reference.special_tokens_map
    sample = sorted({*range(0, ours.vocab_size, 97), *range(ours.vocab_size - 12, ours.vocab_size + 3)})
    assert [ours.id_to_token(i) for i in sample] == [reference.convert_ids_to_tokens(i) for i in sample]
    assert ours.decode([ours.vocab_size + 5]) == ""  # out of vocabulary: nothing, as transformers


def test_token_bytes_rebuild_the_text(pair):
    name, ours, _ = pair
    if name not in BYTE_LEVEL and not name.startswith("llama-spm"):
        pytest.skip("token_bytes is exact for byte-level, byte-fallback and '▁' vocabularies only")
    texts = [t for t in STRINGS if t and not t[0].isspace() and not any(s in t for s in ("<s>", "</s>", "<unk>", "<|"))]
    assert len(texts) > 100
    for text in texts:
        joined = b"".join(ours.token_bytes(i) for i in ours.encode(text, add_special_tokens=False))
        # the SentencePiece-style vocabulary writes the space it prepends to the text ('▁' first)
        assert joined == (text if name in BYTE_LEVEL else " " + text).encode("utf-8"), (name, text)


def test_chat_templates_match_transformers(pair):
    """Every conversation, with and without the generation prompt: the same text and ids, or both refuse it."""
    name, ours, reference = pair
    assert (ours.chat_template is None) == (reference.chat_template is None)
    if ours.chat_template is None:
        with pytest.raises(GenerationError, match="has no chat template"):
            ours.apply_chat_template(CONVERSATIONS[0])
        return
    rendered = refused = 0
    for conversation in CONVERSATIONS:
        for generation_prompt in (True, False):
            try:
                expected = reference.apply_chat_template(conversation, add_generation_prompt=generation_prompt,
                                                         tokenize=False)
            except Exception as exc:  # the template refuses it (e.g. roles must alternate): so must ours
                with pytest.raises(GenerationError, match="refused the conversation") as caught:
                    ours.apply_chat_template(conversation, add_generation_prompt=generation_prompt)
                assert str(exc) in str(caught.value) and "\n" not in str(caught.value)
                refused += 1
                continue
            text = ours.apply_chat_template(conversation, add_generation_prompt=generation_prompt)
            assert text == expected, (name, conversation, generation_prompt)
            ids = reference.apply_chat_template(conversation, add_generation_prompt=generation_prompt)["input_ids"]
            assert ours.encode(text, add_special_tokens=False) == ids
            rendered += 1
    assert rendered >= 5 * 2 or (name.startswith("llama-spm") and rendered >= 4 and refused), (rendered, refused)


def test_named_templates_and_tools(family_dirs):
    from transformers import AutoTokenizer

    for directory in (family_dirs["wordpiece-raw-source"], family_dirs["wordpiece-raw-artifact"]):
        ours, reference = load_tokenizer(directory), AutoTokenizer.from_pretrained(directory)
        assert isinstance(ours.chat_template, dict) and set(ours.chat_template) == {"default", "tool_use"}
        tools = [{"type": "function", "function": {"name": "f", "description": "<é> & \"x\""}}]
        for kwargs in ({"tools": tools}, {"chat_template": "tool_use"}, {}):
            assert ours.apply_chat_template(CONVERSATIONS[2], **kwargs) == reference.apply_chat_template(
                CONVERSATIONS[2], add_generation_prompt=True, tokenize=False, **kwargs)
    rich = load_tokenizer(family_dirs["gpt2-bpe-artifact"])
    assert "<tools>[{\"type\": \"function\"" in rich.apply_chat_template(CONVERSATIONS[1], tools=tools)


@pytest.mark.parametrize("template, message", [
    ("{{ raise_exception('no system messages here') }}", "refused the conversation: no system messages here"),
    ("{{ messages.__class__.__mro__ }}", "failed: access to attribute '__class__' .* is unsafe"),  # the sandbox
    ("{% set ns = namespace() %}{% set ns._x = 1 %}", "failed: .*cannot set the attribute '_x'"),
    ("{{ messages[5]['content'].upper() }}", "the chat template failed"),
    ("{% for m in messages %}", "does not parse"),
    ("{{ 'a' * 300000000 }}", "builds a value of 300000000 items"),  # 300 MB at once
    ("{{ [1] * 100000 * 1000 }}", "builds a value of 100000000 items"),
    ("{{ 10 ** 100000000 }}", "raises 10 to the power 100000000"),
])
def test_template_failures_are_one_line_generation_errors(tokenizer_dir, template, message):
    ours = load_tokenizer(tokenizer_dir)
    with pytest.raises(GenerationError, match=message) as caught:
        ours.apply_chat_template(CONVERSATIONS[0], chat_template=template)
    assert "\n" not in str(caught.value)


_DAG = "{% set ns = namespace(a=[1]) %}{% for i in range(60) %}{% set ns.a = [ns.a, ns.a] %}{% endfor %}"  # 2**60 ones


@pytest.mark.parametrize("template, what", [
    ("{{ 'x'.center(20000000) }}", "center()"),
    ("{{ 'x'.center(10000000000) }}", "center()"),  # 10 GB in one C call
    ("{{ 'x'.ljust(20000000) }}", "ljust()"),
    ("{{ 'x'.rjust(20000000, '-') }}", "rjust()"),
    ("{{ 'x'.zfill(20000000) }}", "zfill()"),
    ("{{ ('\t' * 1000).expandtabs(100000) }}", "expandtabs()"),
    ("{{ ('x' * 10000).replace('x', 'x' * 10000) }}", "replace()"),
    ("{{ ('x' * 10000).encode().center(20000000) }}", "center()"),
    ("{{ (1).to_bytes(10000000000, 'big') }}", "to_bytes()"),
    ("{{ '%20000000d' % 1 }}", "'%'"),
    ("{{ '%*d' % (20000000, 1) }}", "'%'"),
    ("{{ '%.20000000f' % 1.0 }}", "'%'"),
    ("{{ '%(a)s%(a)s' % {'a': 'x' * 9000000} }}", "'%'"),
    ("{{ '{:>20000000}'.format(1) }}", "format()"),
    ("{{ '{:{}}'.format(1, 20000000) }}", "format()"),
    ("{{ '{0}{0}'.format('x' * 9000000) }}", "format()"),
    ("{{ '{a}{a}'.format_map({'a': 'x' * 9000000}) }}", "format()"),
    ("{{ ''.join(['x' * 9000000] * 2) }}", "join()"),
    ("{% set a = 'x' * 9000000 %}{{ a ~ a }}", "'~'"),
    ("{{ 'x'|center(20000000) }}", "'center'"),
    ("{{ 'x'|indent(20000000, true) }}", "'indent'"),
    ("{{ ('x\n' * 1000)|indent('y' * 100000) }}", "'indent'"),
    ("{{ range(100000)|join('x' * 1000) }}", "'join'"),
    ("{{ ('x' * 100)|replace('x', 'y' * 1000000) }}", "'replace'"),
    ("{{ '%20000000d'|format(1) }}", "'format'"),
    ("{{ ('<' * 9000000)|e }}", "'e'"),
    ("{{ ['x' * 9000000, 'y' * 9000000]|sum(start='') }}", "'sum'"),
    ("{{ [1]|batch(100000000, 0)|list }}", "'batch'"),
    ("{{ lipsum(1, min=100000000, max=100000001) }}", "'lipsum'"),
    ("{{ ['x' * 16000000] * 1000 }}", "'{{ }}'"),  # 16 GB of text from a list of 1000 items
    ("{{ (['x' * 16000000] * 1000)|string }}", "'string'"),
    ("{{ (['x' * 16000000] * 1000)|tojson }}", "'tojson'"),
    ("{{ (['x' * 16000000] * 1000)|pprint }}", "'pprint'"),
    ("{{ '%s' % (['x' * 16000000] * 1000,) }}", "'%'"),
    (_DAG + "{{ ns.a }}", "'{{ }}'"),
    (_DAG + "{{ ns.a|tojson }}", "'tojson'"),
    (_DAG + "{{ ns.a ~ '' }}", "'~'"),
    ("{% for i in range(1000) %}{{ 'x' * 10000000 }}{% endfor %}", "its output"),
    ("{% set s %}{% for i in range(1000) %}{{ 'x' * 10000000 }}{% endfor %}{% endset %}", "its output"),
])
def test_a_template_cannot_build_a_value_past_the_size_budget(tokenizer_dir, template, what):
    """Whatever builds the value (an operator, a method, a filter, printing a container, the output itself), it is
    refused before it is built: in one line, and at once (one C call building gigabytes cannot be interrupted)."""
    ours = load_tokenizer(tokenizer_dir)
    start = time.monotonic()
    refusal = rf"builds a value of \d+ items with {re.escape(what)} \(at most 16777216\)"
    with pytest.raises(GenerationError, match=refusal) as caught:
        ours.apply_chat_template(CONVERSATIONS[0], chat_template=template)
    assert time.monotonic() - start < 2
    assert "\n" not in str(caught.value)


def test_values_within_the_size_budget_still_render(tokenizer_dir):
    """The bounds refuse only what is past the budget: the same operations on sizes that fit render as before."""
    ours = load_tokenizer(tokenizer_dir)
    rendered = ours.apply_chat_template(CONVERSATIONS[0], chat_template=(
        "{% set a = 'x' * 8000000 %}{{ (a ~ a)|length }} {{ 'x'.center(16000000)|length }} "
        "{{ (('%' ~ 16000000 ~ 'd') % 1)|length }} {{ [a, a]|join|length }} {{ {'k': [1, 'é\n']}|tojson(indent=1) }}"))
    assert rendered == '16000000 16000000 16000000 16000000 {\n "k": [\n  1,\n  "é\\n"\n ]\n}'


def test_a_template_that_runs_too_long_is_stopped(tokenizer_dir, monkeypatch):
    """Nested loops of the sandbox's largest range run 10^10 times: stopped at the render's time budget."""
    from fxllm.runtime import chat_template

    monkeypatch.setattr(chat_template, "RENDER_SECONDS", 0.5)
    ours = load_tokenizer(tokenizer_dir)
    start = time.monotonic()
    with pytest.raises(GenerationError, match="ran longer than 0.5 s"):
        ours.apply_chat_template(CONVERSATIONS[0], chat_template="{% for i in range(100000) %}{% for j in "
                                                                 "range(100000) %}{% endfor %}{% endfor %}")
    assert time.monotonic() - start < 5
    assert ours.apply_chat_template(CONVERSATIONS[0])  # the next render is unaffected


def test_template_variables_may_have_any_name_but_the_renderers_own(tokenizer_dir):
    """Extra keyword arguments are template variables, whatever their name: `template`, `seconds` and `self` once
    collided with parameters of the functions they pass through (a TypeError); the variables the renderer sets
    itself are refused in one line."""
    ours = load_tokenizer(tokenizer_dir)
    shown = ours.apply_chat_template(CONVERSATIONS[0], chat_template="{{ template }}|{{ seconds }}", template="t",
                                     seconds=3, self="s", special_tokens=1, variables=2)  # (Jinja's `self` wins)
    assert shown == "t|3"
    with pytest.raises(GenerationError, match="cannot be called messages: the renderer sets it"):
        ours.apply_chat_template(CONVERSATIONS[0], messages=1)
    with pytest.raises(GenerationError, match="documents must be a list of JSON objects"):
        ours.apply_chat_template(CONVERSATIONS[0], documents=1)  # was a TypeError: 'int' object is not iterable


def test_bad_conversations_are_refused(tokenizer_dir):
    ours = load_tokenizer(tokenizer_dir)
    for messages in ([], "hello", ["hello"]):
        with pytest.raises(GenerationError):
            ours.apply_chat_template(messages)
    with pytest.raises(GenerationError, match="tools must be a list of JSON objects"):
        ours.apply_chat_template(CONVERSATIONS[0], tools=[print])
    with pytest.raises(GenerationError, match="can only tokenize text"):
        ours.encode(None)
    # a value with no JSON form once rendered as "<bytes>" / "<PosixPath>": text the caller never wrote
    for content, hint in ((b"hello", "bytes value.*decode bytes to text first"), (Path("notes.txt"), "Path value")):
        with pytest.raises(GenerationError, match=hint):
            ours.apply_chat_template([{"role": "user", "content": content}])
    with pytest.raises(GenerationError, match="set value"):
        ours.apply_chat_template(CONVERSATIONS[0], date_string={"today"})
    # nested past Python's recursion limit's reach: a RecursionError escaped (a 500 over HTTP) at 500 levels
    deep = 1
    for _ in range(600):
        deep = [deep]
    for messages, variables in (([{"role": "assistant", "content": "a", "tool_calls": [{"x": deep}]}], {}),
                                (CONVERSATIONS[0], {"options": {"x": deep}})):
        with pytest.raises(GenerationError, match=r"^a chat message or template variable nests lists or objects "
                                                  r"more than 100 levels deep$"):
            ours.apply_chat_template(messages, **variables)
    nested = 1
    for _ in range(90):
        nested = {"a": nested}  # a deep but sane value still renders
    assert ours.apply_chat_template(CONVERSATIONS[0], chat_template="{{ x.a.a.a }}", x=nested) == "{'a': " * 87 + \
        "1" + "}" * 87


def test_bad_tokenizer_files_are_artifact_errors(tokenizer_dir, tmp_path):
    copy = tmp_path / "tokenizer"
    shutil.copytree(tokenizer_dir, copy)
    (copy / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ArtifactError, match="tokenizer_config.json is corrupt"):
        load_tokenizer(copy)
    (copy / "tokenizer_config.json").write_text(json.dumps({"bos_token": {"lstrip": True}}))
    with pytest.raises(ArtifactError, match="has no text"):
        load_tokenizer(copy)
    (copy / "tokenizer_config.json").write_text("{}")
    (copy / "tokenizer.json").write_text('{"model": 1}')
    with pytest.raises(ArtifactError, match="cannot read .*tokenizer.json"):
        load_tokenizer(copy)
    (copy / "tokenizer.json").unlink()
    with pytest.raises(ArtifactError, match="has no tokenizer.json"):
        load_tokenizer(copy)


@pytest.mark.parametrize("key, value, message", [
    ("additional_special_tokens", 1, "additional_special_tokens must be a list of tokens or an object"),
    ("extra_special_tokens", True, "extra_special_tokens must be a list of tokens or an object"),
    ("extra_special_tokens", {"image_token": 5}, "neither its text nor a token object"),
    ("added_tokens_decoder", {"5": 5}, "neither its text nor a token object"),
    ("chat_template", [{"name": "default"}], "chat_template must be a template or a list of"),
    ("chat_template", [5], "chat_template must be a template or a list of"),
])
def test_tokenizer_config_entries_of_the_wrong_type_are_artifact_errors(tokenizer_dir, tmp_path, key, value, message):
    """An edited tokenizer_config.json was a TypeError or KeyError while loading (`fxllm generate` exited 2, an
    internal error); it is a one-line ArtifactError naming the file."""
    copy = tmp_path / "tokenizer"
    shutil.copytree(tokenizer_dir, copy)
    config = json.loads((copy / "tokenizer_config.json").read_text())
    (copy / "tokenizer_config.json").write_text(json.dumps({**config, key: value}))
    (copy / "chat_template.jinja").unlink(missing_ok=True)  # the file would take priority over the config's entry
    with pytest.raises(ArtifactError, match=message):
        load_tokenizer(copy)


def test_engine_encode_matches_the_transformers_path(make_tiny_artifact):
    """What Engine.encode did with transformers (AutoTokenizer, apply_chat_template(tokenize=True)) it still does."""
    from transformers import AutoTokenizer

    import fxllm

    artifact = make_tiny_artifact("llama")
    engine, reference = fxllm.load(artifact), AutoTokenizer.from_pretrained(artifact / "tokenizer")
    for prompt in STRINGS[:60]:
        if prompt:
            assert engine.encode(prompt) == reference(prompt)["input_ids"]
        chat = reference.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        assert engine.encode(prompt, chat=True) == chat["input_ids"]
