"""What a model source declares, checked before its weights load: its architecture and capabilities, the sizes and
numbers of its config.json or GGUF header, the GGUF file's tensor layout and tokenizer fields. Each refusal is a
one-line ModelSourceError naming the file and field; transformers reads all of these unchecked."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fxllm.compiler.gguf_cache import gguf_reader, sharing_gguf_readers
from fxllm.compiler.model_features import check_capabilities
from fxllm.errors import ModelSourceError
from fxllm.runtime.checks import short

if TYPE_CHECKING:
    from fxllm.compiler.sources import ModelSource

# The longest context fxllm compiles. Released models stop near 10M tokens (Llama 4 Scout: 10,485,760); a header
# stating more is corrupt or hand-edited, and compiling it would size the RoPE tables (2 x context rows) and the
# KV-cache planning for it: a 1e9-token context asked ONNX Runtime for 32 GB at lowering.
MAX_CONTEXT = 2**24
# config.json fields that size the model: each, where given, must be a positive integer (0 divides by zero in
# transformers, a negative vocabulary fails in torch, neither with a message naming the field).
SIZE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "max_position_embeddings", "n_positions", "n_embd", "n_layer",
               "n_head")
CONTEXT_FIELDS = ("max_position_embeddings", "n_positions")
# The special-token ids transformers looks up in a GGUF's token list (an id past its end: a bare IndexError).
GGUF_SPECIAL_TOKEN_IDS = ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                          "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id")
# The GGUF header keys (after '{architecture}.') that size the model, as SIZE_FIELDS do in config.json: transformers
# copies them into the config unchecked (a negative context compiled, 0 layers or heads failed far from the cause).
# The per-layer ones may be arrays (one value per block, e.g. OpenELM's).
GGUF_SIZE_KEYS = ("context_length", "block_count", "embedding_length", "vocab_size", "rope.dimension_count",
                  "attention.key_length", "attention.value_length")
GGUF_PER_LAYER_SIZE_KEYS = ("feed_forward_length", "attention.head_count", "attention.head_count_kv")
# The GGUF header keys (after '{architecture}.') holding a real number transformers reads unchecked (as rope_theta,
# rms_norm_eps / layer_norm_eps), what each must be, and its range test (on a finite value): a NaN or infinite one
# compiled, and the non-finite logits it caused were blamed on the weights. An epsilon of 0 is valid.
GGUF_NUMBER_KEYS: dict[str, tuple[str, Callable[[float], bool]]] = {
    "rope.freq_base": ("a positive finite number", lambda value: value > 0),
    "attention.layer_norm_rms_epsilon": ("a finite number >= 0", lambda value: value >= 0),
    "attention.layer_norm_epsilon": ("a finite number >= 0", lambda value: value >= 0),
}
# No GGUF tensor type stores a weight in less than one bit (IQ1_S: 1.56): a header whose sizes ask for more weights
# than 8 per byte of the file is corrupt, and building it would allocate them (a vocab_size of 1e9: 256 GB asked).
GGUF_MAX_WEIGHTS_PER_BYTE = 8
# A Hugging Face checkpoint stores a weight in half a byte or more (int4 packed by GPTQ/AWQ, bitsandbytes' 4-bit);
# with the same 4x margin, a config.json whose sizes ask for more than 8 weights per byte of the weight files does
# not describe them, and transformers would build (and randomly initialize) the model it describes before saying
# its weights are missing: 20,000 layers of a 1.3 MB checkpoint took 41 s and 4.2 GB to refuse, 10**6 layers 155 s.
HF_MAX_WEIGHTS_PER_BYTE = 8
HF_WEIGHT_FILES = ("*.safetensors", "*.bin")



def gguf_path(source: ModelSource) -> Path:
    """The source's .gguf file."""
    return source.directory / source.gguf_file


def gguf_header(source: ModelSource):
    """The GGUFReader of the source's file (shared within sharing_gguf_readers), or a ModelSourceError."""
    try:
        return gguf_reader(gguf_path(source))
    except Exception as exc:  # corrupt or truncated file
        raise ModelSourceError(f"cannot read GGUF file '{gguf_path(source)}': {exc}{_past_end_hint(exc)}") from exc


def _past_end_hint(exc: Exception) -> str:
    """What gguf-py's numpy errors mean: it slices the mapping without bounds checks, so a file cut short, or a
    count, length or offset past its end, surfaces as an empty or short slice that numpy then refuses."""
    message = str(exc)
    if isinstance(exc, IndexError) and "out of bounds" in message or \
            isinstance(exc, ValueError) and ("reshape" in message or "dtype" in message):
        return " (the file is truncated, or a count, length or offset in its header runs past its end)"
    return ""


