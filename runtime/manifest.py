"""Reading an artifact's manifest.json: schema validation, path confinement, and file checksums.

Nothing in a manifest is trusted: every field is type- and range-checked, every path it names must stay inside the
artifact directory (relative, no `..`, no symlink resolving outside: runtime/artifact_files.py), and the graph
signature must be a complete calling convention consistent with the model spec. Any violation is an ArtifactError
naming the field.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Union, get_args, get_origin, get_type_hints

from fxllm.errors import ArtifactError
from fxllm.runtime.artifact_files import check_tokenizer_dir, check_weights_listed, confine, verify_files
from fxllm.runtime.contract import (ARTIFACT_KIND, FLOAT_DTYPES, FORMAT_VERSION, MANIFEST_FILE, MAX_SPEC_K, TARGETS,
                                    ModelIO, ModelSpec, TensorSig)

DRAFT_MODES = ("model", "self-int4", "self-layers", "ngram")
# The oldest artifact format this fxllm reads (versions up to FORMAT_VERSION): the first; no fxllm wrote a lower one.
OLDEST_FORMAT_VERSION = 1
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class SpeculativePlan:
    mode: str  # one of DRAFT_MODES
    k: int  # draft tokens per step, 1..MAX_SPEC_K
    draft: Path | None  # the draft artifact's directory (modes with a model), inside this artifact


@dataclass(frozen=True)
class UnrolledDraftFile:  # a draft artifact's k-step graph (contract.py UnrolledDraftIO) beside its one-step model
    model_file: Path
    k: int


@dataclass(frozen=True)
class Manifest:
    """A validated manifest. `data` is the JSON document itself (what `write_manifest` wrote)."""

    directory: Path
    data: dict[str, Any]
    spec: ModelSpec
    io: ModelIO
    facts: frozenset[str]
    target: str
    model_file: Path
    tokenizer_dir: Path
    speculative: SpeculativePlan | None
    int8_activations: bool  # the runtime's recommended default for quantized matmuls
    unrolled_draft: UnrolledDraftFile | None = None  # draft artifacts compiled for a speculative k

    @property
    def files(self) -> dict[str, dict[str, Any]]:
        return self.data["files"]


class _NonFinite(ValueError):
    pass


def _finite(text: str) -> float:
    """A JSON number as a float; one beyond float's range (1e999) is refused, as JSON has no infinity: Python's json
    reads it as inf, and `fxllm inspect --json` wrote it back as `Infinity`, which is not JSON."""
    value = float(text)
    if not math.isfinite(value):
        raise _NonFinite(f"the number {text[:40]} is beyond a float's range")
    return value


def _not_json(name: str):
    """NaN, Infinity, -Infinity: Python's json reads them, JSON has none."""
    raise _NonFinite(f"{name} is not a JSON number")


def load_manifest(directory: str | os.PathLike, verify: bool = True) -> Manifest:
    """Read and validate DIRECTORY/manifest.json; with `verify`, also checksum every file it lists."""
    if not str(directory).strip():  # Path("") is the working directory, which may well be an artifact
        raise ArtifactError("the artifact path is empty")
    directory = Path(directory)
    path = directory / MANIFEST_FILE
    try:  # a name too long, a directory without search permission: OSError from the stat itself
        exists, is_dir, has_manifest = directory.exists(), directory.is_dir(), path.is_file()
    except OSError as exc:
        raise ArtifactError(f"cannot read artifact '{directory}': {exc.strerror or exc}") from None
    if not exists:
        raise ArtifactError(f"artifact '{directory}' does not exist")
    if not is_dir:
        raise ArtifactError(f"artifact '{directory}' is a file, not an artifact directory")
    if not has_manifest:
        raise ArtifactError(f"'{directory}' is not an fxllm artifact (no {MANIFEST_FILE}); compile one with "
                            "`fxllm compile`")
    try:
        data = json.loads(path.read_bytes().decode("utf-8"), parse_float=_finite, parse_constant=_not_json)
    except UnicodeDecodeError as exc:
        raise ArtifactError(f"{path} is corrupt: not UTF-8 ({exc.reason} at byte {exc.start})") from exc
    except (json.JSONDecodeError, RecursionError) as exc:
        raise ArtifactError(f"{path} is corrupt: {exc}") from exc
    except _NonFinite as exc:
        raise ArtifactError(f"{path} is corrupt: {exc}") from None
    except OSError as exc:
        raise ArtifactError(f"cannot read {path}: {exc.strerror}") from exc
    manifest = parse_manifest(data, directory)
    check_tokenizer_dir(manifest)
    check_weights_listed(manifest)
    if verify:
        verify_files(manifest)
    return manifest


