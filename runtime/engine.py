"""Engine: a loaded artifact that generates. It assembles the layers — backend (runtime/backend.py), model runner,
scheduler, engine core — and offers the blocking API (generate, generate_ids, stream, score) as thin calls on the
core through a CoreDriver, so any number of threads and open streams share one core safely."""

from __future__ import annotations

import os
import uuid
from collections import deque
from collections.abc import Iterator
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from fxllm.errors import ArtifactError, InvalidArgumentError
from fxllm.runtime.backend import Backend, load_backend
from fxllm.runtime.checks import describe
from fxllm.runtime.contract import MAX_SPEC_K
from fxllm.runtime.driver import CoreDriver
from fxllm.runtime.engine_core import EngineCore
from fxllm.runtime.kv_cache import SharedKVCache
from fxllm.runtime.manifest import Manifest, SpeculativePlan, load_manifest
from fxllm.runtime.metrics import EngineStats
from fxllm.runtime.model_runner import ModelRunner
from fxllm.runtime.request import RequestOutput, SamplingParams
from fxllm.runtime.request_validation import (GenerationRequest, available_memory, check_engine_options,
                                              check_kv_pool, check_load_flags, check_prompt, check_prompt_ids,
                                              check_prompt_labels, check_prompts, check_request, check_token_ids,
                                              check_tokenized, encode_within_context)
from fxllm.runtime.results import GenerationResult, collector, raise_failure
from fxllm.runtime.scheduler import PagedScheduler, StaticBatchScheduler
from fxllm.runtime.tokenizer import load_tokenizer

DEFAULT_NGRAM_K = 4  # prompt lookup asked for at load time on an artifact compiled without a draft
# Prompt tokens a call computes when max_tokens_per_step is not given: on CPU the projections are as fast at 256
# rows as at more, and a smaller call scores fewer masked keys (SmolLM2 fp32, 1,035 prompt tokens: 0.86x the time of
# one call, 512 tokens a call 0.91x; paged: 256 against 512 tokens a call 0.90-0.98x at 1,035 tokens, 0.85-1.02x at
# 500).
DEFAULT_TOKENS_PER_STEP = 256
LOAD_ATTEMPTS = 3  # loads of an artifact that a compile replaced while it loaded (each retry reads the new one)
# A paged iteration's prompt-token admission budget when max_tokens_per_step is not given: more requests admitted
# an iteration, fewer decode steps between admissions; each still prefilled in calls of DEFAULT_TOKENS_PER_STEP.
DEFAULT_PAGED_ADMISSION_TOKENS = 512


