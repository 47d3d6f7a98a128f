"""GGUF-exact weights: a GGUF file's own quantized blocks become the artifact's int4/int8 blocks, without re-rounding.

transformers loads a GGUF by dequantizing every tensor to float32; the graph is captured from that float model.
This module reads the same file's raw blocks and turns each supported tensor into fxllm's stored form (signed codes,
per-block scales, optional per-block offsets; see numerics), which dequantizes to exactly the float weight
transformers produced (up to float32 rounding of the offset term):

| GGUF type | block | stored value | fxllm form |
| --- | --- | --- | --- |
| Q4_0 | 32 | d·(q − 8), q in 0..15 | int4 code q − 8, scale d |
| Q4_1 | 32 | d·q + m | int4 code q − 8, scale d, offset m + 8d |
| Q8_0 | 32 | d·q, q in −128..127 | int8 code q, scale d |

d and m are float16 in the file; they are kept as float32 holding the same values (lowering stores the scales
back as float16, see onnx_export). Every tensor is checked against the float weight the model was captured with,
so a name mapping or row permutation that does not reproduce transformers' weights is caught, never shipped.
Other quantized types (K-quants, Q5_x, IQ*) are not mapped: their layers keep transformers' float weights, and
the compile says so (a `Fallback` per weight, printed as a warning by the quantize pass).

A fused weight (q/k/v or gate/up after fuse-projections, a MoE layer's gate_up experts) is one block form: its parts
must share one (`shared_form`: Q4_0 and Q4_1 parts do, a Q4_0 block being a Q4_1 block with offset 0).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fxllm.compiler.quant.numerics import QuantFormat, dequantize_codes

GGUF_BLOCK = 32
EXACT_TYPES = ("Q4_0", "Q4_1", "Q8_0")
FLOAT_TYPES = ("F32", "F16", "BF16", "F64")
PERMUTED_ARCHITECTURES = ("llama", "mistral")  # llama.cpp's converter permutes their q/k rows for its rotary layout


@dataclass
class GGUFBlocks:
    """One GGUF tensor as fxllm's stored form: W [out, in] = codes·scales (+ offsets) per block of 32 inputs."""

    type_name: str
    codes: torch.Tensor  # [out, in] int8
    scales: torch.Tensor  # [in / 32, out] float32 holding float16 values
    offsets: torch.Tensor | None  # [in / 32, out] or None

    @property
    def fmt(self) -> QuantFormat:
        return QuantFormat(8 if self.type_name == "Q8_0" else 4, GGUF_BLOCK, symmetric=self.offsets is None)

    def dequantize(self) -> torch.Tensor:
        return dequantize_codes(self.codes, self.scales, self.fmt, self.offsets)

    def permute_rows(self, order: torch.Tensor) -> GGUFBlocks:
        offsets = None if self.offsets is None else self.offsets[:, order]
        return GGUFBlocks(self.type_name, self.codes[order], self.scales[:, order], offsets)

    def with_offsets(self) -> GGUFBlocks:
        """The same values in the asymmetric form (zero offsets for a symmetric type): a Q4_0 tensor fused with
        Q4_1 ones. Exact: d·c + 0 is d·c."""
        if self.offsets is not None:
            return self
        return GGUFBlocks(self.type_name, self.codes, self.scales, torch.zeros_like(self.scales))


@dataclass
class Fallback:
    """A weight whose GGUF tensors were not kept as blocks: the model computes with transformers' float32 copy
    (the same values, dequantized exactly, stored four bytes a weight). `reason` groups the compile's warning."""

    weight: str  # transformers' parameter name (diagnostics key)
    tensors: list[str]  # the GGUF tensors behind it
    type_name: str  # their GGUF type(s), '+'-joined when they differ
    reason: str  # a key of the quantize pass's FALLBACK_REASONS
    label: str = ""  # what the warning names as an example (default: the weight)


def shared_form(types: list[str | None]) -> str | None:
    """The one block form the parts of a fused weight (GGUF types, in order) can be kept as: their common type, or
    Q4_1 for Q4_0 and Q4_1 parts (Q4_0 parts get zero offsets, `GGUFBlocks.with_offsets`); None when a part has no
    exact form or the parts mix 8-bit and 4-bit blocks."""
    kinds = set(types)
    if not kinds <= set(EXACT_TYPES):
        return None
    if len(kinds) == 1:
        return types[0]
    return "Q4_1" if kinds == {"Q4_0", "Q4_1"} else None


