"""Writing GGUF test files with the `gguf` package.

- `copy_metadata`: an existing file's metadata, optionally overridden, into a new writer.
- `small_tokenizer`: SmolLM2's byte-level BPE tokenizer cut down to its first ids, as a Hugging Face tokenizer
  directory. Reading a GGUF's vocabulary runs Python per token (gguf-py's field parse, transformers' conversion), so
  a file with SmolLM2's 49,152 tokens costs seconds per load (its tokenizer: 1.8 s through fxllm's shared reader,
  6.6 s without); one with 2,048 loads in well under a second.
- `tiny_hf_model`: a seeded random-weight Hugging Face model of one architecture, with that tokenizer.
- `write_gguf`: a Hugging Face model directory as a GGUF that transformers' GGUF loader reads back as the same model.
  Every name, permutation and offset is the inverse of what transformers does when reading (its tables in
  `transformers.integrations.ggml` and `transformers.modeling_gguf_pytorch_utils`), not a hand-written list.
- `Typed`, `patch_tensor_offset`: hostile files: a key of another type than its own, a tensor moved in the data.
"""

from __future__ import annotations

import functools
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from gguf import GGUFWriter
    from transformers import PreTrainedConfig, PreTrainedModel

SMOLLM2 = "smollm2-135m"
# llama.cpp's pre-tokenizer name for SmolLM2's; transformers has no split regex for it, so it keeps GPT-2's, which
# is the one SmolLM2's byte-level pre-tokenizer uses.
GGUF_PRE_TOKENIZER = "smollm"
WEIGHT_TYPES = ("F32", "F16", "Q8_0", "Q4_0", "Q4_1")
# transformers' model_type → the `general.architecture` it reads that model back from (the renames in
# `get_gguf_hf_weights_map`). llama.cpp writes Mistral as llama; transformers tells them apart by `general.name`.
GGUF_ARCHITECTURE = {"mistral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "gemma3_text": "gemma3"}
# ... and the section of GGUF_CONFIG_MAPPING that holds its hyper-parameter keys.
CONFIG_SECTION = {"gemma3_text": "gemma3"}
# Config entries that name the checkpoint rather than describe the model.
UNCHECKED_CONFIG = {"_name_or_path", "architectures", "dtype", "transformers_version"}


def copy_metadata(reader, writer, overrides: dict[str, Any] | None = None, skip: str | None = None) -> None:
    """Every key-value field of `reader` (a GGUFReader) into `writer` (a GGUFWriter, architecture already set),
    with `overrides` replacing the values of the keys it names; keys starting with `skip` are left out."""
    from gguf import GGUFValueType

    overrides = overrides or {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or skip and name.startswith(skip):
            continue
        kind = field.types[0]
        if name in overrides:
            writer.add_key_value(name, overrides[name], kind)
        elif kind == GGUFValueType.ARRAY:
            item = field.types[1]
            values = [bytes(field.parts[i]).decode("utf-8", "surrogateescape") if item == GGUFValueType.STRING
                      else field.parts[i].tolist()[0] for i in field.data]
            writer.add_key_value(name, values, kind, sub_type=item)
        elif kind == GGUFValueType.STRING:
            writer.add_key_value(name, bytes(field.parts[-1]).decode("utf-8", "surrogateescape"), kind)
        else:
            writer.add_key_value(name, field.parts[-1].tolist()[0], kind)


# ---------------------------------------------------------------------------------------------------- tokenizer


@functools.cache
def smollm2_tokenizer() -> tuple[str, dict[str, Any]]:
    """SmolLM2's tokenizer as transformers builds it from the shipped GGUF: (tokenizer.json text, the
    tokenizer_config entries the GGUF gives). Cached: the parse is the slow part."""
    from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

    from fxllm.compiler.sources import resolve_source

    source = resolve_source(SMOLLM2)
    # What `load_tokenizer(source)` builds (the same tokenizer.json), without parsing the GGUF a second time for a
    # config the tokenizer does not need.
    architecture, tokenizer_dict, tokenizer_config = get_gguf_tokenizer(str(source.directory / source.gguf_file))
    backend, _ = convert_gguf_tokenizer(architecture, tokenizer_dict)
    return backend.to_str(), tokenizer_config


def small_tokenizer(directory: Path, vocab_size: int = 2048) -> Path:
    """Write into `directory` (created if needed) SmolLM2's byte-level BPE tokenizer cut to its ids below
    `vocab_size`: tokenizer.json with the merges whose two parts and result all stay, and tokenizer_config.json
    with SmolLM2's special tokens (bos <|im_start|>, eos and pad <|im_end|>, unk <|endoftext|>), its chat template
    and add_bos_token false. Every byte token SmolLM2 has is kept, so text encodes and decodes back unchanged
    (SmolLM2 has none for the control characters 0x04, 0x06, 0x13, 0x14, 0x16 and 0x1d). Returns `directory`."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    text, config = smollm2_tokenizer()
    tokenizer = json.loads(text)
    model = tokenizer["model"]
    vocab = {token: index for token, index in model["vocab"].items() if index < vocab_size}
    # SmolLM2 itself has no token for 21 bytes (ones UTF-8 never uses, and 6 control characters)
    missing = (set(bytes_to_unicode().values()) & model["vocab"].keys()) - vocab.keys()
    if missing:
        raise ValueError(f"a {vocab_size}-token SmolLM2 vocabulary lacks {len(missing)} byte tokens; keep more ids")
    model["vocab"] = vocab
    model["merges"] = [pair for pair in model["merges"] if {*pair, "".join(pair)} <= vocab.keys()]
    tokenizer["added_tokens"] = [token for token in tokenizer["added_tokens"] if token["id"] < vocab_size]
    special = {name: config[name] for name in ("bos_token", "eos_token", "unk_token", "pad_token")}
    if not set(special.values()) <= vocab.keys():
        raise ValueError(f"SmolLM2's special tokens {special} do not all fit in {vocab_size} ids")

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False))
    tokenizer_config = {"tokenizer_class": "TokenizersBackend", **special,
                        "add_bos_token": config.get("add_bos_token", False), "chat_template": config["chat_template"]}
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, ensure_ascii=False, indent=2))
    return directory


@functools.cache
def _smollm2_reader():
    from gguf import GGUFReader

    from fxllm.compiler.sources import resolve_source

    source = resolve_source(SMOLLM2)
    return GGUFReader(source.directory / source.gguf_file)


def smollm2_cut(path: Path, layers: int = 2, vocab_size: int = 2048, kind: str | None = None) -> Path:
    """SmolLM2's own GGUF cut to its first `layers` decoder layers and `vocab_size` token ids (real weights and
    real, cut tokenizer: `small_tokenizer`'s), written to `path`: every kept tensor's blocks as the file stores them
    (token_embd's first rows), or with `kind` (a gguf quantization type name) every matrix re-quantized from its
    dequantized values. Returns `path`."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import dequantize, quantize

    reader = _smollm2_reader()
    path = Path(path)
    metadata = _tokenizer_metadata(small_tokenizer(path.parent / f"{path.stem}-tokenizer", vocab_size))
    writer = GGUFWriter(path, "llama")
    copy_metadata(reader, writer, {"llama.block_count": layers, "llama.vocab_size": vocab_size}, skip="tokenizer.")
    for key, (value, value_type, item_type) in metadata.items():
        writer.add_key_value(key, value, value_type, sub_type=item_type)
    keep = [t for t in reader.tensors if not t.name.startswith("blk.") or int(t.name.split(".")[1]) < layers]
    for tensor in keep:
        data = tensor.data[:vocab_size] if tensor.name == "token_embd.weight" else tensor.data
        stored = tensor.tensor_type
        if kind is None or data.ndim == 1 or stored == GGMLQuantizationType.F32 and len(tensor.shape) == 1:
            writer.add_tensor(tensor.name, np.ascontiguousarray(data),
                              raw_dtype=None if stored == GGMLQuantizationType.F32 else stored)
            continue
        values = np.asarray(dequantize(np.ascontiguousarray(data), stored), np.float32)
        writer.add_tensor(tensor.name, quantize(values, GGMLQuantizationType[kind]),
                          raw_dtype=GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# ---------------------------------------------------------------------------------------------------- tiny models

TINY_SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, max_position_embeddings=256)
# GGUF architecture name → (transformers config class, changes to TINY_SHAPE; None drops a field). Values
# transformers' GGUF loader does not read are left at the class default, which is what it reads them back as.
TINY_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {}),  # no key for its head_dim: it stays 128
    # no key for the experts' width either (moe_intermediate_size stays 768); the loader sets norm_topk_prob
    "qwen3moe": ("Qwen3MoeConfig", dict(head_dim=16, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True)),
    "gemma2": ("Gemma2Config", dict(head_dim=16, sliding_window=128)),
    "gemma3": ("Gemma3TextConfig", dict(head_dim=16, sliding_window=128)),
    "phi3": ("Phi3Config", {}),
    "starcoder2": ("Starcoder2Config", {}),
    # Falcon-7B's layout, the only one the loader reads: one shared KV head (multi_query), an FFN 4x hidden wide
    "falcon": ("FalconConfig", dict(num_key_value_heads=None, intermediate_size=None)),
    "stablelm": ("StableLmConfig", dict(use_qkv_bias=True)),
    "nemotron": ("NemotronConfig", {}),
}
TINY_ARCHITECTURES = tuple(TINY_CONFIGS)


def tiny_hf_model(arch: str, directory: Path, seed: int = 0, overrides: dict[str, Any] | None = None) -> Path:
    """Save into `directory` a random-weight model of `arch` (a GGUF architecture name, one of TINY_ARCHITECTURES):
    TINY_SHAPE (2 layers, hidden 64, 4 heads, 2 KV heads, FFN 128, 256 positions) as TINY_CONFIGS adapts it, then
    `overrides` (config fields; None drops one), with `small_tokenizer`'s tokenizer, vocabulary size and special
    token ids. Norm weights and biases are randomized too, so a wrong offset or bias shows. Deterministic for a
    `seed`; the global torch RNG is left as it was. Returns `directory`."""
    import torch
    import transformers

    if arch not in TINY_CONFIGS:
        raise ValueError(f"no tiny config for {arch!r}; known: {', '.join(TINY_ARCHITECTURES)}")
    directory = Path(directory)
    small_tokenizer(directory)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    config_class, changes = TINY_CONFIGS[arch]
    fields = {**TINY_SHAPE, "vocab_size": len(tokenizer), "bos_token_id": tokenizer.bos_token_id,
              "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id, **changes,
              **(overrides or {})}
    config = getattr(transformers, config_class)(**{name: value for name, value in fields.items() if value is not None})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
        with torch.no_grad():
            for parameter in model.parameters():
                if parameter.ndim == 1:
                    parameter.add_(torch.randn_like(parameter) * 0.1)
    model.save_pretrained(directory)
    return directory


# ---------------------------------------------------------------------------------------------------- GGUF writing


def write_gguf(model_dir: Path, path: Path, weight_type: str = "F32", overrides: dict[str, Any] | None = None,
               tensor_types: dict[str, str] | None = None) -> Path:
    """Write the Hugging Face model in `model_dir` (config.json, safetensors, a byte-level BPE tokenizer.json and
    tokenizer_config.json, as `tiny_hf_model` makes) to the GGUF file `path` (parent folders created), such that
    `AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name)` is the same model and
    `AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)` tokenizes the same way.

    Matrices (and stacked experts) are stored as `weight_type` (one of WEIGHT_TYPES), except those whose rows are
    not a whole number of quantization blocks, which stay F32 as 1-D tensors (norms, biases) do.
    `tensor_types` stores the named GGUF tensors ('token_embd.weight', 'blk.1.ffn_down.weight') as other types
    (any type `gguf.quants.quantize` writes, e.g. Q5_0), 1-D ones excepted.
    `overrides` replaces metadata values by key (keeping the written type, or the type a `Typed` value names), adds
    new keys (type from the Python value) or, with None, drops a key. Without overrides the written file is checked:
    a config value that transformers would read back differently (one the GGUF has no key for, left off its class
    default) raises ValueError. Returns `path`."""
    import torch
    from transformers import AutoModelForCausalLM

    if weight_type not in WEIGHT_TYPES:
        raise ValueError(f"weight_type {weight_type!r} is not one of {', '.join(WEIGHT_TYPES)}")
    model_dir, path = Path(model_dir), Path(path)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    architecture = GGUF_ARCHITECTURE.get(model.config.model_type, model.config.model_type)
    metadata = {**_general_metadata(model.config, model_dir, weight_type), **_config_metadata(model.config),
                **_tokenizer_metadata(model_dir)}
    _write_file(path, architecture, _overridden(metadata, overrides or {}), _gguf_tensors(model, architecture),
                weight_type, tensor_types or {})
    if not overrides:
        mismatches = gguf_config_mismatches(model.config, path)
        if mismatches:
            raise ValueError(f"transformers reads {path} back with another config, {{name: (model's, read)}}: "
                             f"{mismatches}; give the model values a GGUF carries (a key transformers reads, else "
                             f"the config class's default; special token ids are the tokenizer's)")
    return path


@dataclass(frozen=True)
class Typed:
    """An override value written as GGUF type `kind` (a GGUFValueType; arrays of `item`), whatever type the key
    had."""

    value: Any
    kind: Any
    item: Any = None


def patch_tensor_offset(path: Path, name: str, offset: int) -> None:
    """Rewrite, in place, the data offset (relative to the data section) that `path`'s header gives tensor `name`."""
    data = bytearray(Path(path).read_bytes())
    encoded = name.encode()
    at = data.index(struct.pack("<Q", len(encoded)) + encoded) + 8 + len(encoded)
    n_dims = struct.unpack_from("<I", data, at)[0]
    struct.pack_into("<Q", data, at + 4 + 8 * n_dims + 4, offset)  # past n_dims, the dims and the type id
    Path(path).write_bytes(data)


def _overridden(metadata: dict[str, tuple], overrides: dict[str, Any]) -> dict[str, tuple]:
    """`metadata` ({key: (value, type, item type)}) with `overrides` applied as `write_gguf` describes."""
    metadata = dict(metadata)
    for key, value in overrides.items():
        if value is None:
            metadata.pop(key, None)
        elif isinstance(value, Typed):
            metadata[key] = (value.value, value.kind, value.item)
        else:
            metadata[key] = (value, *metadata[key][1:]) if key in metadata else _entry(value)
    return metadata


def _write_file(path: Path, architecture: str, metadata: dict[str, tuple], tensors: dict[str, np.ndarray],
                weight_type: str, tensor_types: dict[str, str]) -> None:
    from gguf import GGUFWriter

    path.parent.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(path, architecture)
    for key, (value, kind, item_kind) in metadata.items():
        writer.add_key_value(key, value, kind, sub_type=item_kind)
    unknown = set(tensor_types) - set(tensors)
    if unknown:
        raise ValueError(f"tensor_types names tensors the file does not have: {sorted(unknown)}")
    for name, weights in tensors.items():
        _add_tensor(writer, name, weights, tensor_types.get(name, weight_type))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def gguf_config_mismatches(config: PreTrainedConfig, path: Path) -> dict[str, tuple[Any, Any]]:
    """The entries of `config` (a transformers config) that transformers' GGUF loader reads from the file at `path`
    with another value: {name: (config's value, value read)}, leaving out UNCHECKED_CONFIG. Floats compare to
    float32 precision, the width GGUF stores them in."""
    from transformers import AutoConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    read = AutoConfig.for_model(**load_gguf_checkpoint(str(path), return_tensors=False)["config"]).to_dict()
    expected = config.to_dict()
    return {name: (value, read.get(name)) for name, value in expected.items()
            if name not in UNCHECKED_CONFIG and not _same_value(value, read.get(name))}


def _same_value(a: Any, b: Any) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_value(a[k], b[k]) for k in a)
    if isinstance(a, float) and isinstance(b, (int, float)) and not isinstance(b, bool):
        return bool(np.isclose(a, b, rtol=1e-6, atol=0))
    return a == b