def parse_manifest(data: Any, directory: Path) -> Manifest:
    """Validate a manifest document against the schema; ArtifactError names the first bad field. Its format_version
    must be one this fxllm reads: OLDEST_FORMAT_VERSION to FORMAT_VERSION."""
    version = data.get("format_version") if isinstance(data, dict) else None
    if not _is_int(version):
        raise ArtifactError(f"{directory / MANIFEST_FILE} has no format_version; it was not written by fxllm")
    if version > FORMAT_VERSION:
        raise ArtifactError(f"artifact format version {version} is newer than this fxllm supports ({FORMAT_VERSION}); "
                            f"upgrade fxllm (it was written by fxllm {data.get('fxllm_version', '?')})")
    if version < OLDEST_FORMAT_VERSION:
        raise ArtifactError(f"{directory / MANIFEST_FILE}: artifact format version {version} is older than this fxllm "
                            f"reads ({OLDEST_FORMAT_VERSION} to {FORMAT_VERSION}); recompile the artifact (its "
                            f"manifest names fxllm {data.get('fxllm_version', '?')})")
    fields_ = _Fields(data, directory)
    if "kind" in data and data["kind"] != ARTIFACT_KIND:
        fields_.fail("kind", f"must be '{ARTIFACT_KIND}'")
    fields_.typed("fxllm_version", str)
    target = fields_.choice("target", TARGETS)
    files = fields_.typed("files", dict)
    for name, entry in files.items():
        confine(directory, name, "files")
        if not (isinstance(entry, dict) and isinstance(entry.get("sha256"), str) and _SHA256.match(entry["sha256"])
                and _is_int(entry.get("bytes")) and entry["bytes"] >= 0):
            fields_.fail(f"files['{name}']", "must be {\"sha256\": 64 hex digits, \"bytes\": size}")
    model_file = fields_.path("model_file", must_be_listed=True)
    tokenizer_dir = fields_.path("tokenizer_dir")
    spec = _spec(fields_.typed("spec", dict), fields_)
    io = _io(fields_.typed("io", dict), spec, fields_)
    facts = fields_.typed("facts", list)
    if not all(isinstance(fact, str) for fact in facts):
        fields_.fail("facts", "must be a list of strings")
    if "kv-cache" not in facts:
        raise ArtifactError(f"artifact '{directory}' was compiled without the kv-cache pass; recompile it")
    if ("paged" in facts) != io.paged:
        fields_.fail("facts", f"says {'' if 'paged' in facts else 'not '}paged, but the I/O is a {io.cache} cache")
    _passes(fields_.typed("passes", list), fields_)
    _records(data, fields_)
    _tensorrt(data.get("tensorrt"), fields_)
    runtime = fields_.typed("runtime", dict, default={})
    int8 = runtime.get("int8_activations", False)
    if not isinstance(int8, bool):
        fields_.fail("runtime.int8_activations", "must be true or false")
    return Manifest(directory, data, spec, io, frozenset(facts), target, model_file, tokenizer_dir,
                    _speculative(data.get("speculative"), fields_), int8,
                    _unrolled_draft(data.get("unrolled_draft"), io, fields_))


class _Fields:
    """Typed access to a manifest's fields, failing with the field's name."""

    def __init__(self, data: dict[str, Any], directory: Path):
        self.data, self.directory = data, directory

    def fail(self, field: str, problem: str):
        raise ArtifactError(f"{self.directory / MANIFEST_FILE}: field '{field}' {problem}; recompile the artifact")

    def typed(self, key: str, kind: type, default: Any = None) -> Any:
        if key not in self.data:
            if default is not None:
                return default
            raise ArtifactError(f"{self.directory / MANIFEST_FILE} is incomplete (missing {key}); recompile the "
                                "artifact")
        value = self.data[key]
        if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
            self.fail(key, f"must be a JSON {_json_name(kind)}, not {type(value).__name__}")
        return value

    def choice(self, key: str, choices: tuple[str, ...]) -> str:
        value = self.typed(key, str)
        if value not in choices:
            self.fail(key, f"must be one of {', '.join(choices)}, not '{value}'")
        return value

    def path(self, key: str, must_be_listed: bool = False) -> Path:
        relative = self.typed(key, str)
        resolved = confine(self.directory, relative, key)
        if must_be_listed and relative not in self.data["files"]:
            raise ArtifactError(f"{self.directory / MANIFEST_FILE} does not checksum {relative}; recompile the "
                                "artifact")
        return resolved


