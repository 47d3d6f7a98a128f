"""ModelSpec: the facts about a model that passes, lowering and the runtime need, independent of transformers."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class ModelSpec:
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
    source_num_kv_heads: int | None = None  # set when a pass changed the KV heads (gqa conversion)

    def kv_bytes_per_token(self, bytes_per_element: int = 4) -> int:
        """Bytes of K and V cache one token occupies across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * bytes_per_element

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelSpec:
        return cls(**data)
