"""The artifact contract between the compiler (which writes it) and the runtime (which reads it), torch-free.

It names everything both sides must agree on: the format version and marker, the model spec, tensor signatures,
the graph's I/O names and their roles (inputs, outputs, per-layer caches of either cache kind), and limits such as
the largest speculative k. Nothing else in the project spells an I/O name out.

Cache kinds and their per-layer tensors (`kind` is "key" or "value"):
  contiguous: inputs past_{kind}_{layer} [batch, kv_heads, past, head_dim],
              outputs present_{kind}_{layer} [batch, kv_heads, total, head_dim] (past followed by this step's)
  paged:      inputs {kind}_cache_{layer} [blocks, block_size, kv_heads, head_dim] (the pool),
              outputs new_{kind}_{layer} [batch, kv_heads, tokens, head_dim] (this step's, written by the runtime)
A contiguous cache whose past inputs name dim 2 `capacity` (KV_CAPACITY) is a shared buffer (the ort target's
GroupQueryAttention lowering): past_{kind}_{layer} [batch, kv_heads, capacity, head_dim] holds the past in rows
[0, total - tokens), total = attention_mask's length; the step writes its rows [total - tokens, total) in place and
present_{kind}_{layer} is that same buffer, which the caller binds to the same memory (ModelIO.aliases).
Rows of different lengths are left-padded there (the graph masks the padding). Named `capacity_per_row`
(KV_CAPACITY_PER_ROW) instead, every row's own tokens start at buffer row 0 (ModelIO.right_padded): the caller
right-pads, attention_mask row b is 1 on exactly its first n_b columns (n_b: the row's past + new tokens), and a
step writes row b's new tokens at rows [n_b − tokens, n_b); the graph reads each row's length from the mask and
needs no padding mask (GroupQueryAttention's own per-row lengths).
A paged pool whose inputs are [1, kv_heads, pool_slots_b{block_size}, head_dim] is head-major (the ort target's
paged-run lowering): the runtime stores the pool as [2·layers, kv_heads, slots, head_dim] (one head of padding
after it) and feeds each layer the C-contiguous view of that shape starting at the first block the batch reads
(`first`), its block tables counted from `first`. A step of one row whose table is then 0, 1, ..., n - 1 (its
blocks one ascending run: `is_block_run`) attends in the view itself, writing its K/V at rows
context_lens + t: the caller binds new_{kind}_{layer} to the same memory as {kind}_cache_{layer} and writes
nothing. Any other step gathers the blocks and returns its K/V as new_{kind}_{layer} [batch, kv_heads, tokens,
head_dim], as the block-major pool does.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any

FORMAT_VERSION = 1
ARTIFACT_KIND = "fxllm-artifact"  # the manifest's "kind": marks a directory fxllm wrote (and may replace)
MANIFEST_FILE = "manifest.json"
MAX_SPEC_K = 16  # most draft tokens verified per speculative step
TARGETS = ("ort", "tensorrt", "torch")  # torch: a torch.export program (model.pt2) run by backend "torch"
# The float dtypes each target can compile to (--dtype): ONNX Runtime's CPU kernels run the float32 graph only.
TARGET_DTYPES = {"ort": ("float32",), "tensorrt": ("float32", "float16", "bfloat16"),
                 "torch": ("float32", "float16", "bfloat16")}

# Graph inputs and outputs that are not per layer.
INPUT_IDS = "input_ids"  # int64 [batch, tokens]
POSITION_IDS = "position_ids"  # int64 [batch, tokens]
ATTENTION_MASK = "attention_mask"  # int64 [batch, total] (contiguous cache)
LOGITS_INDEX = "logits_index"  # int64 [select] (select-logits)
BLOCK_TABLES = "block_tables"  # int64 [batch, table] (paged cache)
CONTEXT_LENS = "context_lens"  # int64 [batch] (paged cache)
LOGITS = "logits"  # float32 [batch, select or tokens, vocab]
INTEGER_INPUTS = frozenset({INPUT_IDS, POSITION_IDS, ATTENTION_MASK, LOGITS_INDEX, BLOCK_TABLES, CONTEXT_LENS})
RANKS = {INPUT_IDS: 2, POSITION_IDS: 2, ATTENTION_MASK: 2, LOGITS_INDEX: 1, BLOCK_TABLES: 2, CONTEXT_LENS: 1, LOGITS: 3}
INTEGER_DTYPES = ("int64",)
FLOAT_DTYPES = ("float32", "float16", "bfloat16")  # logits and KV caches
# A contiguous cache may also hold int8 codes (`--kv-cache-dtype int8`, target ort: GroupQueryAttention's quantized
# cache, its per-channel scales constants of the graph); a paged pool stays float.
CONTIGUOUS_CACHE_DTYPES = (*FLOAT_DTYPES, "int8")
KV_CACHE_DTYPES = ("auto", "int8")  # compile_model's kv_cache_dtype: "auto" keeps the model's dtype

CONTIGUOUS, PAGED = "contiguous", "paged"
KV_CAPACITY = "capacity"  # dim 2 of a shared-buffer contiguous cache (see the module docstring)
KV_CAPACITY_PER_ROW = "capacity_per_row"  # the same, each row's tokens from buffer row 0 (right-padded rows)
_POOL_SLOTS = re.compile(r"^pool_slots_b([1-9][0-9]*)$")  # dim 2 of a head-major paged pool (the module docstring)
CACHE_KINDS = ("key", "value")
_CACHE_NAMES = {  # cache kind → (input pattern, output pattern)
    CONTIGUOUS: ("past_{kind}_{layer}", "present_{kind}_{layer}"),
    PAGED: ("{kind}_cache_{layer}", "new_{kind}_{layer}"),
}
_CACHE_NAME = re.compile(r"^(?:(past|present|new)_(key|value)_|(key|value)_cache_)(0|[1-9][0-9]*)$")


def brief(names: list[str], limit: int = 4) -> str:
    """The first `limit` names joined with ", ", then how many more: a list of a model's 120 cache tensors keeps an
    error message one readable line."""
    shown = ", ".join(names[:limit])
    return shown if len(names) <= limit else f"{shown} and {len(names) - limit} more"


@functools.cache
def cache_input(cache: str, kind: str, layer: int) -> str:
    """Name of layer `layer`'s K or V cache input: past_key_3 (contiguous), key_cache_3 (paged)."""
    return _CACHE_NAMES[cache][0].format(kind=kind, layer=layer)


