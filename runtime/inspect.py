"""`fxllm inspect`: what an artifact holds — passes and their drift, I/O signature, file sizes, KV-cache cost, and
for a quantized model the bits per quantized weight as its model file stores them."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from fxllm.runtime.backend import check_contract_digest
from fxllm.runtime.checks import byte_size
from fxllm.runtime.manifest import load_manifest
from fxllm.runtime.paged_cache import default_num_blocks
from fxllm.runtime.stored_tensors import StoredTensor, stored_metadata, stored_tensors

# Buffer names of the quantize pass (passes/quantize.py, compiler/quant/experts.py) as lowering keeps them (ONNX
# Runtime's split-projections inserts `_partN` before the suffix): the codes, and what dequantizing them also reads.
_CODES = re.compile(r"_codes(_part\d+)?$")
_CODE_FORMAT_BITS = re.compile(r"_u?int(\d+)_(unpacked_)?codes(_part\d+)?$")  # embeddings: one code per byte
_QUANT_PARAMS = re.compile(r"_(scales|offsets|zero_points)(_part\d+)?(_f16)?$")
_ROLE = re.compile(r"_(u?int\d+_(unpacked_)?)?(codes|scales|offsets|zero_points)(?=(_part\d+)?(_f16)?$)")
_SIZE_LINE_FILES = 3  # the largest files the size line names; the rest are summed


def describe_artifact(path: str | os.PathLike) -> dict[str, Any]:
    """What `fxllm inspect` shows, as a JSON-ready dict; its "text" is the rendering. "quantization" is None for a
    float model, else {"weights": quantized weight count, "of_weights": all weights (float and quantized),
    "bits_per_weight": the stored bits of the codes, scales, offsets and zero points per quantized weight, "codes":
    the same per code format, [{"bits": format width, "stored_bits": width as stored, "weights", "bits_per_weight"}]}.
    ArtifactError for an invalid artifact."""
    loaded = load_manifest(path, verify=True)
    check_contract_digest(loaded, stored_metadata(loaded.model_file))  # as a load does: an edited spec is refused
    manifest, spec = loaded.data, loaded.data["spec"]
    kv_bytes = loaded.spec.kv_bytes_per_token()
    files = manifest["files"]
    info = {
        "artifact": str(path),
        "format_version": manifest["format_version"],
        "fxllm_version": manifest["fxllm_version"],
        "source": manifest.get("source", {"name": "(not recorded)"}),
        "target": manifest["target"],
        "architecture": spec["architecture"],
        "spec": spec,
        "passes": manifest["passes"],
        "io": manifest["io"],
        "bytes": {"total": sum(f["bytes"] for f in files.values()), "files": {k: v["bytes"] for k, v in files.items()}},
        "kv_cache_bytes_per_token": kv_bytes,
        "kv_cache_bytes_full_context": kv_bytes * spec["max_positions"],
        "kv_cache_bytes_per_token_before_passes": kv_bytes // spec["num_kv_heads"] * (
            spec.get("source_num_kv_heads") or spec["num_kv_heads"]),
        "compile_seconds": manifest.get("compile_seconds", {}),
        "quantization": quantization(loaded.model_file),
        # recorded beside the passes: the int8 KV cache's drift (measured on the written artifact), the draft, and
        # the runtime's recommendation
        "kv_cache": (manifest.get("lowering") or {}).get("kv_cache"),
        "speculative": manifest.get("speculative"),
        "runtime": manifest.get("runtime") or {},
    }
    if loaded.io.paged:
        block_size = loaded.io.block_size
        block_bytes = kv_bytes * block_size
        budget = default_num_blocks(block_bytes, block_size, spec["max_positions"])
        info["paged"] = {"block_size": block_size, "block_bytes": block_bytes, "default_budget_blocks": budget,
                         "default_budget_tokens": budget * block_size}
    info["text"] = _render(info)
    return info


def _render(info: dict[str, Any]) -> str:
    spec = info["spec"]
    lines = [
        f"artifact     {info['artifact']}  (format {info['format_version']}, fxllm {info['fxllm_version']}, "
        f"target {info['target']})",
        f"model        {info['source']['name']}: {spec['architecture']}, {spec['num_layers']} layers, "
        f"{spec['num_heads']} heads / {spec['num_kv_heads']} KV heads × {spec['head_dim']}, hidden "
        f"{spec['hidden_size']}, vocab {spec['vocab_size']}, context {spec['max_positions']}",
        f"KV cache     {info['kv_cache_bytes_per_token']:,} bytes/token "
        f"({spec.get('kv_cache_dtype') or spec.get('dtype', 'float32')}), "
        f"{byte_size(info['kv_cache_bytes_full_context'])} per sequence at full context"
        + (f"; {info['kv_cache_bytes_per_token_before_passes']:,} bytes/token before gqa regrouped "
           f"{spec['source_num_kv_heads']} → {spec['num_kv_heads']} KV heads" if spec.get("source_num_kv_heads") else ""),
        *([f"paged        blocks of {info['paged']['block_size']} tokens, {info['paged']['block_bytes']:,} bytes each; "
           f"the default pool ({byte_size(info['paged']['default_budget_blocks'] * info['paged']['block_bytes'])}) "
           f"holds {info['paged']['default_budget_tokens']:,} tokens "
           f"({info['paged']['default_budget_blocks']:,} blocks); set it with --kv-cache-memory / --kv-blocks"]
          if "paged" in info else []),
        _size_line(info["bytes"]["total"], info["bytes"]["files"]),
        *([_quantization_line(info["quantization"])] if info["quantization"] else []),
        *_layer_lines(spec.get("layers") or []),
        "passes",
    ]
    width = max((len(record["name"]) for record in info["passes"]), default=0)
    for record in info["passes"]:
        options = f" {record['options']}" if record["options"] else ""
        lines.append(f"  {record['name']:<{width}}{options} {record['seconds']:>6.2f} s   "
                     f"{_drift_text(record['drift'])}")
    if info["kv_cache"]:
        kv = info["kv_cache"]
        lines.append(f"  {kv['dtype']} KV cache ({kv['calibration']}), on the written artifact: "
                     f"{_drift_text(kv['drift'])}")
    if info["speculative"]:
        draft = info["speculative"]
        lines.append(f"speculative  {draft.get('description') or draft['mode']}, k {draft['k']}")
    if info["runtime"].get("int8_activations"):
        lines.append("runtime      int8 activations in the quantized matmuls by default (--float-activations: float)")
    lines.append("inputs")
    lines += [f"  {s['name']:<16} {s['dtype']}[{', '.join(map(str, s['dims']))}]" for s in _folded(info["io"]["inputs"])]
    lines.append("outputs")
    lines += [f"  {s['name']:<16} {s['dtype']}[{', '.join(map(str, s['dims']))}]" for s in _folded(info["io"]["outputs"])]
    if info["compile_seconds"]:
        lines.append("compile      " + ", ".join(f"{k} {v:.1f}s" for k, v in info["compile_seconds"].items()))
    for note in spec.get("notes", []):
        lines.append(f"note         {note}")
    return "\n".join(lines)


def _drift_text(drift: dict[str, float]) -> str:
    return (f"max|Δlogit| {drift['max_abs_logit']:.2e}  KL {drift['mean_kl']:.1e}  "
            f"greedy {drift['greedy_agreement']:.0%}")


def _size_line(total: int, files: dict[str, int]) -> str:
    """'size  1.5 MiB: model.onnx.data 1.3 MiB, ...': the total, then the largest files, the rest summed."""
    ranked = sorted(files.items(), key=lambda item: -item[1])
    shown = [f"{name} {byte_size(size)}" for name, size in ranked[:_SIZE_LINE_FILES]]
    rest = ranked[_SIZE_LINE_FILES:]
    if rest:
        shown.append(f"{len(rest)} more file{'s' if len(rest) > 1 else ''} {byte_size(sum(size for _, size in rest))}")
    return f"size         {byte_size(total)} in {len(files)} file{'s' if len(files) != 1 else ''}: " + ", ".join(shown)


def _quantization_line(quant: dict[str, Any]) -> str:
    """'quantized    21.9% of 336,202 weights as int4 codes: 4.22 bits per quantized weight as stored, scales and
    offsets counted'; with several code formats (or one stored two ways: an embedding's int4 codes one per byte),
    also each one's bits and weight count."""
    names = [f"int{c['bits']}" + (f" in {c['stored_bits']}-bit storage" if c["stored_bits"] != c["bits"] else "")
             for c in quant["codes"]]
    formats = list(dict.fromkeys(f"int{c['bits']}" for c in quant["codes"]))
    each = "" if len(names) == 1 else " (" + ", ".join(
        f"{name} {c['bits_per_weight']:.2f} over {c['weights']:,}" for name, c in zip(names, quant["codes"])) + ")"
    stored = f" ({names[0].removeprefix(formats[0]).strip()})" if len(names) == 1 and names[0] != formats[0] else ""
    return (f"quantized    {_percent(quant['weights'], quant['of_weights'])} of {quant['of_weights']:,} weights as "
            f"{' and '.join(formats)} codes{stored}: {quant['bits_per_weight']:.2f} bits per quantized weight as "
            f"stored{each}, scales and offsets counted")