class Engine:
    def __init__(self, directory: Path, manifest: Manifest, backend: Backend, tokenizer,
                 kv_cache_memory: int | str | None = None, kv_blocks: int | None = None, max_batch: int = 64,
                 max_tokens_per_step: int | None = None, prefix_caching: bool = True, speculative=None):
        """speculative: None, or (mode, k, draft Engine or None) to decode speculatively."""
        self.directory = directory
        self.manifest = manifest
        self.backend = backend
        self.tokenizer = tokenizer
        self.spec = manifest.spec
        self.io = manifest.io
        self.paged = manifest.io.paged
        self.num_layers = manifest.io.num_layers
        self.selects_logits = manifest.io.selects_logits
        self.kv_cache_memory, self.kv_blocks = kv_cache_memory, kv_blocks
        admission_tokens = DEFAULT_PAGED_ADMISSION_TOKENS if max_tokens_per_step is None else max_tokens_per_step
        if max_tokens_per_step is None:
            max_tokens_per_step = DEFAULT_TOKENS_PER_STEP
        self.max_batch, self.max_tokens_per_step, self.prefix_caching = max_batch, max_tokens_per_step, prefix_caching
        eos_token_ids = set(self.spec.eos_token_ids)
        if tokenizer.eos_token_id is not None:
            eos_token_ids.add(tokenizer.eos_token_id)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        blocks = self._pool_blocks() if self.paged else None  # sized now, so a bad KV budget fails at load time
        self.kv_tokens = None if self.paged else self._contiguous_kv_tokens()
        self.runner = ModelRunner.create(backend, self.io, self.spec, pad, blocks,
                                         prefill_tokens=None if self.paged else max_tokens_per_step)
        self.speculator = _speculator(self.runner, self.paged, self.max_context, speculative)
        if self.paged:
            from fxllm.runtime.block_manager import BlockManager

            manager = BlockManager(blocks, self.block_size, prefix_caching, keep_runs=self.io.head_major_pool)
            scheduler = PagedScheduler(manager, max_batch, admission_tokens, prefill_call_tokens=max_tokens_per_step,
                                       speculative=bool(self.speculator), attention_span=self.spec.attention_span)
        else:  # speculative decoding on a contiguous cache verifies one request at a time
            # a left-padded batch keeps its padding columns: its rows may pass the context together
            scheduler = StaticBatchScheduler(1 if self.speculator else max_batch, self.kv_tokens,
                                             self.max_context if self.io.right_padded else None,
                                             self._smallest_cache_row())
        self.core = EngineCore(self.runner, scheduler, tokenizer, eos_token_ids, self.max_context,
                               self.spec.vocab_size, encode=self.encode, speculator=self.speculator)
        self.driver = CoreDriver(self.core)

    @classmethod
    def load(cls, path: str | os.PathLike, threads: int | None = None, providers: list[str] | None = None,
             verify: bool = True, backend: str = "onnxruntime", kv_cache_memory: int | str | None = None,
             kv_blocks: int | None = None, max_batch: int = 64, max_tokens_per_step: int | None = None,
             prefix_caching: bool = True, int8_activations: bool | None = None, speculative: bool | str = True,
             spec_k: int | None = None, spin: bool = True, device: str = "cpu",
             torch_compile: bool = False, unrolled_draft: bool | None = None, huge_pages: bool = True) -> Engine:
        """backend: "onnxruntime" (any artifact, any machine), "tensorrt" (an artifact with engine.plan) or "torch"
        (a --target torch artifact on `device`, "cpu" or "cuda", optionally through torch.compile).
        `max_batch` requests run at once; a paged request or a one-row contiguous batch is prefilled in calls of at most
        `max_tokens_per_step` tokens (default DEFAULT_TOKENS_PER_STEP, 256; a batch of several contiguous rows is
        prefilled in one call, GroupQueryAttention's rule). Contiguous artifacts: a batch takes as many waiting
        requests as `kv_cache_memory` bytes hold (rows × their longest prompt + generation; default half the memory
        available at load, at least one full context), and one that alone needs more is refused. Paged artifacts: the
        KV pool holds `kv_blocks` blocks, or as many as fit in `kv_cache_memory` bytes (e.g. "256MB"; default 512 MiB
        or 64 full-context sequences, whichever is less, at least one); not both. A given `max_tokens_per_step` is
        also each iteration's prompt-token admission budget (default DEFAULT_PAGED_ADMISSION_TOKENS, 512);
        `prefix_caching` shares full KV blocks between requests with a common prompt prefix. int8_activations: let
        ONNX Runtime's quantized matmuls quantize activations to int8 (faster, slightly less exact); default: what the
        artifact recommends (float activations unless it was compiled with --int8-activations); True where neither
        the artifact nor its draft has quantized weights is an InvalidArgumentError. Artifacts compiled with a draft
        decode speculatively unless speculative=False;
        speculative="ngram" decodes any artifact with prompt lookup (no draft model, nothing to compile; k 4 unless the
        artifact names one); spec_k overrides k. unrolled_draft: a model draft proposes its k tokens in one call of its
        unrolled graph (True), or one call per token (False); None: unrolled on a CUDA provider only (on CPU it measured
        no faster: docs/speculative.md); True without a model draft is an InvalidArgumentError. A quantized draft
        runs with int8 activations unless int8_activations is given or it is unrolled (its speed matters, its
        numerics do not: verification keeps exactly the target's distribution).
        spin=False stops ONNX Runtime's idle threads from spinning (set for speculative target/draft pairs).
        huge_pages=False skips moving the weights onto 2 MiB pages at load (runtime/huge_pages.py: ~1-3 s of load
        for ~7% faster decode steps on CPU; worth it for a server, not for a few dozen tokens)."""
        check_engine_options(threads, kv_blocks, kv_cache_memory, max_batch, max_tokens_per_step, spec_k)
        check_load_flags(backend, verify, prefix_caching, spin, torch_compile, int8_activations, unrolled_draft,
                         providers, device, huge_pages)
        for _ in range(LOAD_ATTEMPTS):
            identity = _directory_identity(path)
            try:
                manifest, runner, tokenizer, draft_plan = cls._read_artifact(
                    path, threads, providers, verify, backend, kv_blocks, int8_activations, speculative, spec_k, spin,
                    device, torch_compile, unrolled_draft, huge_pages)
            except Exception:
                if _directory_identity(path) == identity:
                    raise
                continue  # replaced while it loaded (a compile finished): its files were of both artifacts
            if _directory_identity(path) == identity:
                return cls(manifest.directory, manifest, runner, tokenizer, kv_cache_memory, kv_blocks, max_batch,
                           max_tokens_per_step, prefix_caching, draft_plan)
            manifest = runner = tokenizer = draft_plan = None  # let the stale model go before the next one loads
        raise ArtifactError(f"'{path}' was replaced {LOAD_ATTEMPTS} times while it loaded (is a compile writing it "
                            "again and again?); load it once that is done")

    @classmethod
    def _read_artifact(cls, path: str | os.PathLike, threads: int | None, providers: list[str] | None, verify: bool,
                       backend: str, kv_blocks: int | None, int8_activations: bool | None, speculative: bool | str,
                       spec_k: int | None, spin: bool, device: str, torch_compile: bool,
                       unrolled_draft: bool | None, huge_pages: bool) -> tuple[Manifest, Backend, object, tuple | None]:
        """load's reading of the artifact's files, its arguments as load's: (manifest, the model's backend,
        tokenizer, draft plan: None, or (mode, k, draft model or None))."""
        manifest = load_manifest(path, verify=verify)
        if kv_blocks is not None and not manifest.io.paged:  # refused, not ignored: the user meant to size a pool
            raise InvalidArgumentError("kv_blocks", f"kv_blocks applies to paged artifacts; '{path}' has a contiguous "
                                                    "KV cache (compile with the `paged` pass to use a KV pool, or "
                                                    "bound its cache with kv_cache_memory)")
        plan = _speculative_plan(manifest, speculative)
        if spec_k is not None and plan is None:  # refused, not ignored: the user meant to speculate
            raise InvalidArgumentError("spec_k", f"spec_k sets how many tokens speculative decoding proposes, and "
                                                 f"'{path}' decodes without it (an artifact compiled with a draft, "
                                                 "or prompt lookup on any artifact: speculative='ngram', "
                                                 "--speculative ngram)")
        if unrolled_draft and (plan is None or plan.draft is None):  # refused, not ignored: the user meant a draft
            raise InvalidArgumentError("unrolled_draft", "unrolled_draft applies to an artifact compiled with a "
                                       "model draft (--draft MODEL or --draft self-int4), and this load of "
                                       f"'{path}' runs no draft model")
        if int8_activations and not _has_quantized_weights(manifest, plan):  # refused, not ignored: nothing to quantize
            raise InvalidArgumentError("int8_activations", f"int8_activations (--int8-activations) applies to "
                                       f"quantized artifacts, and '{path}' has float weights"
                                       f"{' (its draft too)' if plan is not None and plan.draft else ''}: compile "
                                       "with --quant METHOD, or from a GGUF's own quantized blocks")
        # Target and draft sessions alternate on the same cores: threads spinning after one session's call
        # would slow the other's (measured: a 5-token verify 105 ms alternating vs 41 ms without spinning).
        # Prompt lookup has no draft session: the target spins as without speculation.
        runner = load_backend(manifest, backend, threads, providers,
                              manifest.int8_activations if int8_activations is None else int8_activations,
                              spin=spin and (plan is None or plan.draft is None), device=device,
                              torch_compile=torch_compile, huge_pages=huge_pages)
        tokenizer = load_tokenizer(manifest.tokenizer_dir)
        draft_plan = None
        if plan is not None:
            k = plan.k if spec_k is None else spec_k
            if not 1 <= k <= MAX_SPEC_K:
                raise InvalidArgumentError("spec_k", f"spec_k must be between 1 and {MAX_SPEC_K}, got {k}")
            draft = None
            if plan.draft is not None:
                from fxllm.runtime.drafter import load_draft_model

                draft = load_draft_model(plan.draft, k, unrolled_draft, manifest.spec.vocab_size, threads=threads,
                                         providers=providers, verify=verify, int8_activations=int8_activations,
                                         huge_pages=huge_pages)
            draft_plan = (plan.mode, k, draft)
        return manifest, runner, tokenizer, draft_plan

    def _pool_blocks(self) -> int:
        from fxllm.runtime.paged_cache import default_num_blocks, parse_bytes

        block_bytes = self.spec.kv_bytes_per_token() * self.block_size
        if self.kv_blocks is not None:
            blocks = self.kv_blocks
        elif self.kv_cache_memory is not None:
            blocks = parse_bytes(self.kv_cache_memory) // block_bytes
        else:
            blocks = default_num_blocks(block_bytes, self.block_size, self.max_context)
        return check_kv_pool(int(blocks), block_bytes, self.kv_blocks, self.kv_cache_memory)  # before allocating

    def _smallest_cache_row(self) -> int:
        """Positions one row of a contiguous cache holds however short its sequence (shared buffers start at
        SharedKVCache.MIN_CAPACITY rows)."""
        return SharedKVCache.MIN_CAPACITY if self.io.shared_buffer else 1

    def _contiguous_kv_tokens(self) -> int | None:
        """K/V positions (rows × columns) a contiguous batch's cache may hold: `kv_cache_memory` (a ceiling, not
        allocated up front), else half the memory available at load but at least one full context (None where that
        cannot be read: no bound). Without a bound a batch of 64 rows could grow to 64 full contexts (SmolLM2: 24 GB
        of float32 cache), past what the machine has."""
        from fxllm.runtime.paged_cache import parse_bytes

        per_token = self.spec.kv_bytes_per_token()
        smallest = self._smallest_cache_row()
        if self.kv_cache_memory is None:  # bounds the batch, never refuses one request the context takes
            available = available_memory()
            return None if available is None else max(available // 2 // per_token, self.max_context, smallest)
        tokens = parse_bytes(self.kv_cache_memory) // per_token
        if tokens < smallest:
            raise InvalidArgumentError("kv_cache_memory", f"a KV budget of {self.kv_cache_memory} holds {tokens} "
                                                          f"positions of this model's cache ({per_token:,} bytes "
                                                          f"each); its contiguous cache needs at least {smallest}")
        return tokens

    # -- properties ---------------------------------------------------------------------------------------------

    @property
    def block_size(self) -> int:
        return self.io.block_size

    @property
    def max_context(self) -> int:
        return self.spec.max_positions

    @property
    def eos_token_ids(self) -> set[int]:
        return self.core.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids) -> None:  # benchmarks: set() decodes exactly max_new_tokens tokens
        self.core.eos_token_ids = set(ids)

    def capacity_tokens(self) -> int:
        """Tokens of KV cache the engine can hold: a paged artifact's pool; a contiguous artifact's KV budget
        (kv_cache_memory, or half the memory available at load), or its context where no budget could be read."""
        if not self.paged:
            return self.max_context if self.kv_tokens is None else self.kv_tokens
        return self.core.scheduler.manager.capacity_tokens

    def batcher(self) -> PagedScheduler | StaticBatchScheduler:
        """The core's scheduler (kept for callers of the former batcher; paged: `.manager` is the BlockManager)."""
        return self.core.scheduler

    def stats(self) -> EngineStats:
        return self.core.stats()

    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        """The prompt's token ids (through the chat template with `chat`), each within the model's vocabulary."""
        prompt = check_prompt(prompt)
        if chat:  # the template writes the special tokens itself
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
            ids = encode_within_context(partial(self.tokenizer.encode, add_special_tokens=False), text,
                                        self.max_context)
        else:
            ids = encode_within_context(self.tokenizer.encode, prompt, self.max_context)
        return check_tokenized(ids, self.spec.vocab_size)

    # -- public API ---------------------------------------------------------------------------------------------
    # Every argument is checked up front by runtime/request_validation.py (InvalidArgumentError naming a bad one);
    # the engine core checks each request against the model (empty, context, KV pool) with the same functions.

    def generate(self, prompts: str | list[str], max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int | None = None, stop: str | list[str] | None = None,
                 chat: bool = False, **adjustments: Any) -> GenerationResult | list[GenerationResult]:
        """Generate for one prompt (returns one result) or a list of prompts of any lengths (returns a list).
        adjustments (keyword only, as SamplingParams): min_p, presence_penalty, frequency_penalty,
        repetition_penalty, logit_bias ({token id: bias}), min_tokens, stop_token_ids, allowed_token_ids,
        ignore_eos, include_stop_str_in_output; so for generate_ids, stream and sampling_params."""
        texts, single = check_prompts(prompts)
        request = check_request(max_new_tokens, temperature, top_k, top_p, seed, stop, chat, **adjustments)
        results = self._run([self._encode_row(i, t, request.chat, single) for i, t in enumerate(texts)], request,
                            texts, None if single else "prompts")
        return results[0] if single else results

    def _encode_row(self, index: int, text: str, chat: bool, single: bool) -> list[int]:
        """encode() for one of generate()'s prompts; a refusal names the row (`prompts[2]: ...`) in a batch."""
        try:
            return self.encode(text, chat)
        except InvalidArgumentError as exc:
            if single:
                raise
            raise InvalidArgumentError(exc.param, f"prompts[{index}]: {exc}") from None

    def generate_ids(self, prompt_ids: list[list[int]], max_new_tokens: int = 64, temperature: float = 0.0,
                     top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                     stop: str | list[str] | None = None, prompts: list[str] | None = None,
                     **adjustments: Any) -> list[GenerationResult]:
        """Like generate, from token ids (ints in [0, vocab_size)). The requests join whatever else the engine is
        running."""
        request = check_request(max_new_tokens, temperature, top_k, top_p, seed, stop, **adjustments)
        rows = check_prompt_ids(prompt_ids, self.spec.vocab_size)
        return self._run(rows, request, check_prompt_labels(prompts, len(rows)), "prompt_ids")

    def _run(self, rows: list[list[int]], request: GenerationRequest, prompts: list[str] | None,
             batch: str | None) -> list[GenerationResult]:
        """Run the rows to completion; nothing runs unless every row is accepted. `batch`: the argument the rows
        came in as a list ("prompts", "prompt_ids"), whose index a refusal names; None for a single prompt."""
        results = [GenerationResult(prompts[i] if prompts else None, ids) for i, ids in enumerate(rows)]
        request_ids = [_new_request_id() for _ in rows]
        done = []
        params = [self._capped(request, ids, output_kind="final") for ids in rows]  # collected whole: one output
        try:
            self.driver.submit(list(zip(request_ids, rows, params)),
                               [collector(result, request.max_new_tokens, self.max_context, done)
                                for result in results])
        except InvalidArgumentError as exc:
            raise self._refused_row(exc, rows, params, batch) from None
        try:
            self.driver.step_until(lambda: len(done) == len(rows))
        finally:
            if len(done) < len(rows):  # interrupted: leave nothing behind
                for request_id in request_ids:
                    self.driver.abort(request_id, notify=False)
        raise_failure(done)
        return results

    def _refused_row(self, exc: InvalidArgumentError, rows: list[list[int]], params: list[SamplingParams],
                     batch: str | None) -> InvalidArgumentError:
        """A batch's refusal naming the row it is about ("prompts[2]: the prompt is 301 tokens ..."): the core checks
        each row alone and says "the prompt", which of a CLI's three --prompt flags leaves unsaid."""
        if batch is None:
            return exc
        for i, (ids, row_params) in enumerate(zip(rows, params)):
            try:
                self.core.check(ids, row_params)
            except InvalidArgumentError as row_exc:
                return InvalidArgumentError(row_exc.param, f"{batch}[{i}]: {row_exc}")
        return exc

    def stream(self, prompt: str, max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0, seed: int | None = None, stop: str | list[str] | None = None,
               chat: bool = False, **adjustments: Any) -> Iterator[str]:
        """Yield the generated text piece by piece as tokens are decoded. The arguments are checked (and the prompt
        tokenized) now, before the first piece is asked for; the request starts then; closing the iterator aborts
        it."""
        request = check_request(max_new_tokens, temperature, top_k, top_p, seed, stop, chat, **adjustments)
        ids = self.encode(prompt, request.chat)
        params = self._capped(request, ids)
        ids = self.core.check(ids, params)
        return (out.text_delta for out in self.stream_outputs(ids, params) if out.text_delta)

    def stream_outputs(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str | None = None) -> Iterator[RequestOutput]:
        """One request's RequestOutputs as the core produces them (the blocking twin of AsyncEngine.generate); a
        request that fails raises its error. Closing the iterator early aborts the request."""
        request_id = request_id or _new_request_id()
        buffer: deque[RequestOutput] = deque()
        self.driver.submit([(request_id, prompt, params)], [buffer.append])
        finished = False
        try:
            while not finished:
                self.driver.step_until(lambda: bool(buffer))
                output = buffer.popleft()
                finished = output.finished
                raise_failure([output])
                yield output
        finally:
            if not finished:  # may run in the garbage collector, on any thread: never waits
                self.driver.abort_soon(request_id, notify=False)

    def score(self, token_ids: list[int]) -> np.ndarray:
        """Logits [T,V] of every position of one sequence, in a single prefill (used by `fxllm eval`)."""
        return self.driver.run_exclusive(lambda: self.core.score(token_ids))

    def sampling_params(self, prompt_ids: list[int], max_new_tokens: int = 64, temperature: float = 0.0,
                        top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                        stop: str | list[str] | None = None, **adjustments: Any) -> SamplingParams:
        """generate()'s options for this prompt as SamplingParams (checked as generate checks them)."""
        request = check_request(max_new_tokens, temperature, top_k, top_p, seed, stop, **adjustments)
        return self._capped(request, check_token_ids("prompt_ids", prompt_ids, self.spec.vocab_size))

    def _capped(self, request: GenerationRequest, prompt_ids: list[int], output_kind: str = "delta") -> SamplingParams:
        """The request's SamplingParams for this prompt: max_new_tokens capped at the room the prompt leaves in the
        context (generate() then reports finish_reason "context"; a prompt without room is refused by the core)."""
        room = max(self.max_context - len(prompt_ids), 1)
        changes = {"output_kind": output_kind} if output_kind != request.sampling.output_kind else {}
        if request.max_new_tokens > room:
            changes["max_tokens"] = room
            changes["min_tokens"] = min(request.sampling.min_tokens, room)  # as many as the context leaves
        return replace(request.sampling, **changes) if changes else request.sampling