@functools.cache
def cache_output(cache: str, kind: str, layer: int) -> str:
    """Name of layer `layer`'s K or V cache output: present_key_3 (contiguous), new_key_3 (paged)."""
    return _CACHE_NAMES[cache][1].format(kind=kind, layer=layer)


@dataclass(frozen=True)
class CacheTensor:
    """What a per-layer cache name means: its cache kind, whether it is a graph input, K or V, and the layer."""

    cache: str
    is_input: bool
    kind: str
    layer: int


def parse_cache_name(name: str) -> CacheTensor | None:
    """The role of a per-layer cache tensor name, or None for any other name."""
    match = _CACHE_NAME.match(name)
    if match is None:
        return None
    prefix, kind, pool_kind, layer = match.groups()
    if pool_kind is not None:
        return CacheTensor(PAGED, True, pool_kind, int(layer))
    cache = PAGED if prefix == "new" else CONTIGUOUS
    return CacheTensor(cache, prefix == "past", kind, int(layer))


def head_major_pool_dims(block_size: int, kv_heads: int, head_dim: int) -> tuple[int | str, ...]:
    """The dims of a head-major paged pool input (see the module docstring)."""
    return (1, kv_heads, f"pool_slots_b{block_size}", head_dim)


def is_block_run(tables: list[list[int]]) -> bool:
    """A step the head-major pool runs in place: one row whose table, counted from its first block, is 0..n-1."""
    return len(tables) == 1 and all(block == index for index, block in enumerate(tables[0]))


@dataclass(frozen=True)
class TensorSig:
    """One graph input or output: dims are ints or symbolic names shared across tensors (batch, tokens, past...)."""

    name: str
    dims: tuple[int | str, ...]
    dtype: str

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "dims": list(self.dims), "dtype": self.dtype}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TensorSig:
        return cls(data["name"], tuple(data["dims"]), data["dtype"])


