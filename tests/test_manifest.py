"""Loading never trusts the manifest: schema-checked fields, paths confined to the artifact, and a model file that
must match the manifest's signature and the spec it was compiled for (issue #16, items 3 and 5)."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import fxllm
import fxllm.compiler
import fxllm.passes
import fxllm.runtime
from fxllm.errors import ArtifactError
from fxllm.runtime import huge_pages
from fxllm.runtime.artifact import write_manifest
from fxllm.runtime.contract import MANIFEST_FILE, ModelIO, TensorSig, parse_cache_name
from fxllm.runtime.inspect import describe_artifact
from tests.conftest import PROMPTS


def _edit(artifact: Path, change) -> None:
    path = artifact / MANIFEST_FILE
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))


def _set_field(artifact: Path, path: tuple, value) -> None:
    """The manifest's field at `path` (keys and indices) set to `value`."""
    def change(manifest):
        target = manifest
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    _edit(artifact, change)


@pytest.fixture
def artifact(make_tiny_artifact, tmp_path) -> Path:
    target = tmp_path / "artifact"
    shutil.copytree(make_tiny_artifact("llama"), target)
    return target


@pytest.fixture
def outside(tmp_path) -> Path:
    """A second, valid-looking model and tokenizer next to the artifact, which loading must never touch."""
    other = tmp_path / "other"
    other.mkdir()
    (other / "model.onnx").write_bytes(b"not the artifact's model")
    return other


@pytest.mark.parametrize("field, value", [
    ("model_file", "../other/model.onnx"),
    ("model_file", "__ABSOLUTE__/model.onnx"),
    ("tokenizer_dir", "__ABSOLUTE__"),
    ("tokenizer_dir", "tokenizer/../../other"),
])
def test_paths_outside_the_artifact_are_refused(artifact, outside, field, value):
    value = value.replace("__ABSOLUTE__", str(outside))
    _edit(artifact, lambda m: m.update({field: value}))
    for action in (fxllm.load, describe_artifact):
        with pytest.raises(ArtifactError, match=f"manifest field '{field}' names .*outside the artifact directory"):
            action(artifact)


@pytest.mark.parametrize("draft", [".", "./", "self"])
def test_a_draft_that_is_the_artifact_itself_is_refused(artifact, draft):
    """A draft naming the artifact (directly, or through a symlink to it) would load itself without end."""
    (artifact / "self").symlink_to(artifact.resolve(), target_is_directory=True)
    _edit(artifact, lambda m: m.update({"speculative": {"mode": "model", "k": 4, "draft": draft}}))
    with pytest.raises(ArtifactError, match="field 'speculative.draft' must name a subdirectory"):
        fxllm.load(artifact, verify=False)


@pytest.mark.parametrize("where", ["additional_chat_templates/x.jinja", "other"])
def test_a_fifo_in_the_tokenizer_directory_is_refused(artifact, where):
    """Reading a FIFO blocks until someone writes to it: loading would hang (the chat templates are read by glob)."""
    fifo = artifact / "tokenizer" / where
    fifo.parent.mkdir(exist_ok=True)
    os.mkfifo(fifo)
    for verify in (True, False):
        with pytest.raises(ArtifactError, match="is not a regular file"):
            fxllm.load(artifact, verify=verify)


def test_symlinks_resolving_outside_are_refused(artifact, outside):
    shutil.rmtree(artifact / "tokenizer")
    (artifact / "tokenizer").symlink_to(outside, target_is_directory=True)
    with pytest.raises(ArtifactError, match="names 'tokenizer.*', which resolves outside the artifact directory"):
        fxllm.load(artifact)


def test_files_added_to_the_tokenizer_directory_are_refused(artifact, outside):
    (artifact / "tokenizer" / "special_tokens_map.json").symlink_to(outside / "model.onnx")
    with pytest.raises(ArtifactError, match="'tokenizer/special_tokens_map.json' .* is not part of the artifact"):
        fxllm.load(artifact)