def _directory_identity(path: str | os.PathLike) -> tuple[int, int] | None:
    """What the path names now (device, inode; None: nothing): a compile swaps a new directory in, so a load whose
    path names another directory after it than before may have read files of both artifacts."""
    try:
        found = os.stat(path)
    except OSError:
        return None
    return found.st_dev, found.st_ino


def _speculative_plan(manifest: Manifest, speculative: bool | str) -> SpeculativePlan | None:
    """What Engine.load's `speculative` asks for on this artifact."""
    if speculative is True:
        return manifest.speculative
    if speculative is False:
        return None
    if speculative == "ngram":  # prompt lookup needs no compiled draft
        plan = manifest.speculative
        return SpeculativePlan("ngram", plan.k if plan is not None else DEFAULT_NGRAM_K, None)
    raise InvalidArgumentError("speculative", "speculative must be True (the artifact's draft, if any), False or "
                                              f"'ngram', got {describe(speculative)}")


def _has_quantized_weights(manifest: Manifest, plan: SpeculativePlan | None) -> bool:
    """The artifact, or the model draft it speculates with, has quantized matmul weights (int8 activations apply)."""
    if "quantized" in manifest.facts:
        return True
    return plan is not None and plan.draft is not None and "quantized" in load_manifest(plan.draft, verify=False).facts


def _speculator(runner: ModelRunner, paged: bool, max_context: int, speculative):
    """speculative: None, or (mode, k, the draft: an Engine, an UnrolledDraft or None) → a Speculator over the
    target's runner: batched on a paged artifact, one request at a time on a contiguous one."""
    if speculative is None:
        return None
    from fxllm.runtime.drafter import Drafter
    from fxllm.runtime.speculative_decoder import SpeculativeDecoder
    from fxllm.runtime.speculator import PagedSpeculator

    mode, k, draft = speculative
    drafter = Drafter(mode, k, runner.spec.vocab_size, draft.runner if isinstance(draft, Engine) else draft)
    context = min(max_context, draft.max_context) if draft else max_context  # never propose past either's context
    return (PagedSpeculator if paged else SpeculativeDecoder)(runner, drafter, k, context)


def _new_request_id() -> str:
    return f"engine-{uuid.uuid4().hex}"