def _percent(part: int, whole: int) -> str:
    """part/whole to 0.1%, never rounded up to 100.0% while part < whole (float norms stay visible)."""
    share = 100 * part / whole if whole else 100.0
    return f"{min(share, 99.9) if part < whole else share:.1f}%"


def quantization(model_file: Path) -> dict[str, Any] | None:
    """Quantized weights of a model file (.onnx or a torch.export .pt2) by the quantize pass's buffer names: None
    when it holds no codes, else the dict `describe_artifact` documents. A file that cannot be parsed:
    ArtifactError."""
    tensors = list(stored_tensors(model_file))
    codes = [t for t in tensors if _CODES.search(t.name) and not t.is_float and t.elements]
    if not codes:
        return None
    params = [t for t in tensors if _QUANT_PARAMS.search(t.name)]
    quantized = sum(t.elements for t in codes)
    floats = sum(t.elements for t in tensors if t.is_float and not _QUANT_PARAMS.search(t.name))
    overhead = {}  # stem → stored bits of its scales, offsets and zero points
    for param in params:
        overhead[_stem(param.name)] = overhead.get(_stem(param.name), 0) + param.elements * param.bits
    formats: dict[tuple[int, int], list[int]] = {}  # (format bits, stored bits) → [weights, stored bits]
    for code in codes:
        totals = formats.setdefault((_format_bits(code), code.bits), [0, 0])
        totals[0] += code.elements
        totals[1] += code.elements * code.bits + overhead.get(_stem(code.name), 0)
    return {"weights": quantized, "of_weights": quantized + floats,
            "bits_per_weight": round(sum(t.elements * t.bits for t in codes + params) / quantized, 4),
            "codes": [{"bits": bits, "stored_bits": stored, "weights": weights,
                       "bits_per_weight": round(total / weights, 4)}
                      for (bits, stored), (weights, total) in sorted(formats.items())]}