@pytest.mark.parametrize("path, value, message", [
    (("spec", "num_kv_heads"), "2", r"'spec.num_kv_heads' has the wrong type \(str, expected int\)"),
    (("spec",), None, "'spec' must be a JSON object, not NoneType"),
    (("io",), "x", "'io' must be a JSON object, not str"),
    (("io", "inputs"), [{"name": "input_ids"}], "'io.inputs' holds .* not a {name, dims, dtype} tensor signature"),
    (("spec", "num_layers"), 0, "'spec.num_layers' must be >= 1"),
    (("spec", "num_layers"), 3, "'io' has KV caches for 2 layers, the spec 3"),
    (("spec", "eos_token_ids"), [10**9], "names token id 1000000000, outside the vocabulary"),
    (("spec", "vocab_size"), True, r"'spec.vocab_size' has the wrong type \(bool"),
    (("files",), [], "'files' must be a JSON object, not list"),
    (("target",), "gpu", "'target' must be one of ort, tensorrt"),
    (("speculative",), {"mode": "ngram", "k": 99, "draft": None}, "'speculative.k' must be an integer from 1 to 16"),
    (("speculative",), {"mode": "model", "k": 2, "draft": "/"}, "'speculative.draft' names '/', outside"),
    (("unrolled_draft",), {"model_file": "model.onnx", "k": 0}, "'unrolled_draft.k' must be an integer from 1"),
    (("unrolled_draft",), {"model_file": "other.onnx", "k": 2}, "'unrolled_draft.model_file' must name a file the"),
    (("unrolled_draft",), ["model.onnx"], "'unrolled_draft' must be {\"model_file\""),
    (("facts",), ["captured"], "compiled without the kv-cache pass"),
    (("kind",), "photo-album", "'kind' must be 'fxllm-artifact'"),
])
def test_wrong_fields_are_artifact_errors(artifact, path, value, message):
    _set_field(artifact, path, value)
    with pytest.raises(ArtifactError, match=message):
        fxllm.load(artifact, verify=False)


@pytest.mark.parametrize("version", [0, -1])
def test_a_format_version_older_than_any_this_fxllm_reads_is_refused(artifact, version):
    """Versions below the first were accepted and the manifest read as if it were the current format."""
    _set_field(artifact, ("format_version",), version)
    with pytest.raises(ArtifactError, match=rf"manifest\.json: artifact format version {version} is older than this "
                                            r"fxllm reads \(1 to \d+\); recompile the artifact"):
        fxllm.load(artifact, verify=False)


@pytest.mark.parametrize("path, value, message", [
    (("source",), None, "'source' must be {\"name\""),
    (("source",), {}, "'source' must be {\"name\""),
    (("compile_seconds",), {"load": None}, "'compile_seconds' must map each compile phase"),
    (("compile_seconds",), ["load"], "'compile_seconds' must map each compile phase"),
    (("passes", 0, "drift"), {}, "'passes' holds .* not a pass record"),
    (("lowering",), "x", "'lowering' must be the lowering's record"),
    (("lowering",), 12, "'lowering' must be the lowering's record"),
    (("lowering", "kv_cache"), "x", "'lowering.kv_cache' must record the KV cache's dtype, calibration and drift"),
    (("lowering", "kv_cache"), {"dtype": "int8"}, "'lowering.kv_cache' must record"),
])
def test_inspect_of_edited_compile_records_is_an_artifact_error(artifact, path, value, message):
    """The records only `fxllm inspect` prints are checked like every field: an edited one crashed the printing
    (TypeError, KeyError: `fxllm inspect` exited 2, an internal error)."""
    _set_field(artifact, path, value)
    with pytest.raises(ArtifactError, match=message):
        describe_artifact(artifact)


@pytest.mark.parametrize("number", ["Infinity", "-Infinity", "NaN", "1e999"])
def test_a_number_json_cannot_hold_is_refused(artifact, number):
    """Python's json reads NaN, Infinity and 1e999 (as inf); JSON has none of them: `fxllm inspect --json` printed
    a hand-edited compile time back as `Infinity`, which JSON parsers refuse. Refused on reading, in one line."""
    path = artifact / MANIFEST_FILE
    manifest = json.loads(path.read_text())
    manifest["compile_seconds"]["load"] = 123456.125  # a value no other field holds
    path.write_text(json.dumps(manifest).replace("123456.125", number))
    for read in (describe_artifact, lambda a: fxllm.load(a, verify=False)):
        with pytest.raises(ArtifactError, match=r"manifest\.json is corrupt: .*(not a JSON number|beyond a float)"):
            read(artifact)


def test_inspect_without_compile_records(artifact):
    """Both records are optional: an artifact without them is described, its source as not recorded."""
    _edit(artifact, lambda m: [m.pop("source"), m.pop("compile_seconds")])
    assert "model        (not recorded): LlamaForCausalLM" in describe_artifact(artifact)["text"]


def test_spec_edited_after_compilation_is_refused(artifact):
    """A context limit raised in the manifest would let a 256-position model run past what it was built for."""
    _edit(artifact, lambda m: m["spec"].update(max_positions=1_000_000))
    with pytest.raises(ArtifactError, match="model spec or signature was changed after compilation"):
        fxllm.load(artifact)