def _spec(data: dict[str, Any], fields_: _Fields) -> ModelSpec:
    hints = get_type_hints(ModelSpec)
    known = {f.name for f in fields(ModelSpec)}
    unknown = sorted(set(data) - known)
    if unknown:
        fields_.fail(f"spec.{unknown[0]}", "is not a model-spec field")
    for name in known & set(data):
        if not _matches(data[name], hints[name]):
            hint = hints[name].__name__ if isinstance(hints[name], type) else str(hints[name]).replace("typing.", "")
            fields_.fail(f"spec.{name}", f"has the wrong type ({type(data[name]).__name__}, expected {hint})")
    try:
        spec = ModelSpec.from_dict(data)
    except TypeError as exc:  # a required field is missing
        fields_.fail("spec", f"is incomplete ({exc})")
    for name in ("num_layers", "num_heads", "num_kv_heads", "head_dim", "hidden_size", "vocab_size", "max_positions"):
        if getattr(spec, name) < 1:
            fields_.fail(f"spec.{name}", "must be >= 1")
    if spec.num_heads % spec.num_kv_heads:
        fields_.fail("spec.num_kv_heads", f"({spec.num_kv_heads}) must divide num_heads ({spec.num_heads})")
    if spec.sliding_windows and (len(spec.sliding_windows) != spec.num_layers or min(spec.sliding_windows) < 0):
        fields_.fail("spec.sliding_windows", f"must give a window >= 0 for each of the {spec.num_layers} layers")
    if spec.dtype not in FLOAT_DTYPES:
        fields_.fail("spec.dtype", f"must be one of {', '.join(FLOAT_DTYPES)}")
    if spec.kv_cache_dtype not in ("", "int8"):
        fields_.fail("spec.kv_cache_dtype", "must be \"\" (the model's dtype) or int8")
    for token in (*spec.eos_token_ids, spec.bos_token_id, spec.pad_token_id):
        if token is not None and not 0 <= token < spec.vocab_size:
            fields_.fail("spec", f"names token id {token}, outside the vocabulary of {spec.vocab_size}")
    return spec


def _io(data: dict[str, Any], spec: ModelSpec, fields_: _Fields) -> ModelIO:
    signatures = {}
    for side in ("inputs", "outputs"):
        items = data.get(side)
        if not isinstance(items, list) or not items:
            fields_.fail(f"io.{side}", "must be a non-empty list of tensor signatures")
        for item in items:
            if not (isinstance(item, dict) and set(item) == {"name", "dims", "dtype"} and isinstance(item["name"], str)
                    and isinstance(item["dtype"], str) and isinstance(item["dims"], list)
                    and all(isinstance(d, str) and d or _is_int(d) and d >= 0 for d in item["dims"])):
                fields_.fail(f"io.{side}", f"holds {str(item)[:80]}, not a {{name, dims, dtype}} tensor signature")
        signatures[side] = [TensorSig.from_dict(item) for item in items]
    try:
        io = ModelIO.from_signature(signatures["inputs"], signatures["outputs"])
    except ValueError as exc:
        fields_.fail("io", str(exc))
    if io.num_layers != spec.num_layers:
        fields_.fail("io", f"has KV caches for {io.num_layers} layers, the spec {spec.num_layers}")
    heads, head_dim = io.kv_heads_and_dim
    if (heads, head_dim) != (spec.num_kv_heads, spec.head_dim):
        fields_.fail("io", f"caches {heads} KV heads of {head_dim}, the spec {spec.num_kv_heads} of {spec.head_dim}")
    if io.outputs[0].dims[-1] != spec.vocab_size:
        fields_.fail("io", f"gives {io.outputs[0].dims[-1]} logits per token, the spec's vocabulary is {spec.vocab_size}")
    quantized = "int8" in io.cache_dtypes
    if (quantized and len(io.cache_dtypes) > 1) or quantized != (spec.kv_cache_dtype == "int8"):
        fields_.fail("io", f"int8 caches in some layers or against spec.kv_cache_dtype "
                           f"{spec.kv_cache_dtype or 'unset'}: every cache tensor is int8 exactly when it is int8")
    if quantized and not io.shared_buffer:
        fields_.fail("io", "holds int8 caches outside a shared-buffer contiguous cache (only GroupQueryAttention's "
                           "quantized cache takes them)")
    return io


DRIFT_FIELDS = ("max_abs_logit", "mean_kl", "greedy_agreement")  # what the compiler records of each pass's drift


def _passes(records: list[Any], fields_: _Fields) -> None:
    for record in records:
        if not (isinstance(record, dict) and isinstance(record.get("name"), str)
                and isinstance(record.get("options"), dict) and _is_number(record.get("seconds"))
                and _is_drift(record.get("drift"))):
            fields_.fail("passes", f"holds {str(record)[:80]}, not a pass record")


def _is_drift(value: Any) -> bool:
    """A drift record as the compiler writes it: every DRIFT_FIELDS key, every value a number."""
    return (isinstance(value, dict) and all(key in value for key in DRIFT_FIELDS)
            and all(_is_number(v) for v in value.values()))