@dataclass
class ModelSpec:
    """The facts about a model that passes, lowering and the runtime need, independent of transformers."""

    architecture: str
    model_type: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_positions: int
    rope: dict[str, Any] = field(default_factory=dict)
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    pad_token_id: int | None = None
    dtype: str = "float32"
    notes: list[str] = field(default_factory=list)
    kv_cache_dtype: str = ""  # the cache's element type when it is not `dtype` ("int8": --kv-cache-dtype int8)
    source_num_kv_heads: int | None = None  # set when a pass changed the KV heads (gqa conversion)
    # Per layer: how many keys a query sees (itself included) under a sliding window, 0 for full attention; empty
    # when no layer slides. The paged runtime releases blocks no layer can see any more when every layer slides.
    sliding_windows: list[int] = field(default_factory=list)
    # Per layer, for people (`fxllm inspect`): attention variant, position encoding, QK-norm, MoE shape.
    layers: list[dict[str, Any]] = field(default_factory=list)

    @property
    def attention_span(self) -> int:
        """Keys any layer's query can see: the largest sliding window when every layer slides, else 0 (the whole
        context)."""
        return max(self.sliding_windows) if self.sliding_windows and all(self.sliding_windows) else 0

    def kv_bytes_per_token(self, bytes_per_element: int | None = None) -> int:
        """Bytes of K and V cache one token occupies across all layers (elements of the model's dtype unless
        bytes_per_element is given)."""
        size = bytes_per_element or {"int8": 1, "float16": 2, "bfloat16": 2}.get(self.kv_cache_dtype or self.dtype, 4)
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * size

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelSpec:
        return cls(**data)