def _value_type(value: Any) -> tuple[Any, Any]:
    """(GGUF value type, array item type or None) for a Python value."""
    from gguf import GGUFValueType

    if isinstance(value, (list, tuple)) and value:
        return GGUFValueType.ARRAY, _value_type(value[0])[0]
    if isinstance(value, bool):
        return GGUFValueType.BOOL, None
    if isinstance(value, int):
        return (GGUFValueType.INT32 if value < 0 else GGUFValueType.UINT32), None
    if isinstance(value, float):
        return GGUFValueType.FLOAT32, None
    if isinstance(value, str):
        return GGUFValueType.STRING, None
    raise TypeError(f"no GGUF value type for {value!r}")


def _entry(value: Any) -> tuple[Any, Any, Any]:
    return (value, *_value_type(value))


def _general_metadata(config: PreTrainedConfig, model_dir: Path, weight_type: str) -> dict[str, tuple]:
    from gguf import LlamaFileType

    file_type = {"F32": "ALL_F32", "F16": "MOSTLY_F16"}.get(weight_type, f"MOSTLY_{weight_type}")
    # transformers recognises Mistral only by this exact name (its architecture is llama)
    name = "mistral" if config.model_type == "mistral" else model_dir.name
    return {"general.name": _entry(name), "general.file_type": _entry(int(LlamaFileType[file_type]))}


