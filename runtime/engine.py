"""Engine: a loaded artifact that generates. Batches of prompts are left-padded and decoded through the KV cache."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fxllm.errors import ArtifactError, GenerationError
from fxllm.runtime.contract import (ATTENTION_MASK, CONTRACT_METADATA_KEY, INPUT_IDS, LOGITS, LOGITS_INDEX, MAX_SPEC_K,
                                    POSITION_IDS, contract_digest, signature_mismatch)
from fxllm.runtime.manifest import Manifest, SpeculativePlan, load_manifest
from fxllm.runtime.backend_ort import OrtBackend
from fxllm.runtime.detokenizer import IncrementalDetokenizer
from fxllm.runtime.kv_cache import ContiguousKVCache
from fxllm.runtime.request_validation import (GenerationRequest, check_engine_options, check_kv_pool, check_prompt,
                                              check_prompt_ids, check_prompts, check_request)
from fxllm.runtime.sampler import Sampler, SamplingParams
from fxllm.runtime.tokenizer import load_tokenizer


@dataclass
class GenerationResult:
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = "length"  # "eos" | "stop" | "length" | "context"
    timings: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt": self.prompt,
            "token_ids": self.token_ids,
            "text": self.text,
            "finish_reason": self.finish_reason,
            "timings": self.timings,
        }


@dataclass
class _Sequence:
    result: GenerationResult
    detokenizer: IncrementalDetokenizer
    done: bool = False


class Engine:
    def __init__(self, directory: Path, manifest: Manifest, backend, tokenizer):
        self.directory = directory
        self.manifest = manifest
        self.backend = backend
        self.tokenizer = tokenizer
        self.spec = manifest.spec
        self.io = manifest.io
        self.paged = manifest.io.paged
        self.num_layers = manifest.io.num_layers
        self.selects_logits = manifest.io.selects_logits
        self.eos_token_ids = set(self.spec.eos_token_ids)
        if tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(tokenizer.eos_token_id)
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.last_timings: dict[str, float] = {}
        self.last_metrics: dict[str, Any] = {}  # paged artifacts: blocks, waste, prefix hits, preemptions...
        self.kv_cache_memory: int | str | None = None
        self.kv_blocks: int | None = None
        self.max_batch = 64
        self.max_tokens_per_step = 512
        self.prefix_caching = True
        self._batcher = None
        self.speculator = None  # a SpeculativeDecoder when the artifact holds a draft

    @classmethod
    def load(cls, path: str | os.PathLike, threads: int | None = None, providers: list[str] | None = None,
             verify: bool = True, backend: str = "onnxruntime", kv_cache_memory: int | str | None = None,
             kv_blocks: int | None = None, max_batch: int = 64, max_tokens_per_step: int = 512,
             prefix_caching: bool = True, int8_activations: bool | None = None, speculative: bool = True,
             spec_k: int | None = None, spin: bool = True) -> Engine:
        """backend: "onnxruntime" (any artifact, any machine) or "tensorrt" (an artifact with engine.plan).
        Paged artifacts: the KV pool holds `kv_blocks` blocks, or as many as fit in `kv_cache_memory` bytes (e.g.
        "256MB"; default 512 MiB, at least one full-context sequence); `max_batch` requests run at once and a
        step computes at most `max_tokens_per_step` tokens; `prefix_caching` shares full KV blocks between requests
        with a common prompt prefix. int8_activations: let ONNX Runtime's quantized matmuls quantize activations to
        int8 (faster, slightly less exact); default: what the artifact recommends (on for quantized artifacts).
        Artifacts compiled with a draft decode speculatively unless speculative=False; spec_k overrides their k.
        spin=False stops ONNX Runtime's idle threads from spinning (set for speculative target/draft pairs)."""
        check_engine_options(threads, kv_blocks, kv_cache_memory, max_batch, max_tokens_per_step, spec_k)
        directory = Path(path)
        manifest = load_manifest(directory, verify=verify)
        if backend == "onnxruntime":
            recommended = manifest.int8_activations
            # Target and draft sessions alternate on the same cores: threads spinning after one session's call
            # would slow the other's (measured: a 5-token verify 105 ms alternating vs 41 ms without spinning).
            runner = OrtBackend(manifest.model_file, threads=threads, providers=providers,
                                int8_activations=recommended if int8_activations is None else int8_activations,
                                spin=spin and not (speculative and manifest.speculative))
            _check_model_matches(manifest, runner)
        elif backend == "tensorrt":
            from fxllm.runtime.backend_trt import TrtBackend

            runner = TrtBackend(directory, manifest.data)
        else:
            raise ArtifactError(f"unknown backend '{backend}' (available: onnxruntime, tensorrt)")
        engine = cls(directory, manifest, runner, load_tokenizer(manifest.tokenizer_dir))
        engine.kv_cache_memory, engine.kv_blocks = kv_cache_memory, kv_blocks
        engine.max_batch, engine.max_tokens_per_step = max_batch, max_tokens_per_step
        engine.prefix_caching = prefix_caching
        if engine.paged:
            engine.batcher()  # sizes the pool now, so a bad KV budget fails at load time
        plan = manifest.speculative
        if plan is not None and speculative:
            engine.speculator = engine._speculator(plan, spec_k, threads, providers, verify, int8_activations)
        return engine

    def _speculator(self, plan: SpeculativePlan, spec_k: int | None, threads, providers, verify, int8_activations):
        from fxllm.runtime.speculative_decoder import SpeculativeDecoder

        k = plan.k if spec_k is None else spec_k
        if not 1 <= k <= MAX_SPEC_K:
            raise GenerationError(f"spec_k must be between 1 and {MAX_SPEC_K}, got {k}")
        if self.paged:
            raise ArtifactError("speculative decoding runs on the contiguous KV cache; compile without `paged`")
        draft = None
        if plan.draft is not None:
            draft = Engine.load(plan.draft, threads=threads, providers=providers, verify=verify,
                                int8_activations=int8_activations, spin=False)
        return SpeculativeDecoder(self, draft, plan.mode, k)

    # -- paged KV cache -------------------------------------------------------------------------------------------

    @property
    def block_size(self) -> int:
        return self.io.block_size

    def capacity_tokens(self) -> int:
        """Tokens the KV pool can hold (paged artifacts)."""
        return self.batcher().manager.capacity_tokens

    def batcher(self):
        """The continuous batcher with its block manager and KV pool, created on first use."""
        if self._batcher is None:
            from fxllm.runtime.block_manager import BlockManager
            from fxllm.runtime.paged_cache import PagedKVPool, default_num_blocks, parse_bytes
            from fxllm.runtime.scheduler import ContinuousBatcher

            block_bytes = self.spec.kv_bytes_per_token() * self.block_size
            if self.kv_blocks is not None:
                blocks = self.kv_blocks
            elif self.kv_cache_memory is not None:
                blocks = parse_bytes(self.kv_cache_memory) // block_bytes
            else:
                blocks = default_num_blocks(block_bytes, self.block_size, self.max_context)
            check_kv_pool(int(blocks), block_bytes, self.kv_blocks, self.kv_cache_memory)  # before allocating
            manager = BlockManager(int(blocks), self.block_size, enable_prefix_caching=self.prefix_caching)
            pool = PagedKVPool(self.num_layers, int(blocks), self.block_size, self.spec.num_kv_heads,
                               self.spec.head_dim)
            self._batcher = ContinuousBatcher(self, manager, pool, self.max_batch, self.max_tokens_per_step)
        return self._batcher

    @property
    def max_context(self) -> int:
        return self.spec.max_positions

    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        prompt = check_prompt(prompt)
        if chat:  # the template writes the special tokens itself
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
            return self.tokenizer.encode(text, add_special_tokens=False)
        return self.tokenizer.encode(prompt)

    # -- public API ---------------------------------------------------------------------------------------------

    def generate(self, prompts: str | list[str], max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int | None = None, stop: str | list[str] | None = None,
                 chat: bool = False) -> GenerationResult | list[GenerationResult]:
        """Generate for one prompt (returns one result) or a list of prompts of any lengths (returns a list).
        Every argument is checked first (runtime/request_validation.py): InvalidArgumentError names a bad one."""
        texts, single = check_prompts(prompts)
        request = check_request(max_new_tokens, temperature, top_k, top_p, seed, stop, chat)
        results = self._run([self.encode(t, request.chat) for t in texts], request, texts)
        return results[0] if single else results

    def generate_ids(self, prompt_ids: list[list[int]], max_new_tokens: int = 64, temperature: float = 0.0,
                     top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                     stop: str | list[str] | None = None, prompts: list[str] | None = None) -> list[GenerationResult]:
        """Like generate, from token ids (ints in [0, vocab_size))."""
        return self._run(prompt_ids, check_request(max_new_tokens, temperature, top_k, top_p, seed, stop), prompts)

    def _run(self, prompt_ids, request: GenerationRequest, prompts: list[str] | None) -> list[GenerationResult]:
        sequences = self._new_sequences(check_prompt_ids(prompt_ids, self.spec.vocab_size), request.stop, prompts)
        for _ in self._generate(sequences, request.max_new_tokens, request.sampling):
            pass
        return [seq.result for seq in sequences]

    def stream(self, prompt: str, max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0, seed: int | None = None, stop: str | list[str] | None = None,
               chat: bool = False) -> Iterator[str]:
        """Yield the generated text piece by piece as tokens are decoded. The arguments are checked (and the prompt
        tokenized) when stream() is called, before the first piece is asked for."""
        request = check_request(max_new_tokens, temperature, top_k, top_p, seed, stop, chat)
        ids = check_prompt_ids([self.encode(prompt, request.chat)], self.spec.vocab_size)
        sequences = self._new_sequences(ids, request.stop, [prompt])
        return (delta for _, delta in self._generate(sequences, request.max_new_tokens, request.sampling) if delta)

    def score(self, token_ids: list[int]) -> np.ndarray:
        """Logits [T,V] of every position of one sequence, in a single prefill (used by `fxllm eval`)."""
        token_ids = check_prompt_ids([token_ids], self.spec.vocab_size)[0]
        if not 0 < len(token_ids) <= self.max_context:
            raise GenerationError(f"can score 1 to {self.max_context} tokens at once, got {len(token_ids)}")
        if self.paged:
            return self.batcher().score(token_ids)
        return self.step_one(self.new_cache(), token_ids, 0, all_logits=True)

    def new_cache(self, batch: int = 1) -> ContiguousKVCache:
        return ContiguousKVCache.empty(self.num_layers, batch, self.spec.num_kv_heads, self.spec.head_dim)

    def step_one(self, cache: ContiguousKVCache, token_ids: list[int], start: int, all_logits: bool) -> np.ndarray:
        """One sequence (no padding): feed token_ids after the `start` tokens in `cache`, appending their K/V;
        logits [T, V] of every fed token, or [1, V] of the last unless all_logits."""
        ids = np.asarray([token_ids], dtype=np.int64)
        positions = np.arange(start, start + len(token_ids), dtype=np.int64)[None]
        mask = np.ones((1, start + len(token_ids)), dtype=np.int64)
        return self._step(ids, positions, mask, cache, all_logits=all_logits)[0]

    # -- decoding -----------------------------------------------------------------------------------------------

    def _check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise GenerationError("the prompt is empty after tokenization")
        if len(ids) >= self.max_context:
            raise GenerationError(
                f"the prompt is {len(ids)} tokens; the model's context is {self.max_context} tokens, which leaves "
                "no room to generate"
            )

    def _step(self, input_ids: np.ndarray, position_ids: np.ndarray, attention_mask: np.ndarray,
              cache: ContiguousKVCache, all_logits: bool = False) -> np.ndarray:
        """One forward step; logits [B, T or 1, V]: only the last position's unless all_logits (when the artifact
        was compiled with select-logits; otherwise always all)."""
        feeds = {INPUT_IDS: input_ids, POSITION_IDS: position_ids, ATTENTION_MASK: attention_mask}
        if self.selects_logits:
            tokens = input_ids.shape[1]
            positions = range(tokens) if all_logits else [tokens - 1]
            feeds[LOGITS_INDEX] = np.asarray(positions, dtype=np.int64)
        feeds.update(cache.feeds())
        outputs = self.backend.run(feeds)
        cache.update(outputs)
        return outputs[LOGITS]

    def _new_sequences(self, prompt_ids: list[list[int]], stop: str | list[str] | None,
                       prompts: list[str] | None) -> list[_Sequence]:
        if not prompt_ids:
            raise GenerationError("no prompts given")
        for ids in prompt_ids:
            self._check_prompt(ids)
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        return [
            _Sequence(GenerationResult(prompts[i] if prompts else None, list(ids)),
                      IncrementalDetokenizer(self.tokenizer, stops))
            for i, ids in enumerate(prompt_ids)
        ]

    def _generate(self, sequences: list[_Sequence], max_new_tokens: int,
                  params: SamplingParams) -> Iterator[tuple[int, str]]:
        if max_new_tokens < 1:
            raise GenerationError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if self.speculator is not None:
            start = time.perf_counter()
            yield from self.speculator.run(sequences, max_new_tokens, params)
            stats = self.speculator.stats
            self.last_metrics = {"speculative": self.speculator.mode, "k": self.speculator.k,
                                 "proposed": stats.proposed, "accepted": stats.accepted,
                                 "acceptance_rate": round(stats.acceptance_rate, 4),
                                 "target_calls": stats.target_calls,
                                 "tokens_per_target_call": round(stats.tokens_per_target_call, 3),
                                 "draft_s": round(stats.draft_time_s, 4), "verify_s": round(stats.verify_time_s, 4)}
            wall = time.perf_counter() - start
            generated = sum(len(seq.result.token_ids) for seq in sequences)
            prefill = self.speculator.prefill_s
            self.last_timings = {"wall_ms": round(wall * 1e3, 3), "tokens_per_s": round(generated / wall, 2),
                                 "batch": len(sequences), "prefill_ms": round(prefill * 1e3, 3),
                                 "decode_ms_per_token": round((wall - prefill) * 1e3 / max(generated - 1, 1), 3)}
            self._finish(sequences)
            return
        if not self.paged:
            yield from self._decode(sequences, max_new_tokens, params)
            return
        batcher = self.batcher()
        start = time.perf_counter()
        yield from batcher.run(sequences, max_new_tokens, Sampler(params, len(sequences)))
        metrics = batcher.metrics
        self.last_metrics = metrics.to_dict(batcher.manager)
        self.last_timings = {
            "prefill_ms": round(metrics.prefill_seconds * 1e3, 3),
            "decode_ms_per_token": round(metrics.decode_seconds * 1e3 / metrics.decode_steps, 3)
            if metrics.decode_steps else 0.0,
            "decode_steps": metrics.decode_steps,
            "batch": len(sequences),
            "wall_ms": round((time.perf_counter() - start) * 1e3, 3),
        }
        self._finish(sequences)

    def _decode(self, sequences: list[_Sequence], max_new_tokens: int,
                params: SamplingParams) -> Iterator[tuple[int, str]]:
        """Run the batch to completion, yielding (sequence index, text delta) per generated token."""
        if max_new_tokens < 1:
            raise GenerationError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        prompt_ids = [seq.result.prompt_token_ids for seq in sequences]
        sampler = Sampler(params, len(sequences))
        batch = len(prompt_ids)
        width = max(len(ids) for ids in prompt_ids)
        input_ids = np.full((batch, width), self.pad_token_id, dtype=np.int64)
        mask = np.zeros((batch, width), dtype=np.int64)
        for row, ids in enumerate(prompt_ids):  # left padding: every row's last prompt token sits in the last column
            input_ids[row, width - len(ids):] = ids
            mask[row, width - len(ids):] = 1
        positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
        cache = self.new_cache(batch)

        start = time.perf_counter()
        logits = self._step(input_ids, positions, mask, cache)[:, -1]
        prefill_ms = (time.perf_counter() - start) * 1e3
        rows = list(range(batch))  # rows[i] = sequence index of batch row i
        next_position = positions[:, -1] + 1
        decode_seconds, decode_steps = 0.0, 0
        for step in range(max_new_tokens):
            tokens = sampler(logits, rows)
            for row, index in enumerate(rows):
                yield index, self._append(sequences[index], int(tokens[row]), step + 1 == max_new_tokens)
            keep = [row for row, index in enumerate(rows) if not sequences[index].done]
            if not keep:
                break
            if len(keep) < len(rows):
                cache.select_rows(keep)
                rows, tokens, next_position, mask = ([rows[r] for r in keep], tokens[keep], next_position[keep],
                                                     mask[keep])
                padding = int(mask.any(0).argmax())  # leading columns that are padding in every remaining row
                if padding:
                    cache.drop_leading(padding)
                    mask = mask[:, padding:]
            mask = np.concatenate([mask, np.ones((len(rows), 1), dtype=np.int64)], axis=1)
            start = time.perf_counter()
            logits = self._step(tokens[:, None].astype(np.int64), next_position[:, None], mask, cache)[:, -1]
            decode_seconds += time.perf_counter() - start
            decode_steps += 1
            next_position = next_position + 1
        self.last_timings = {
            "prefill_ms": round(prefill_ms, 3),
            "decode_ms_per_token": round(decode_seconds * 1e3 / decode_steps, 3) if decode_steps else 0.0,
            "decode_steps": decode_steps,
            "batch": batch,
        }
        self._finish(sequences)

    def _finish(self, sequences: list[_Sequence]) -> None:
        """Every result gets its final text and this run's timings."""
        for seq in sequences:
            seq.result.text = seq.detokenizer.text
            seq.result.timings = dict(self.last_timings)

    def _append(self, seq: _Sequence, token: int, last_step: bool) -> str:
        result = seq.result
        result.token_ids.append(token)
        if token in self.eos_token_ids:
            seq.done, result.finish_reason = True, "eos"
            return seq.detokenizer.finish()
        delta = seq.detokenizer.add(token)
        if seq.detokenizer.stopped:
            seq.done, result.finish_reason = True, "stop"
        elif len(result.prompt_token_ids) + len(result.token_ids) >= self.max_context:
            seq.done, result.finish_reason = True, "context"
        elif last_step:
            seq.done, result.finish_reason = True, "length"
        return delta + seq.detokenizer.finish() if seq.done else delta


def _check_model_matches(manifest: Manifest, backend) -> None:
    """The model file must be the one the manifest describes: same I/O signature, and (for artifacts that record
    it) the same spec and signature digest it was lowered for. Checked at load, not at the first step."""
    problem = signature_mismatch(manifest.io, backend.input_signature(), backend.output_signature())
    if problem is not None:
        raise ArtifactError(f"'{manifest.model_file.name}' does not match the manifest: {problem}; recompile the "
                            "artifact")
    recorded = backend.metadata().get(CONTRACT_METADATA_KEY)
    if recorded is not None and recorded != contract_digest(manifest.data["spec"], list(manifest.io.inputs),
                                                            list(manifest.io.outputs)):
        raise ArtifactError(f"the manifest's model spec or signature was changed after compilation (it no longer "
                            f"matches '{manifest.model_file.name}'); recompile the artifact")