@dataclass(frozen=True)
class ModelIO:
    """The calling convention of an artifact's graph, read from its signature: which cache kind it uses, how many
    layers, the paged block size, and whether the caller chooses the positions whose logits are computed."""

    inputs: tuple[TensorSig, ...]
    outputs: tuple[TensorSig, ...]
    cache: str  # CONTIGUOUS or PAGED
    num_layers: int
    block_size: int | None  # paged only
    selects_logits: bool
    head_major_pool: bool = False  # paged: the pool is fed as head-major views (see the module docstring)

    @classmethod
    def from_signature(cls, inputs: list[TensorSig], outputs: list[TensorSig]) -> ModelIO:
        """Derive the roles from the names; raises ValueError when the signature is not a complete calling
        convention (the manifest reader turns that into an ArtifactError)."""
        input_names = [sig.name for sig in inputs]
        output_names = [sig.name for sig in outputs]
        caches = [(sig, parse_cache_name(sig.name)) for sig in inputs]
        kinds = {role.cache for _, role in caches if role is not None}
        if len(kinds) != 1:
            raise ValueError("the inputs hold no KV cache" if not kinds else "the inputs mix contiguous and paged caches")
        cache = kinds.pop()
        layers = sum(1 for _, role in caches if role is not None and role.kind == "key")
        expected_inputs = {INPUT_IDS, POSITION_IDS}
        expected_inputs |= {BLOCK_TABLES, CONTEXT_LENS} if cache == PAGED else {ATTENTION_MASK}
        expected_inputs |= {cache_input(cache, kind, i) for kind in CACHE_KINDS for i in range(layers)}
        optional_inputs = {LOGITS_INDEX}
        expected_outputs = {LOGITS} | {cache_output(cache, kind, i) for kind in CACHE_KINDS for i in range(layers)}
        missing = sorted(expected_inputs - set(input_names)) + sorted(expected_outputs - set(output_names))
        unknown = sorted(set(input_names) - expected_inputs - optional_inputs) + \
            sorted(set(output_names) - expected_outputs)
        problems = [f"missing {brief(missing)}"] if missing else []
        problems += [f"unknown {brief(unknown)}"] if unknown else []
        problems += ["a repeated input name"] if len(set(input_names)) != len(input_names) else []
        problems += [f"outputs that do not start with '{LOGITS}'"] if output_names[:1] != [LOGITS] else []
        wrong: dict[str, list[str]] = {}  # one problem per kind of mistake, naming the tensors that make it
        for sig in (*inputs, *outputs):
            role = parse_cache_name(sig.name)
            wanted = INTEGER_DTYPES if sig.name in INTEGER_INPUTS else \
                CONTIGUOUS_CACHE_DTYPES if role is not None and role.cache == CONTIGUOUS else FLOAT_DTYPES
            if sig.dtype not in wanted:
                wrong.setdefault(f"of dtype {sig.dtype} (expected {' or '.join(wanted)})", []).append(sig.name)
            rank = RANKS.get(sig.name, 4 if role else None)
            if rank is not None and len(sig.dims) != rank:
                wrong.setdefault(f"of rank {len(sig.dims)} (expected {rank})", []).append(sig.name)
        problems += [f"{brief([repr(name) for name in names])} {what}" for what, names in wrong.items()]
        if problems:
            raise ValueError(f"the signature is not a {cache}-cache calling convention: {'; '.join(problems)}")
        block_size, head_major = None, False
        if cache == PAGED:
            pools = [sig for sig in inputs if parse_cache_name(sig.name) is not None]
            pool = pools[0]
            slots = _POOL_SLOTS.match(pool.dims[2]) if isinstance(pool.dims[2], str) else None
            head_major = slots is not None
            if head_major:
                block_size = int(slots.group(1))
            else:
                block_size = pool.dims[1] if isinstance(pool.dims[1], int) else None
            if block_size is None or block_size < 1:
                raise ValueError(f"the paged pool '{pool.name}' has no fixed block size: dims {list(pool.dims)}")
            if any(sig.dims != pool.dims for sig in pools):
                raise ValueError(f"the paged pools differ in shape ('{pool.name}' has dims {list(pool.dims)})")
        return cls(tuple(inputs), tuple(outputs), cache, layers, block_size, LOGITS_INDEX in input_names, head_major)

    @property
    def paged(self) -> bool:
        return self.cache == PAGED

    @property
    def kv_heads_and_dim(self) -> tuple[int | str, int | str]:
        """(kv_heads, head_dim) of the caches, read from layer 0's key input in its layout."""
        dims = next(sig for sig in self.inputs if sig.name == cache_input(self.cache, "key", 0)).dims
        return (dims[2], dims[3]) if self.paged and not self.head_major_pool else (dims[1], dims[3])

    @property
    def cache_dtypes(self) -> frozenset[str]:
        """The element types of the cache inputs and outputs: one, unless the signature is inconsistent (the manifest
        reader refuses that)."""
        return frozenset(sig.dtype for sig in (*self.inputs, *self.outputs) if parse_cache_name(sig.name))

    @property
    def shared_buffer(self) -> bool:
        """A contiguous cache the step updates in place: each present output aliases its past input."""
        return self._capacity_dim in (KV_CAPACITY, KV_CAPACITY_PER_ROW)

    @property
    def right_padded(self) -> bool:
        """A shared buffer whose rows each start at buffer row 0: a batch's rows are right-padded (module docstring)."""
        return self._capacity_dim == KV_CAPACITY_PER_ROW

    @functools.cached_property
    def _capacity_dim(self) -> int | str | None:
        """Dim 2 of every contiguous past input when they all name the same one, else None (read once: a decode
        step asks for `right_padded`, and reading 60 signatures took ~75 µs)."""
        if self.cache != CONTIGUOUS:
            return None
        pasts = [sig for sig in self.inputs if (role := parse_cache_name(sig.name)) is not None and role.is_input]
        dims = {sig.dims[2] if len(sig.dims) == 4 else None for sig in pasts}
        return dims.pop() if len(dims) == 1 else None

    @property
    def aliases(self) -> dict[str, str]:
        """{present output: past input} whose memory must be one buffer (shared-buffer caches; else empty)."""
        if not self.shared_buffer:
            return {}
        return {cache_output(CONTIGUOUS, kind, i): cache_input(CONTIGUOUS, kind, i)
                for kind in CACHE_KINDS for i in range(self.num_layers)}

    @property
    def input_names(self) -> list[str]:
        return [sig.name for sig in self.inputs]

    @property
    def output_names(self) -> list[str]:
        return [sig.name for sig in self.outputs]

    def cache_inputs(self, kind: str) -> list[str]:
        """Per-layer cache input names of K or V, layer order."""
        return [cache_input(self.cache, kind, i) for i in range(self.num_layers)]

    def cache_outputs(self, kind: str) -> list[str]:
        """Per-layer cache output names of K or V, layer order."""
        return [cache_output(self.cache, kind, i) for i in range(self.num_layers)]