def _config_metadata(config: PreTrainedConfig) -> dict[str, tuple]:
    """The architecture's hyper-parameter keys: GGUF_CONFIG_MAPPING read backwards."""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    architecture = GGUF_ARCHITECTURE.get(config.model_type, config.model_type)
    section = GGUF_CONFIG_MAPPING[CONFIG_SECTION.get(config.model_type, config.model_type)]
    metadata = {}
    for key, attribute in section.items():
        if attribute is None:  # a key transformers skips
            continue
        value = _rope_theta(config) if attribute == "rope_theta" else getattr(config, attribute, None)
        if value is None:
            continue
        if key.endswith(("freq_base", "epsilon")):  # float32 in llama.cpp's files, even where the config has an int
            value = float(value)
        metadata[f"{architecture}.{key}"] = _entry(value)
    return metadata


def _rope_theta(config: PreTrainedConfig) -> float | None:
    """Transformers reads `rope.freq_base` as the rope_theta of the full-attention layers (Gemma 3 has a second one,
    for its sliding layers, that no GGUF key carries)."""
    parameters = getattr(config, "rope_parameters", None) or {}
    parameters = parameters.get("full_attention", parameters)
    return parameters.get("rope_theta")


def _tokenizer_metadata(model_dir: Path) -> dict[str, tuple]:
    """tokenizer.ggml.* and tokenizer.chat_template for the byte-level BPE tokenizer in `model_dir`."""
    from gguf import GGUFValueType

    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    model = tokenizer["model"]
    if model["type"] != "BPE" or (tokenizer.get("pre_tokenizer") or {}).get("type") != "ByteLevel":
        raise ValueError(f"{model_dir}: only a byte-level BPE tokenizer (as small_tokenizer writes) is supported")
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    if [model["vocab"][token] for token in tokens] != list(range(len(tokens))):
        raise ValueError(f"{model_dir}: the vocabulary's ids are not 0..{len(tokens) - 1}")
    added = {token["id"]: token["special"] for token in tokenizer["added_tokens"]}
    # llama.cpp's token types: 1 normal, 3 control (special), 4 user-defined (added, not special)
    token_types = [(3 if added[index] else 4) if index in added else 1 for index in range(len(tokens))]
    merges = [" ".join(pair) if isinstance(pair, list) else pair for pair in model["merges"]]

    metadata = {
        "tokenizer.ggml.model": _entry("gpt2"),
        "tokenizer.ggml.pre": _entry(GGUF_PRE_TOKENIZER),
        "tokenizer.ggml.tokens": (tokens, GGUFValueType.ARRAY, GGUFValueType.STRING),
        "tokenizer.ggml.token_type": (token_types, GGUFValueType.ARRAY, GGUFValueType.INT32),
        "tokenizer.ggml.merges": (merges, GGUFValueType.ARRAY, GGUFValueType.STRING),
    }
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"), ("unk_token", "unknown_token_id"),
                      ("pad_token", "padding_token_id")):
        token = config.get(name)
        token = token.get("content") if isinstance(token, dict) else token
        if token is not None:
            metadata[f"tokenizer.ggml.{key}"] = _entry(model["vocab"][token])
    metadata["tokenizer.ggml.add_bos_token"] = _entry(bool(config.get("add_bos_token", False)))
    template = config.get("chat_template")
    if template is None and (model_dir / "chat_template.jinja").is_file():
        template = (model_dir / "chat_template.jinja").read_text()
    if template is not None:
        metadata["tokenizer.chat_template"] = _entry(template)
    return metadata


