"""`fxllm inspect`: what an artifact holds — passes and their drift, I/O signature, file sizes, KV-cache cost."""

from __future__ import annotations

import os
from typing import Any

from fxllm.runtime.manifest import load_manifest
from fxllm.runtime.paged_cache import DEFAULT_KV_BUDGET, default_num_blocks


def _mb(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def describe_artifact(path: str | os.PathLike) -> dict[str, Any]:
    loaded = load_manifest(path, verify=True)
    manifest, spec = loaded.data, loaded.data["spec"]
    kv_bytes = loaded.spec.kv_bytes_per_token()
    files = manifest["files"]
    info = {
        "artifact": str(path),
        "format_version": manifest["format_version"],
        "fxllm_version": manifest["fxllm_version"],
        "source": manifest["source"],
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
        f"KV cache     {info['kv_cache_bytes_per_token']:,} bytes/token ({spec.get('dtype', 'float32')}), "
        f"{_mb(info['kv_cache_bytes_full_context'])} per sequence at full context"
        + (f"; {info['kv_cache_bytes_per_token_before_passes']:,} bytes/token before gqa regrouped "
           f"{spec['source_num_kv_heads']} → {spec['num_kv_heads']} KV heads" if spec.get("source_num_kv_heads") else ""),
        *([f"paged        blocks of {info['paged']['block_size']} tokens, {info['paged']['block_bytes']:,} bytes each; "
           f"the default {_mb(DEFAULT_KV_BUDGET)} pool holds {info['paged']['default_budget_tokens']:,} tokens "
           f"({info['paged']['default_budget_blocks']:,} blocks); set it with --kv-cache-memory / --kv-blocks"]
          if "paged" in info else []),
        f"size         {_mb(info['bytes']['total'])}: "
        + ", ".join(f"{k} {_mb(v)}" for k, v in info["bytes"]["files"].items() if v > 2**20),
        *_layer_lines(spec.get("layers") or []),
        "passes",
    ]
    for record in info["passes"]:
        drift = record["drift"]
        options = f" {record['options']}" if record["options"] else ""
        lines.append(f"  {record['name']:<14}{options} {record['seconds']:>6.2f} s   max|Δlogit| "
                     f"{drift['max_abs_logit']:.2e}  KL {drift['mean_kl']:.1e}  greedy {drift['greedy_agreement']:.0%}")
    lines.append("inputs")
    lines += [f"  {s['name']:<16} {s['dtype']}[{', '.join(map(str, s['dims']))}]" for s in _folded(info["io"]["inputs"])]
    lines.append("outputs")
    lines += [f"  {s['name']:<16} {s['dtype']}[{', '.join(map(str, s['dims']))}]" for s in _folded(info["io"]["outputs"])]
    if info["compile_seconds"]:
        lines.append("compile      " + ", ".join(f"{k} {v:.1f}s" for k, v in info["compile_seconds"].items()))
    for note in spec.get("notes", []):
        lines.append(f"note         {note}")
    return "\n".join(lines)


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