# A draft artifact's unrolled graph (compiler/targets/unrolled_draft.py): its k steps in one call. Inputs: the one-step
# graph's, whose input_ids/position_ids/attention_mask/logits_index describe the first step, plus these two; step
# i >= 1 feeds step i-1's token at the next position. Token i = argmax(logits_i * inverse temperature + noise[:, i]):
# zero noise is greedy, standard Gumbel noise samples exactly from softmax(logits_i / temperature). Outputs: these
# two, then the cache outputs after the k steps (which have fed the first step's tokens and the first k-1 drafts).
DRAFT_NOISE = "draft_noise"  # float32 [batch, k, vocab]
DRAFT_INV_TEMPERATURE = "draft_inv_temperature"  # float32 [batch]
DRAFT_TOKENS = "draft_tokens"  # int64 [batch, k]
DRAFT_LOGITS = "draft_logits"  # float32 [batch, k, vocab]: the logits each draft token was drawn from


@dataclass(frozen=True)
class UnrolledDraftIO:
    """The calling convention of a draft's unrolled graph, derived from its one-step graph's and k."""

    inputs: tuple[TensorSig, ...]
    outputs: tuple[TensorSig, ...]
    k: int

    @classmethod
    def of(cls, step: ModelIO, k: int) -> UnrolledDraftIO:
        vocab = step.outputs[0].dims[-1]
        inputs = (*step.inputs, TensorSig(DRAFT_NOISE, ("batch", k, vocab), "float32"),
                  TensorSig(DRAFT_INV_TEMPERATURE, ("batch",), "float32"))
        outputs = (TensorSig(DRAFT_TOKENS, ("batch", k), "int64"),
                   TensorSig(DRAFT_LOGITS, ("batch", k, vocab), step.outputs[0].dtype), *step.outputs[1:])
        return cls(inputs, outputs, k)


CONTRACT_METADATA_KEY = "fxllm.contract"  # model.onnx metadata: digest of the spec and signature it was built for


def contract_digest(spec: dict[str, Any], inputs: list[TensorSig], outputs: list[TensorSig]) -> str:
    """sha256 of the spec and signature a model file was lowered for. Lowering stores it in the ONNX metadata and
    the runtime compares it with the manifest's, so a manifest edited after compilation (say, a raised
    max_positions) is refused instead of silently running the model outside what it was built for."""
    document = {"spec": spec, "inputs": [sig.to_dict() for sig in inputs],
                "outputs": [sig.to_dict() for sig in outputs]}
    return hashlib.sha256(json.dumps(document, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def signature_mismatch(io: ModelIO | UnrolledDraftIO, actual_inputs: dict[str, tuple[str, int]],
                       actual_outputs: dict[str, tuple[str, int]]) -> str | None:
    """Compare the manifest's signature with a loaded model's {name: (dtype, rank)}; a description of the first
    difference, or None when they agree."""
    for side, expected, actual in (("input", io.inputs, actual_inputs), ("output", io.outputs, actual_outputs)):
        names = {sig.name for sig in expected}
        if names != set(actual):
            extra, missing = sorted(set(actual) - names), sorted(names - set(actual))
            return (f"the model's {side}s differ from the manifest's (model only: {brief(extra) or 'none'}; "
                    f"manifest only: {brief(missing) or 'none'})")
        for sig in expected:
            dtype, rank = actual[sig.name]
            if (dtype, rank) != (sig.dtype, len(sig.dims)):
                return (f"{side} '{sig.name}' is {dtype} of rank {rank} in the model but {sig.dtype} of rank "
                        f"{len(sig.dims)} in the manifest")
    return None