# Inverses of transformers' TENSOR_PROCESSORS, by GGUF architecture: (GGUF tensor name, transformers' weights,
# config) → the weights as the file stores them. An architecture with no processor there stores weights as they are.


def _llama_permute(name: str, weights: np.ndarray, config: PreTrainedConfig) -> np.ndarray:
    """llama.cpp's q/k row order for its rotary layout (convert_hf_to_gguf's `LlamaModel.permute`)."""
    if ".attn_q." in name:
        heads = config.num_attention_heads
    elif ".attn_k." in name:
        heads = config.num_key_value_heads
    else:
        return weights
    return weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(
        weights.shape)


def _norm_plus_one(name: str, weights: np.ndarray, config: PreTrainedConfig) -> np.ndarray:
    """Gemma's and Nemotron's norms compute with 1 + weight; llama.cpp stores the sum."""
    return weights + np.float32(1) if "norm.weight" in name else weights


def _moe_split(name: str, weights: np.ndarray, config: PreTrainedConfig) -> np.ndarray:
    """transformers fuses each layer's expert gate and up projections as [experts, 2 * width, hidden] (gate
    first); the file stores them apart."""
    if ".ffn_gate_exps." in name or ".ffn_up_exps." in name:
        width = weights.shape[1] // 2
        return weights[:, :width] if ".ffn_gate_exps." in name else weights[:, width:]
    if "ffn_gate_inp_shexp" in name:
        return weights.reshape(-1)
    return weights