def stack_experts(parts: list[GGUFBlocks], experts: int) -> GGUFBlocks:
    """The blocks of one MoE weight's parts (each [E·out_p, in], e.g. the gate then the up projections of every
    expert, one shared form) as one [Σout_p, E·in] weight: each expert's inputs one after another, as
    fxllm::dequantize_experts stores them (codes [E·in, out] once transposed; blocks never straddle two experts)."""
    form = shared_form([p.type_name for p in parts])
    if form is None:
        raise ValueError(f"GGUF expert parts of types {[p.type_name for p in parts]} share no block form")
    if form == "Q4_1":
        parts = [p.with_offsets() for p in parts]

    def joined(values: list[torch.Tensor], rows_first: bool) -> torch.Tensor:
        if rows_first:  # codes [E·out_p, in] → [out, E·in]
            stacked = torch.cat([v.reshape(experts, -1, v.shape[1]) for v in values], 1)  # [E, out, in]
            return stacked.permute(1, 0, 2).reshape(stacked.shape[1], -1)
        stacked = torch.cat([v.reshape(v.shape[0], experts, -1) for v in values], 2)  # [in/32, E, out]
        return stacked.permute(1, 0, 2).reshape(-1, stacked.shape[2])

    offsets = None if parts[0].offsets is None else joined([p.offsets for p in parts], False)
    return GGUFBlocks(form, joined([p.codes for p in parts], True), joined([p.scales for p in parts], False),
                      offsets)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """[blocks, 16] bytes → [blocks, 32] values: element i in the low nibble of byte i, element 16+i in the high."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=1)


def decode_blocks(type_name: str, raw: np.ndarray, out_features: int, in_features: int) -> GGUFBlocks:
    """Raw GGUF bytes of one [out, in] tensor of an EXACT_TYPES type → GGUFBlocks."""
    blocks = np.ascontiguousarray(raw).reshape(out_features * in_features // GGUF_BLOCK, -1)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)[:, 0]
    offsets = None
    if type_name == "Q8_0":
        codes = blocks[:, 2:].copy().view(np.int8)
    elif type_name == "Q4_0":
        codes = _nibbles(blocks[:, 2:]).astype(np.int8) - 8
    elif type_name == "Q4_1":
        m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)[:, 0]
        codes = _nibbles(blocks[:, 4:]).astype(np.int8) - 8
        offsets = m + np.float32(8) * d  # d·q + m = d·(q − 8) + (m + 8d)
    else:
        raise ValueError(f"GGUF type {type_name} has no exact form")

    def per_block(values: np.ndarray) -> torch.Tensor:  # [blocks] → [in / 32, out]
        return torch.from_numpy(values.reshape(out_features, -1).T.copy())

    return GGUFBlocks(type_name, torch.from_numpy(codes.reshape(out_features, in_features).copy()), per_block(d),
                      None if offsets is None else per_block(offsets))


def _reverse_permutation(rows: int, heads: int) -> torch.Tensor:
    """The row order transformers applies to a llama-family q/k weight read from GGUF (undoing llama.cpp's
    converter), as an index: permuted[i] = original[order[i]]."""
    dim = rows // heads // 2
    return torch.arange(rows).reshape(heads, dim, 2).transpose(1, 2).reshape(rows)


class GGUFWeights:
    """The quantized tensors of one GGUF file, looked up by the Hugging Face parameter name transformers gives them."""

    def __init__(self, path: str | Path, num_layers: int):
        import gguf

        self.path = Path(path)
        self.reader = gguf.GGUFReader(self.path)
        field = self.reader.fields["general.architecture"]
        self.architecture = bytes(field.parts[field.data[0]]).decode()
        arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == self.architecture)
        self.names = gguf.get_tensor_name_map(arch, num_layers)
        self.tensors = {t.name: t for t in self.reader.tensors}

    def gguf_name(self, hf_name: str) -> str | None:
        """'model.layers.0.self_attn.q_proj.weight' (any leading module prefixes, e.g. a capture wrapper's
        'model.') → 'blk.0.attn_q.weight'."""
        parts = hf_name.removesuffix(".weight").split(".")
        base = next((found for i in range(len(parts)) if (found := self.names.get_name(".".join(parts[i:])))), None)
        if base is None and parts[-1] == "lm_head":  # some name maps have no output tensor (Gemma 2: always tied)
            base = "output"
        if base is None:
            return None
        if base == "output" and "output.weight" not in self.tensors:  # tied: the lm_head is the token embedding
            base = "token_embd"
        return base + ".weight"

    def type_of(self, hf_name: str) -> str | None:
        name = self.gguf_name(hf_name)
        return self.tensors[name].tensor_type.name if name in self.tensors else None

    def sizes(self, gguf_names: list[str]) -> tuple[int, int]:
        """(bytes the file stores these tensors in, bytes of their float32 copies)."""
        tensors = [self.tensors[name] for name in gguf_names if name in self.tensors]
        return sum(int(t.n_bytes) for t in tensors), sum(4 * int(t.n_elements) for t in tensors)

    def blocks(self, hf_name: str, reference: torch.Tensor, num_heads: int, num_kv_heads: int) -> GGUFBlocks:
        """The stored blocks of the tensor behind `hf_name`, in transformers' row order, checked to dequantize to
        `reference` (the float weight [out, in] the model was loaded with); raises ValueError otherwise."""
        name = self.gguf_name(hf_name)
        tensor = self.tensors[name]
        out_features, in_features = reference.shape
        blocks = decode_blocks(tensor.tensor_type.name, np.asarray(tensor.data), out_features, in_features)
        candidates = [blocks]
        if self.architecture in PERMUTED_ARCHITECTURES and (".attn_q." in name or ".attn_k." in name):
            heads = num_heads if ".attn_q." in name else num_kv_heads
            candidates.insert(0, blocks.permute_rows(_reverse_permutation(out_features, heads)))
        for candidate in candidates:
            if torch.allclose(candidate.dequantize(), reference, rtol=1e-6, atol=1e-7):
                return candidate
        raise ValueError(f"GGUF tensor '{name}' ({tensor.tensor_type.name}) does not reproduce the weight "
                         f"'{hf_name}' transformers loaded from it")