def _gguf_value(reader, key: str) -> Any:
    """A scalar or string metadata value of a GGUF header (the first item of an array); None when absent."""
    from gguf import GGUFValueType

    field = reader.fields.get(key)
    if field is None or not field.data:
        return None
    part = field.parts[field.data[0]]
    if field.types[-1] == GGUFValueType.STRING:
        return bytes(part).decode("utf-8", "replace")
    return part.tolist()[0]


def _gguf_type_name(field) -> str:
    """A GGUF field's value type as its header states it (STRING, UINT32, ARRAY/STRING, ...)."""
    return "/".join(kind.name for kind in field.types)


def gguf_architecture(source: ModelSource) -> str:
    """The `general.architecture` a GGUF file declares (llama, qwen3moe, gemma2, ...)."""
    from gguf import GGUFValueType

    reader = gguf_header(source)
    try:
        field = reader.fields["general.architecture"]
        if field.types != [GGUFValueType.STRING]:  # the bytes of a number decode too (an int: '\x01\x00\x00\x00')
            raise TypeError(f"it is {_gguf_type_name(field)}")
        return bytes(field.parts[field.data[0]]).decode()
    except Exception as exc:  # a header without it, or not a string
        raise ModelSourceError(f"cannot read GGUF file '{gguf_path(source)}': no general.architecture string "
                               f"({type(exc).__name__}: {exc})") from exc


def read_config(source: ModelSource) -> dict[str, Any]:
    """config.json of a Hugging Face directory as a JSON object, or a ModelSourceError naming the file."""
    return read_json_object(source.directory / "config.json", "a JSON object of config fields")