INVERSE_PROCESSORS = {"llama": _llama_permute, "gemma2": _norm_plus_one, "gemma3": _norm_plus_one,
                      "nemotron": _norm_plus_one, "qwen2moe": _moe_split, "qwen3moe": _moe_split}


def _gguf_tensors(model: PreTrainedModel, architecture: str) -> dict[str, np.ndarray]:
    """{GGUF tensor name: float32 array as the file stores it} for every tensor of `model`, named through
    transformers' own GGUF→transformers name map, reversed. The lm_head of a tied model is left out, as llama.cpp
    does (transformers reads a missing `output.weight` as tied embeddings)."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    if architecture in TENSOR_PROCESSORS and architecture not in INVERSE_PROCESSORS:
        raise NotImplementedError(f"no inverse of transformers' {TENSOR_PROCESSORS[architecture].__name__}")
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=model.config.to_dict())
    inverse = INVERSE_PROCESSORS.get(architecture, lambda name, weights, config: weights)
    gguf_names: dict[str, list[str]] = {}
    # named by the GGUF architecture: transformers looks the model_type up in gguf-py, which has no "mistral"
    for gguf_name, hf_name in get_gguf_hf_weights_map(model, processor, model_type=architecture).items():
        # a parameter not named `.weight`/`.bias` (stacked experts) is mapped without a suffix
        full_name = gguf_name if gguf_name.endswith((".weight", ".bias")) else f"{gguf_name}.weight"
        gguf_names.setdefault(hf_name, []).append(full_name)

    tied = model.config.get_text_config().tie_word_embeddings
    tied_copies = set(model._tied_weights_keys or {}) if tied else set()
    tensors, unmapped = {}, []
    for hf_name, tensor in model.state_dict().items():
        if hf_name in tied_copies:
            continue
        names = gguf_names.get(hf_name)
        if not names:
            unmapped.append(hf_name)
            continue
        weights = tensor.detach().float().numpy()
        for name in names:
            tensors[name] = np.ascontiguousarray(inverse(name, weights, model.config), dtype=np.float32)
    if unmapped:
        raise ValueError(f"transformers maps no GGUF tensor to {unmapped}; it would leave them uninitialized")
    return tensors


def _add_tensor(writer: GGUFWriter, name: str, weights: np.ndarray, weight_type: str) -> None:
    """Add one tensor: 1-D ones and rows that are not whole quantization blocks as F32, the rest as `weight_type`."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quantize

    kind = GGMLQuantizationType[weight_type]
    block = GGML_QUANT_SIZES[kind][0]
    if weights.ndim == 1 or weights.shape[-1] % block:
        kind = GGMLQuantizationType.F32
    if kind in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        writer.add_tensor(name, quantize(weights, kind))
    else:
        writer.add_tensor(name, quantize(weights, kind), raw_dtype=kind)
