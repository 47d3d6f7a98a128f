"""A draft model's k proposals in one call: the draft artifact's unrolled graph (compiler/targets/unrolled_draft.py,
calling convention runtime/contract.py UnrolledDraftIO) on one sequence's contiguous cache.

Token i of a call is argmax(logits_i / temperature + g_i) with g_i standard Gumbel noise drawn here from the
request's stream: exactly a sample from softmax(logits_i / temperature) (the Gumbel-max trick), and the logits come
back, so the verification rule gets the distribution each proposal was actually drawn from. Top-k and top-p are not
applied inside the graph: the draft then samples from the untruncated tempered distribution, which the rule accepts
as any other q (lossless; only the acceptance rate can drop). Greedy requests feed zero noise (plain argmax).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fxllm.errors import ArtifactError
from fxllm.runtime.backend import Backend
from fxllm.runtime.contract import (ATTENTION_MASK, CONTRACT_METADATA_KEY, DRAFT_INV_TEMPERATURE, DRAFT_LOGITS,
                                    DRAFT_NOISE, DRAFT_TOKENS, INPUT_IDS, LOGITS_INDEX, POSITION_IDS, UnrolledDraftIO,
                                    contract_digest, signature_mismatch)
from fxllm.runtime.kv_cache import ContiguousKVCache, new_contiguous_cache
from fxllm.runtime.manifest import Manifest
from fxllm.runtime.request import SamplingParams
from fxllm.runtime.speculative import processed_probs


class UnrolledDraft:
    def __init__(self, backend: Backend, manifest: Manifest):
        self.backend = backend
        self.io = manifest.io  # the one-step graph's: the cache layout
        self.spec = manifest.spec
        self.k = manifest.unrolled_draft.k
        self.max_context = manifest.spec.max_positions
        self._zero_noise = np.zeros((1, self.k, self.spec.vocab_size), np.float32)

    @classmethod
    def load(cls, manifest: Manifest, threads: int | None = None, providers: list[str] | None = None,
             int8_activations: bool = False) -> UnrolledDraft:
        """The unrolled graph of a draft artifact on ONNX Runtime, checked against its contract before use."""
        from fxllm.runtime.backend_ort import OrtBackend

        unrolled = manifest.unrolled_draft
        backend = OrtBackend(unrolled.model_file, threads=threads, providers=providers,
                             int8_activations=int8_activations, spin=False, aliases=manifest.io.aliases)
        io = UnrolledDraftIO.of(manifest.io, unrolled.k)
        problem = signature_mismatch(io, backend.input_signature(), backend.output_signature())
        if problem is None and backend.metadata().get(CONTRACT_METADATA_KEY) != contract_digest(
                manifest.data["spec"], list(io.inputs), list(io.outputs)):
            problem = "it was built for another model spec or signature"
        if problem is not None:
            raise ArtifactError(f"'{Path(unrolled.model_file).name}' does not match the draft's manifest: {problem}; "
                                "recompile the artifact")
        return cls(backend, manifest)

    def new_cache(self) -> ContiguousKVCache:
        return new_contiguous_cache(self.io, self.spec, self.backend)

    def fits(self, length: int) -> bool:
        """Whether a call after `length` tokens stays inside the draft's context (its k-1 drafts are fed)."""
        return length + self.k - 1 <= self.max_context

    def propose(self, cache: ContiguousKVCache, feed: list[int], params: SamplingParams,
                rng: np.random.Generator) -> tuple[list[int], np.ndarray | None]:
        """Feed `feed` after the cache's tokens, then k-1 of its own drafts: → the k draft tokens and their
        distributions ([k, V], None when greedy). The cache ends holding feed and the first k-1 drafts."""
        start, count = cache.length, len(feed)
        total = start + count
        if hasattr(cache, "reserve"):
            cache.reserve(total + self.k - 1)
        feeds = {INPUT_IDS: np.asarray([feed], dtype=np.int64),
                 POSITION_IDS: np.arange(start, total, dtype=np.int64)[None],
                 ATTENTION_MASK: np.ones((1, total), dtype=np.int64), **cache.feeds()}
        if self.io.selects_logits:
            feeds[LOGITS_INDEX] = np.asarray([count - 1], dtype=np.int64)
        if params.greedy:
            feeds[DRAFT_NOISE], feeds[DRAFT_INV_TEMPERATURE] = self._zero_noise, np.ones(1, np.float32)
        else:
            exponential = rng.standard_exponential(self._zero_noise.shape, dtype=np.float32)
            feeds[DRAFT_NOISE] = -np.log(np.maximum(exponential, np.finfo(np.float32).tiny))  # Gumbel(0, 1)
            feeds[DRAFT_INV_TEMPERATURE] = np.asarray([1.0 / params.temperature], np.float32)
        outputs = self.backend.run(feeds)
        cache.update(outputs)
        tokens = outputs[DRAFT_TOKENS][0].tolist()
        if params.greedy:
            return tokens, None
        return tokens, processed_probs(outputs[DRAFT_LOGITS][0], params.temperature)