def _stem(name: str) -> str:
    """The buffer name without its role: quantized_2_int8_codes_part0 and quantized_2_scales_part0_f16 →
    quantized_2_part0 (a layer's codes and the scales, offsets and zero points that go with them share it)."""
    return _ROLE.sub("", name).removesuffix("_f16")


def _format_bits(codes: StoredTensor) -> int:
    """The codes' format width: the one their name gives (int4 codes may be stored one per byte), else as stored."""
    match = _CODE_FORMAT_BITS.search(codes.name)
    return int(match.group(1)) if match else codes.bits


def _layer_lines(layers: list[dict[str, Any]]) -> list[str]:
    """One line per distinct layer description, naming its layers: 'layers 0,2   sliding 4096, rope full'."""
    groups: dict[str, list[int]] = {}
    for index, layer in enumerate(layers):
        parts = [f"attention {layer.get('attention', '?')}"]
        if layer.get("softcap"):
            parts.append(f"softcap {layer['softcap']:g}")
        if layer.get("sinks"):
            parts.append("sinks")
        parts.append(f"rope {layer.get('rope', '?')}")
        if layer.get("qk_norm"):
            parts.append("qk-norm")
        if layer.get("moe"):
            parts.append(f"MoE {layer['moe']['experts']} experts, top {layer['moe']['top_k']}")
        groups.setdefault(", ".join(parts), []).append(index)
    return [f"{'layers ' + _ranges(indices):<13}{text}" for text, indices in groups.items()]


def _ranges(indices: list[int]) -> str:
    """[0, 1, 2, 4] → '0-2,4'."""
    spans: list[list[int]] = []
    for i in indices:
        if spans and i == spans[-1][1] + 1:
            spans[-1][1] = i
        else:
            spans.append([i, i])
    return ",".join(f"{a}-{b}" if b > a else f"{a}" for a, b in spans)


def _folded(signature: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Show per-layer cache tensors once, as past_key_{0..N-1}."""
    shown, seen = [], set()
    for sig in signature:
        stem = sig["name"].rstrip("0123456789")
        if stem.endswith("_") and stem in seen:
            continue
        if stem.endswith("_"):
            seen.add(stem)
            count = sum(1 for s in signature if s["name"].rstrip("0123456789") == stem)
            sig = {**sig, "name": f"{stem}{{0..{count - 1}}}"}
        shown.append(sig)
    return shown