def _records(data: dict[str, Any], fields_: _Fields) -> None:
    """The compile's records that only `fxllm inspect` reads, each optional: `source` {"name": str, ...},
    `compile_seconds` {phase: seconds} and `lowering` (its `kv_cache`: dtype, calibration, drift). Checked like
    every field, so that inspecting an edited manifest is an ArtifactError, not a crash while it is printed."""
    source = data.get("source")
    if "source" in data and not (isinstance(source, dict) and isinstance(source.get("name"), str)):
        fields_.fail("source", "must be {\"name\": the model compiled, ...}")
    seconds = data.get("compile_seconds")
    if "compile_seconds" in data and not (isinstance(seconds, dict) and all(_is_number(v) for v in seconds.values())):
        fields_.fail("compile_seconds", "must map each compile phase to its seconds")
    lowering = data.get("lowering")
    if "lowering" in data and not isinstance(lowering, dict):
        fields_.fail("lowering", "must be the lowering's record, an object")
    kv_cache = (lowering or {}).get("kv_cache")
    if kv_cache is not None and not (
            isinstance(kv_cache, dict) and all(isinstance(kv_cache.get(k), str) for k in ("dtype", "calibration"))
            and _is_drift(kv_cache.get("drift"))):
        fields_.fail("lowering.kv_cache", "must record the KV cache's dtype, calibration and drift")


def _tensorrt(data: Any, fields_: _Fields) -> None:
    """The engine.plan record `fxllm build-engine` adds; absent until an engine is built."""
    if data is None:
        return
    if not (isinstance(data, dict) and all(isinstance(data.get(k), str) for k in ("version", "compute_capability"))
            and isinstance(data.get("profile"), dict)):
        fields_.fail("tensorrt", "must record version, compute_capability, plan_file and profile")
    if data.get("plan_file") not in fields_.data["files"]:
        fields_.fail("tensorrt.plan_file", "must name a file the manifest checksums")
    confine(fields_.directory, data["plan_file"], "tensorrt.plan_file")


def _speculative(data: Any, fields_: _Fields) -> SpeculativePlan | None:
    if data is None:
        return None
    if not isinstance(data, dict) or data.get("mode") not in DRAFT_MODES:
        fields_.fail("speculative.mode", f"must be one of {', '.join(DRAFT_MODES)}")
    k = data.get("k")
    if not _is_int(k) or not 1 <= k <= MAX_SPEC_K:
        fields_.fail("speculative.k", f"must be an integer from 1 to {MAX_SPEC_K}")
    draft = data.get("draft")
    if (draft is None) != (data["mode"] == "ngram"):
        fields_.fail("speculative.draft", f"must {'not ' if data['mode'] == 'ngram' else ''}name a draft directory "
                                          f"in mode {data['mode']}")
    path = confine(fields_.directory, draft, "speculative.draft") if draft is not None else None
    if path is not None and path == fields_.directory.resolve():  # the draft would load itself, without end
        fields_.fail("speculative.draft", "must name a subdirectory holding the draft artifact, not the artifact "
                                          "itself")
    return SpeculativePlan(data["mode"], k, path)


def _unrolled_draft(data: Any, io: ModelIO, fields_: _Fields) -> UnrolledDraftFile | None:
    if data is None:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("model_file"), str) or io.paged:
        fields_.fail("unrolled_draft", "must be {\"model_file\": a file, \"k\": draft tokens per call} of a "
                                       "contiguous-cache artifact")
    if data["model_file"] not in fields_.data["files"]:
        fields_.fail("unrolled_draft.model_file", "must name a file the manifest checksums")
    if not _is_int(data.get("k")) or not 1 <= data["k"] <= MAX_SPEC_K:
        fields_.fail("unrolled_draft.k", f"must be an integer from 1 to {MAX_SPEC_K}")
    return UnrolledDraftFile(confine(fields_.directory, data["model_file"], "unrolled_draft.model_file"), data["k"])


def _matches(value: Any, hint: Any) -> bool:
    """Whether a JSON value fits a ModelSpec annotation (int, str, bool, float, X | None, list[X], dict[str, X])."""
    origin = get_origin(hint)
    if origin is Union or type(hint).__name__ == "UnionType":
        return any(_matches(value, arm) for arm in get_args(hint))
    if hint is type(None):
        return value is None
    if hint is Any:
        return True
    if origin is list:
        return isinstance(value, list) and all(_matches(v, get_args(hint)[0]) for v in value)
    if origin is dict:
        key, item = get_args(hint)
        return isinstance(value, dict) and all(_matches(k, key) and _matches(v, item) for k, v in value.items())
    if hint is int:
        return _is_int(value)
    if hint is float:
        return _is_number(value)
    return isinstance(value, hint) and not (isinstance(value, bool) and hint is not bool)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


def _json_name(kind: type) -> str:
    return {dict: "object", list: "array", str: "string", int: "integer", bool: "boolean"}.get(kind, kind.__name__)