def read_json_object(path: Path, what: str = "a JSON object") -> dict[str, Any]:
    """The JSON object in `path`, or a ModelSourceError naming the file (unreadable, not JSON, not `what`)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelSourceError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelSourceError(f"{path} is not {what} (it holds a {type(data).__name__})")
    return data


def source_architecture(source: ModelSource) -> str:
    """What a source declares, read without loading weights: config.json's first architecture (a transformers
    class name), or for a GGUF file its `general.architecture` as 'gguf:NAME'."""
    if source.gguf_file:
        return f"gguf:{gguf_architecture(source)}"
    config = read_config(source)
    architectures = config.get("architectures")
    if architectures is not None and not (isinstance(architectures, list)
                                          and all(isinstance(name, str) for name in architectures)):
        raise ModelSourceError(f"{source.directory / 'config.json'}: 'architectures' must be a list of class names "
                               f"such as [\"LlamaForCausalLM\"], got {short(architectures)}")
    return (architectures or [f"model_type:{config.get('model_type', '?')}"])[0]


def declared_vocab_size(source: ModelSource) -> int | None:
    """How many token ids a source's model scores, as its header says without loading weights: config.json's
    vocab_size (or its text_config's), a GGUF's `<arch>.vocab_size` or its token list's length; None where not
    stated. The loaded model's lm_head stays the last word."""
    if source.gguf_file:
        reader = gguf_header(source)
        size = _gguf_value(reader, f"{gguf_architecture(source)}.vocab_size")
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        size = size if size is not None else len(tokens.data) if tokens is not None and tokens.data else None
    else:
        config = read_config(source)
        text_config = config.get("text_config")
        size = config.get("vocab_size", text_config.get("vocab_size") if isinstance(text_config, dict) else None)
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None


def check_context(length: int, where: str) -> None:
    """Refuse a context length past MAX_CONTEXT; `where` names the file and field that state it."""
    if length > MAX_CONTEXT:
        raise ModelSourceError(f"{where} states a context of {length:,} tokens; fxllm compiles at most {MAX_CONTEXT:,} "
                               "(2^24, above any released model's), so the value is likely corrupt")


# config.json's real numbers transformers reads unchecked, what each must be and its test (on a finite number), as
# GGUF_NUMBER_KEYS for a GGUF header: a negative rope_theta compiled and its non-finite logits were blamed on the
# weights. Looked for in the config, its text_config and their rope_parameters / rope_scaling.
CONFIG_NUMBER_FIELDS: dict[str, tuple[str, Callable[[float], bool]]] = {
    "rope_theta": ("a positive finite number", lambda value: value > 0),
    "rms_norm_eps": ("a finite number >= 0", lambda value: value >= 0),
    "layer_norm_eps": ("a finite number >= 0", lambda value: value >= 0),
    "layer_norm_epsilon": ("a finite number >= 0", lambda value: value >= 0),
}


def _check_config_numbers(config: dict[str, Any], path: Path) -> None:
    """Every CONFIG_NUMBER_FIELDS value present a number that passes its test."""
    sections = [config, config.get("text_config")]
    sections += [section.get(key) for section in list(sections) if isinstance(section, dict)
                 for key in ("rope_parameters", "rope_scaling")]
    for section in sections:
        if not isinstance(section, dict):
            continue
        for field, (what, test) in CONFIG_NUMBER_FIELDS.items():
            value = section.get(field)
            if value is None:
                continue
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not (number and math.isfinite(value) and test(value)):
                raise ModelSourceError(f"{path}: {field} must be {what}, got {short(value)}")


def _check_config_sizes(config: dict[str, Any], path: Path) -> None:
    """Every SIZE_FIELDS value of config.json (and of its text_config) a positive integer, the context bounded."""
    for section in (config, config.get("text_config")):
        if not isinstance(section, dict):
            continue
        for field in SIZE_FIELDS:
            value = section.get(field)
            if isinstance(value, (list, tuple)):  # per-layer sizes (e.g. OpenELM's): transformers checks those
                continue
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ModelSourceError(f"{path}: {field} must be a positive integer, got {short(value)}")
        for field in CONTEXT_FIELDS:
            if section.get(field) is not None:
                check_context(section[field], f"{path} ({field})")


def check_config_weight_count(config: dict[str, Any], directory: Path) -> None:
    """Refuse a config.json (sizes already checked positive) that describes more weights than the directory's weight
    files can hold: at least the embedding (vocab_size x hidden) and, per layer, one hidden x hidden matrix and one
    hidden x intermediate one. Sizes it cannot read (per-layer lists, other names) or no weight files: no check."""
    section = config.get("text_config") if isinstance(config.get("text_config"), dict) else config

    def size(*names: str) -> int | None:
        value = next((section[name] for name in names if section.get(name) is not None), None)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    hidden, layers, vocab = size("hidden_size", "n_embd", "d_model"), size("num_hidden_layers", "n_layer"), \
        size("vocab_size")
    if hidden is None or layers is None or vocab is None:
        return
    weights = (vocab + layers * (hidden + (size("intermediate_size", "n_inner", "ffn_dim") or 0))) * hidden
    files = {entry for pattern in HF_WEIGHT_FILES for entry in directory.glob(pattern) if entry.is_file()}
    file_bytes = sum(entry.stat().st_size for entry in files)
    if file_bytes and weights > HF_MAX_WEIGHTS_PER_BYTE * file_bytes:
        raise ModelSourceError(f"{directory / 'config.json'}: its sizes describe at least {weights:,} weights, more "
                               f"than the {file_bytes:,} bytes of its weight files can hold (no checkpoint format "
                               "stores a weight in under half a byte); config.json does not match the weights")


def _check_gguf_context(source: ModelSource, architecture: str) -> None:
    key = f"{architecture}.context_length"
    length = _gguf_value(gguf_header(source), key)
    if isinstance(length, int):
        check_context(length, f"'{gguf_path(source)}' ({key})")


def _gguf_integers(field) -> list[int] | None:
    """The values of an integer scalar or integer-array GGUF field; None when it holds anything else."""
    from gguf import GGUFValueType

    kind = field.types[-1]
    if kind in (GGUFValueType.STRING, GGUFValueType.ARRAY, GGUFValueType.BOOL, GGUFValueType.FLOAT32,
                GGUFValueType.FLOAT64):
        return None
    return [int(field.parts[index][0]) for index in field.data]


def _check_gguf_sizes(source: ModelSource, architecture: str) -> None:
    """Every GGUF_SIZE_KEYS value present is one positive integer, every GGUF_PER_LAYER_SIZE_KEYS value one or an
    array of sizes (>= 0, not all 0): the header's sizes as _check_config_sizes checks config.json's; then the
    weight count they imply (_check_gguf_weight_count)."""
    reader = gguf_header(source)
    for name in GGUF_SIZE_KEYS + GGUF_PER_LAYER_SIZE_KEYS:
        field = reader.fields.get(f"{architecture}.{name}")
        if field is None:
            continue
        values, is_array = _gguf_integers(field), len(field.types) > 1
        per_layer = name in GGUF_PER_LAYER_SIZE_KEYS
        # per layer, 0 is legitimate: a hybrid model's recurrent layers have no KV heads (refused later by feature)
        if values is None or not values or max(values) < 1 or min(values) < (0 if is_array else 1) or \
                (is_array and not per_layer):
            what = "a positive integer or an array of sizes" if per_layer else "a positive integer"
            raise ModelSourceError(f"'{gguf_path(source)}': {architecture}.{name} must be {what}, got "
                                   f"{short(_gguf_value(reader, f'{architecture}.{name}'))} ({_gguf_type_name(field)})")
    _check_gguf_weight_count(source, architecture)


def _gguf_number(field) -> int | float | None:
    """The value of an integer or float scalar GGUF field; None when it holds anything else (a string, a bool, an
    array)."""
    from gguf import GGUFValueType

    if len(field.types) != 1 or field.types[0] in (GGUFValueType.STRING, GGUFValueType.BOOL) or not field.data:
        return None
    return field.parts[field.data[0]].tolist()[0]


def _check_gguf_numbers(source: ModelSource, architecture: str) -> None:
    """Every GGUF_NUMBER_KEYS value present is one finite number in its range."""
    reader = gguf_header(source)
    for name, (what, in_range) in GGUF_NUMBER_KEYS.items():
        key = f"{architecture}.{name}"
        field = reader.fields.get(key)
        if field is None:
            continue
        value = _gguf_number(field)
        if value is None or not math.isfinite(value) or not in_range(value):
            value = _gguf_value(reader, key)
            # 7 digits: a float32's -1e-5 reads as -1e-05, not as the -9.99999974737875e-06 it widens to
            shown = f"{value:.7g}" if isinstance(value, float) else short(value)
            raise ModelSourceError(f"'{gguf_path(source)}': {key} must be {what}, got {shown} "
                                   f"({_gguf_type_name(field)})")


def _check_gguf_weight_count(source: ModelSource, architecture: str) -> None:
    """Refuse a header (sizes already checked positive) describing more weights than the file can hold: at least
    the embedding (vocab_size x embedding_length) and each block's feed-forward (embedding x feed_forward_length)."""
    reader, path = gguf_header(source), gguf_path(source)

    def sizes(name: str) -> list[int]:
        field = reader.fields.get(f"{architecture}.{name}")
        return _gguf_integers(field) if field is not None else [1]

    feed_forward = sizes("feed_forward_length")
    # one size for every block, or one per block
    feed_forward_total = feed_forward[0] * sizes("block_count")[0] if len(feed_forward) == 1 else sum(feed_forward)
    embedding = sizes("embedding_length")[0]
    weights = (sizes("vocab_size")[0] + feed_forward_total) * embedding
    file_bytes = os.path.getsize(path)
    if weights > GGUF_MAX_WEIGHTS_PER_BYTE * file_bytes:
        raise ModelSourceError(f"'{path}': its header's sizes describe at least {weights:,} weights, more than its "
                               f"{file_bytes:,} bytes can hold (no GGUF type stores a weight in under a "
                               "bit); the sizes are corrupt")


def _check_gguf_block_count(source: ModelSource, architecture: str) -> None:
    """The file's blocks (its `blk.N.*` tensors) are the header's block_count: transformers maps the tensors of the
    header's blocks only and drops the others without a word, so a file holding more compiled as a cut of the model
    (a header of fewer blocks than the file is refused for its missing weights when it loads)."""
    reader, path = gguf_header(source), gguf_path(source)
    field = reader.fields.get(f"{architecture}.block_count")
    if field is None:
        return
    declared = _gguf_integers(field)[0]
    beyond = [int(parts[1]) for tensor in reader.tensors
              if len(parts := str(tensor.name).split(".")) > 1 and parts[0] == "blk" and parts[1].isdigit()
              and int(parts[1]) >= declared]
    if beyond:
        raise ModelSourceError(f"'{path}' holds tensors of block {min(beyond)} but its header's "
                               f"{architecture}.block_count is {declared}: the file is a larger model than its header "
                               "describes")


def _check_gguf_tensor_layout(source: ModelSource) -> None:
    """Each tensor's data starts on the file's alignment and no two tensors share bytes. gguf-py checks neither:
    a misaligned tensor read shifted blocks (NaN weights), and two tensors at one offset compiled, the second a copy
    of the first."""
    reader = gguf_header(source)
    previous_end, previous = reader.data_offset, None
    for tensor in sorted(reader.tensors, key=lambda tensor: int(tensor.data_offset)):
        start = int(tensor.data_offset)
        if (start - reader.data_offset) % reader.alignment:
            raise ModelSourceError(f"'{gguf_path(source)}': tensor {tensor.name} starts at data offset "
                                   f"{start - reader.data_offset:,}, not a multiple of the file's alignment "
                                   f"({reader.alignment})")
        if start < previous_end:
            raise ModelSourceError(f"'{gguf_path(source)}': tensors {previous} and {tensor.name} overlap (bytes "
                                   f"{start:,} to {previous_end:,}); the tensor offsets are corrupt")
        previous_end, previous = start + int(tensor.n_bytes), tensor.name


@sharing_gguf_readers  # the header is read several times here: architecture, sizes, context, tensor layout
def check_supported(source: ModelSource) -> None:
    """Refuse, before any weight is loaded, a source fxllm cannot compile, naming the feature (an encoder-decoder,
    no causal-LM class, state-space or chunked-attention layers, ALiBi: model_features.check_capabilities), and a
    config whose sizes are not positive integers, whose context exceeds MAX_CONTEXT, whose rotary base or norm
    epsilons are out of range (CONFIG_NUMBER_FIELDS) (load_model also refuses sizes describing far more weights than
    the files hold). A GGUF file's header must be readable here (every tensor with at least one dimension), its size
    keys positive integers describing no more weights than the file can hold, its rotary base and norm epsilons
    finite numbers in range (GGUF_NUMBER_KEYS), and its tensors aligned and disjoint; its config is only known once
    transformers parses the whole file, so load_model checks the rest."""
    architecture = source_architecture(source)
    if source.gguf_file:
        _check_gguf_sizes(source, architecture.removeprefix("gguf:"))
        _check_gguf_numbers(source, architecture.removeprefix("gguf:"))
        _check_gguf_context(source, architecture.removeprefix("gguf:"))
        _check_gguf_tensor_layout(source)
        _check_gguf_block_count(source, architecture.removeprefix("gguf:"))
        return
    fields, config_path = read_config(source), source.directory / "config.json"
    if (source.directory / "generation_config.json").is_file():  # transformers' TypeError named no file
        read_json_object(source.directory / "generation_config.json", "a JSON object of generation fields")
    _check_config_sizes(fields, config_path)
    _check_config_numbers(fields, config_path)
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(source.directory, trust_remote_code=False)
    except Exception as exc:
        raise ModelSourceError(f"cannot read the model config in '{source.directory}': {exc}") from exc
    check_capabilities(config, architecture)


def check_gguf_tokenizer(source: ModelSource) -> None:
    """The tokenizer fields transformers indexes without checking: a vocabulary, merges or scores for a byte-level
    BPE, special-token ids inside the vocabulary."""
    from gguf import GGUFValueType

    reader, path = gguf_header(source), gguf_path(source)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise ModelSourceError(f"'{path}' holds no tokenizer vocabulary (tokenizer.ggml.tokens); fxllm reads the "
                               "tokenizer from the GGUF file itself")
    if tokens.types != [GGUFValueType.ARRAY, GGUFValueType.STRING]:
        raise ModelSourceError(f"'{path}': tokenizer.ggml.tokens must be an array of strings, not "
                               f"{_gguf_type_name(tokens)}")
    kind = _gguf_value(reader, "tokenizer.ggml.model")
    if kind == "gpt2" and not {"tokenizer.ggml.merges", "tokenizer.ggml.scores"} & set(reader.fields):
        raise ModelSourceError(f"'{path}' has a byte-level BPE tokenizer (tokenizer.ggml.model 'gpt2') without its "
                               "merges (tokenizer.ggml.merges)")
    for key in GGUF_SPECIAL_TOKEN_IDS:
        value = _gguf_value(reader, key)
        if isinstance(value, int) and not 0 <= value < len(tokens.data):
            raise ModelSourceError(f"'{path}': {key} is {value}, outside its vocabulary of {len(tokens.data):,} "
                                   "tokens")


def check_tokenizer_files(directory: Path) -> None:
    """tokenizer.json and tokenizer_config.json, where present, are JSON objects, and tokenizer.json has the
    `model` object and `added_tokens` list transformers reads without checking (a bare KeyError otherwise)."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        path = directory / name
        if not path.is_file():
            continue
        data = read_json_object(path)
        if name == "tokenizer.json":
            for key, kind in (("model", dict), ("added_tokens", list)):
                if not isinstance(data.get(key), kind):
                    raise ModelSourceError(f"{path} has no '{key}' {'object' if kind is dict else 'list'}: not a "
                                           "complete `tokenizers` file")