def test_inspect_refuses_a_spec_edited_after_compilation(artifact):
    """`fxllm inspect` showed an edited manifest's context and KV dtype and exited 0 where a load refused the same
    artifact: it reads the model file's recorded digest (without loading a weight) and refuses alike."""
    assert "contract" not in describe_artifact(artifact)["text"]
    _edit(artifact, lambda m: m["spec"].update(max_positions=4, dtype="float16"))
    with pytest.raises(ArtifactError, match="model spec or signature was changed after compilation"):
        describe_artifact(artifact)


def test_model_file_that_differs_from_the_manifest_fails_at_load(artifact, make_tiny_model, tmp_path):
    """The paged artifact's model in a contiguous artifact's directory: refused at load, not at the first step."""
    paged = tmp_path / "paged"
    fxllm.compile(make_tiny_model("llama"), paged, passes="cleanup,gqa,kv-cache,paged:block_size=4")
    shutil.copy(paged / "model.onnx", artifact / "model.onnx")
    shutil.copy(paged / "model.onnx.data", artifact / "model.onnx.data")
    manifest = json.loads((artifact / MANIFEST_FILE).read_text())
    manifest.pop("files")
    write_manifest(artifact, {k: v for k, v in manifest.items() if k != "format_version"})  # fresh checksums
    with pytest.raises(ArtifactError, match="'model.onnx' does not match the manifest: the model's inputs differ"):
        fxllm.load(artifact)


def test_model_io_roles():
    sigs = [TensorSig("input_ids", ("batch", "tokens"), "int64"), TensorSig("position_ids", ("batch", "tokens"), "int64"),
            TensorSig("block_tables", ("batch", "table"), "int64"), TensorSig("context_lens", ("batch",), "int64"),
            TensorSig("key_cache_0", ("blocks", 8, 2, 16), "float32"),
            TensorSig("value_cache_0", ("blocks", 8, 2, 16), "float32")]
    outs = [TensorSig("logits", ("batch", "tokens", 10), "float32"),
            TensorSig("new_key_0", ("batch", 2, "tokens", 16), "float32"),
            TensorSig("new_value_0", ("batch", 2, "tokens", 16), "float32")]
    io = ModelIO.from_signature(sigs, outs)
    assert (io.cache, io.num_layers, io.block_size, io.selects_logits) == ("paged", 1, 8, False)
    assert io.cache_outputs("value") == ["new_value_0"]
    assert parse_cache_name("past_key_12").layer == 12 and parse_cache_name("past_key_012") is None
    with pytest.raises(ValueError, match="missing value_cache_0"):
        ModelIO.from_signature(sigs[:-1], outs)


def test_a_signature_wrong_in_every_layer_is_one_readable_line():
    """A model whose 120 cache tensors all have a dtype the runtime cannot feed: one problem naming a few of them
    and how many more (the message used to list all 120, ~10 KB in one line)."""
    layers = 30
    caches = [TensorSig(f"past_{kind}_{i}", ("batch", 3, "capacity", 64), "int32")
              for i in range(layers) for kind in ("key", "value")]
    sigs = [TensorSig("input_ids", ("batch", "tokens"), "int64"),
            TensorSig("position_ids", ("batch", "tokens"), "int64"),
            TensorSig("attention_mask", ("batch", "total"), "int64"), *caches]
    outs = [TensorSig("logits", ("batch", "tokens", 10), "float32"),
            *[TensorSig(f"present_{kind}_{i}", ("batch", 3, "capacity", 64), "int32")
              for i in range(layers) for kind in ("key", "value")]]
    with pytest.raises(ValueError) as raised:
        ModelIO.from_signature(sigs, outs)
    message = str(raised.value)
    assert "'past_key_0', 'past_value_0', 'past_key_1', 'past_value_1' and 116 more of dtype int32 (expected float32" \
        in message
    assert len(message) < 300 and "\n" not in message
    floats = [TensorSig(s.name, s.dims, "float32" if s.name.startswith("past_") else s.dtype) for s in sigs]
    with pytest.raises(ValueError, match=r"missing present_key_0, present_key_1, present_key_10, present_key_11 and 56 "
                                         r"more$"):
        ModelIO.from_signature(floats, outs[:1])


# ---- property test: arbitrary manifest mutations ---------------------------------------------------------------

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**63) | st.floats(allow_nan=True, allow_infinity=True)
    | st.sampled_from(["", "..", "../x", "/etc/passwd", "tokenizer", "model.onnx", "model.onnx.data", "ngram",
                       "float32", "int64", "paged", "kv-cache", "C:\\x", "a\0b", "tokenizer/../..", "."])
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)


BENIGN_FIELDS = {"passes", "compile_seconds", "source", "speculative", "runtime", "kind", "target", "fxllm_version",
                 "facts"}


