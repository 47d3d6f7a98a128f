"""Draft proposals for speculative decoding, one sequence at a time: prompt lookup (ngram, no model) or a draft
model on its own KV cache.

A draft model keeps one contiguous KV cache per sequence (batch 1), whichever cache the target uses: the draft is
compiled through the default (contiguous) pipeline, and its cache is private to the speculator, so neither the
target's block pool nor its prefix cache ever holds draft KV. The cache is reused as far as the tokens it was fed
agree with the sequence: each proposal cuts it back to that common prefix (after a verification: the accepted
drafts; after proposals that were never verified, say of a preempted request: the tokens before them), feeds the
sequence's tokens from there (its whole prompt the first time), then its own proposals: one call each, or all k in
one call through the draft's unrolled graph (runtime/unrolled_draft.py) when the engine loaded it
(load_draft_model: which of the two, and with which activations).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from fxllm.errors import ArtifactError, InvalidArgumentError
from fxllm.runtime.backend_ort import default_providers

from fxllm.runtime.kv_cache import ContiguousKVCache
from fxllm.runtime.manifest import Manifest, load_manifest
from fxllm.runtime.model_runner import ModelRunner
from fxllm.runtime.request import SamplingParams
from fxllm.runtime.speculative import NgramProposer, one_hot_probs, processed_probs, sample
from fxllm.runtime.unrolled_draft import UnrolledDraft

if TYPE_CHECKING:
    from fxllm.runtime.engine import Engine


class Drafter:
    def __init__(self, mode: str, k: int, vocab_size: int, model: ModelRunner | UnrolledDraft | None):
        """mode "ngram" proposes by prompt lookup (model None); any other mode runs the draft model: its runner,
        one call per draft token, or its k-step graph (k equal to this k), one call per proposal."""
        self.mode = mode
        self.vocab_size = vocab_size
        self.runner = model if isinstance(model, ModelRunner) else None
        self.unrolled = model if isinstance(model, UnrolledDraft) else None
        self.ngram = NgramProposer(k=k) if mode == "ngram" else None
        self._caches: dict[int, tuple[ContiguousKVCache, list[int]]] = {}  # sequence id → (KV cache, tokens fed)

    def propose(self, seq_id: int, tokens: list[int], k: int, params: SamplingParams,
                rng: np.random.Generator) -> tuple[list[int], np.ndarray | None]:
        """Up to k draft tokens continuing `tokens`, and the distributions they were drawn from ([n, V], processed
        as the target's will be; one-hot for ngram); None instead of distributions when greedy."""
        if k <= 0 or self.unrolled is not None and not self.unrolled.fits(len(tokens)):  # (the context's end)
            return [], None if params.greedy else np.zeros((0, self.vocab_size))
        if self.ngram is not None:
            proposals = self.ngram.propose(tokens)[:k]
            return proposals, None if params.greedy else one_hot_probs(proposals, self.vocab_size)
        if seq_id not in self._caches:
            self._caches[seq_id] = ((self.unrolled or self.runner).new_cache(), [])
        cache, fed = self._caches[seq_id]
        keep = min(_common_prefix(fed, tokens), len(tokens) - 1)  # feed at least one token: its logits propose
        cache.truncate(keep)
        del fed[keep:]
        feed = tokens[keep:]
        if self.unrolled is not None:  # all k in one call; a budget below k keeps the first ones
            proposals, probs = self.unrolled.propose(cache, feed, params, rng)
            fed += feed + proposals[:-1]
            return proposals[:k], None if probs is None else probs[:k]
        proposals, distributions = [], []
        for _ in range(k):
            fed += feed
            logits = self.runner.step_one(cache, feed, cache.length, all_logits=False)[-1]
            if params.greedy:
                token = int(logits.argmax())
            else:
                probs = processed_probs(logits, params.temperature, params.top_k, params.top_p, params.min_p)
                token = sample(probs, rng)
                distributions.append(probs)
            proposals.append(token)
            feed = [token]
        return proposals, None if params.greedy else np.stack(distributions)

    def release(self, seq_id: int) -> None:
        self._caches.pop(seq_id, None)


def load_draft_model(directory: Path, k: int, unrolled: bool | None, vocab_size: int,
                     **options) -> Engine | UnrolledDraft:
    """The draft artifact at `directory` for a target of `vocab_size` token ids: its unrolled k-step graph, or an
    Engine of its own (Engine.load's unrolled_draft and int8_activations say which; `options` are Engine.load's).
    A draft the speculator cannot run is an ArtifactError here, before its model loads (check_draft)."""
    from fxllm.runtime.engine import Engine

    manifest = load_manifest(directory, verify=options["verify"])
    check_draft(manifest, vocab_size)
    int8 = options["int8_activations"]
    if unrolled is None:
        unrolled = "CUDAExecutionProvider" in (options["providers"] or default_providers()) and not int8
    if int8 is None:  # a draft's numerics never reach the output (verification is exact): its fastest form
        options["int8_activations"] = int8 = "quantized" in manifest.facts and not unrolled
    if unrolled:
        graph, refuse = manifest.unrolled_draft, "unrolled_draft=True cannot be used: "
        if graph is None or graph.k != k:
            raise InvalidArgumentError("unrolled_draft", f"{refuse}the draft has no unrolled graph for k={k} (it has "
                                       f"{graph.k if graph else 'none'}: compiled for another k, or before fxllm "
                                       "wrote them)")
        if int8:
            raise InvalidArgumentError("unrolled_draft", f"{refuse}int8 activations: ONNX Runtime does not fuse the "
                                       "unrolled graph's shared int4 weights")
        return UnrolledDraft.load(manifest, options["threads"], options["providers"], int8)
    return Engine.load(directory, spin=False, **options)


def check_draft(manifest: Manifest, vocab_size: int) -> None:
    """A draft artifact the Drafter can run for this target: a contiguous KV cache (it keeps one private cache per
    sequence) and the target's token ids (it is fed the target's tokens, and its proposals and their distributions
    are verified against the target's). The compiler only writes such drafts; a draft directory swapped for another
    artifact loaded, then failed every generation inside ONNX Runtime."""
    directory = manifest.directory
    if manifest.io.paged:
        raise ArtifactError(f"the speculative draft '{directory}' has a paged KV cache; a draft must be compiled "
                            "without the `paged` pass (recompile the artifact with --draft)")
    if manifest.spec.vocab_size != vocab_size:
        raise ArtifactError(f"the speculative draft '{directory}' has {manifest.spec.vocab_size} token ids and the "
                            f"target {vocab_size}; a draft must share the target's vocabulary (recompile the "
                            "artifact with --draft)")


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(np.asarray(a[:n], dtype=np.int64) != np.asarray(b[:n], dtype=np.int64))
    return int(differ[0]) if differ.size else n