PLAUSIBLE_EDITS = [  # edits of a kind a user might make, none of which may change what the artifact generates
    lambda m: m.pop("kind", None),
    lambda m: m.update(compile_seconds={"load": 1.5}),
    lambda m: m.update(passes=[]),
    lambda m: m.update(target="tensorrt"),
    lambda m: m.update(runtime={"int8_activations": True}),
    lambda m: m.update(speculative={"mode": "ngram", "k": 3, "draft": None}),
    lambda m: m.update(facts=[*m.get("facts", []), "something-new"]) if isinstance(m.get("facts"), list) else None,
    lambda m: m.update(source={"name": "renamed"}),
]


def _paths(value, prefix=()):
    """Every (key path) inside a JSON document."""
    yield prefix
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _paths(item, (*prefix, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _paths(item, (*prefix, index))


def _apply(manifest, path, action, value):
    if not path:
        return value if action == "set" else manifest
    target = manifest
    for key in path[:-1]:
        target = target[key]
    if action == "delete":
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return manifest


@pytest.fixture(scope="module")
def original(make_tiny_artifact):
    directory = make_tiny_artifact("llama")
    engine = fxllm.load(directory)
    return directory, json.loads((directory / MANIFEST_FILE).read_text()), engine.generate(
        PROMPTS[0], max_new_tokens=4).token_ids


@settings(max_examples=int(os.environ.get("FXLLM_FUZZ_EXAMPLES", 40)), deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_mutated_manifests_load_correctly_or_fail_cleanly(original, tmp_path_factory, data):
    directory, manifest, expected = original
    copy = tmp_path_factory.mktemp("mutated") / "artifact"
    shutil.copytree(directory, copy)
    mutated = json.loads(json.dumps(manifest))
    # Half the examples only touch fields the runtime does not depend on, so loads that must succeed get tested too.
    benign = data.draw(st.booleans(), label="benign fields only")
    for _ in range(data.draw(st.integers(0 if benign else 1, 2), label="mutations")):
        paths = list(_paths(mutated)) if isinstance(mutated, (dict, list)) else [()]
        if benign:
            paths = [p for p in paths if p and p[0] in BENIGN_FIELDS] or paths
        path = data.draw(st.sampled_from(paths), label="path")
        action = data.draw(st.sampled_from(["set", "delete"]) if path else st.just("set"), label="action")
        mutated = _apply(mutated, path, action, data.draw(JSON_VALUES, label="value"))
    if benign:
        for edit in data.draw(st.lists(st.sampled_from(PLAUSIBLE_EDITS), max_size=3), label="plausible edits"):
            edit(mutated) if isinstance(mutated, dict) else None
    changes = ["none"] if benign else ["none", "remove", "add", "symlink-out"]
    file_change = data.draw(st.sampled_from(changes), label="files")
    if file_change == "remove":
        victim = data.draw(st.sampled_from(sorted(manifest["files"])), label="removed")
        (copy / victim).unlink()
    elif file_change == "add":
        (copy / "tokenizer" / "added_tokens.json").write_text('{"hello": 5}')
    elif file_change == "symlink-out":
        (copy / "tokenizer" / "vocab.json").symlink_to(Path(sys.executable).resolve())
    (copy / MANIFEST_FILE).write_text(json.dumps(mutated))

    code = [Path(module.__file__).resolve().parent for module in (fxllm, fxllm.runtime, fxllm.compiler, fxllm.passes)]
    # the process's own memory map and the kernel's THP mode: read for huge pages (runtime/huge_pages.py); the
    # memory available (and the cgroup's limit): read for the KV budget's default (available_memory)
    memory = [Path("/proc", str(os.getpid())), Path(huge_pages.THP_MODE).parent, Path("/proc/meminfo"),
              Path("/sys/fs/cgroup")]
    allowed = [copy.resolve(), Path(sys.prefix).resolve(), Path(sys.base_prefix).resolve(), *code, *memory]
    outside: list[str] = []

    def audit(event, args):
        if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
            opened = Path(os.fsdecode(args[0])).resolve()
            if not any(opened == root or root in opened.parents for root in allowed):
                outside.append(str(opened))

    _AUDIT.append(audit)
    try:
        engine = fxllm.load(copy)
    except ArtifactError as exc:
        assert "\n" not in str(exc)
        engine = None
    finally:
        _AUDIT.remove(audit)
    assert not outside, f"loading opened files outside the artifact: {outside}"
    if engine is not None:
        assert engine.generate(PROMPTS[0], max_new_tokens=4).token_ids == expected
    event("loaded" if engine is not None else "refused")


_AUDIT: list = []  # audit hooks cannot be removed: one permanent hook dispatches to the test's current one
sys.addaudithook(lambda event, args: [hook(event, args) for hook in list(_AUDIT)])
