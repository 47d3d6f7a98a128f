"""The engine core: requests in, per-step outputs out. Single-threaded by contract (runtime/driver.py shares one
core between threads; runtime/async_engine.py drives it from an asyncio program).

Each `step()` asks the scheduler for one model call, has the model runner (or the speculator) execute it,
samples, appends each request's tokens, checks its stop conditions and returns a RequestOutput for every request
that produced tokens or finished. With a speculator on a paged artifact the step first has the draft propose the
next round's tokens of every running request that has none (runtime/speculator.py). Requests join (`add_request`)
and leave (finish, `abort`) between steps. A model call that raises fails exactly the requests in that call
(finish_reason "error", blocks freed), and a request whose tokens cannot be applied (its tokenizer raises) fails
alone; the core keeps serving the others. An interrupt (KeyboardInterrupt) inside a step fails only the requests it
cut in two, then goes on up; the outputs the step had made come with the next step.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections.abc import Callable, Iterable

import numpy as np

from fxllm.errors import FxllmError, GenerationError, InvalidArgumentError
from fxllm.runtime.bad_words import BadWords
from fxllm.runtime.checks import describe
from fxllm.runtime.logprobs import token_logprobs
from fxllm.runtime.metrics import EngineCounters, EngineStats
from fxllm.runtime.model_runner import ModelRunner
from fxllm.runtime.request import Request, RequestOutput, RequestStatus, SamplingParams
from fxllm.runtime.request_validation import check_prompt, check_prompt_length, check_token_ids, check_tokenized
from fxllm.runtime.sampler import SampledTokens, sample_rows
from fxllm.runtime.scheduler import PREFILL, PagedScheduler, ScheduledBatch, StaticBatchScheduler
from fxllm.runtime.speculator import Speculator
from fxllm.runtime.structured_output import Grammars

logger = logging.getLogger("fxllm.engine")
BAD_WORDS_CACHE = 64  # distinct bad_words lists kept tokenized


class EngineCore:
    def __init__(self, runner: ModelRunner, scheduler: PagedScheduler | StaticBatchScheduler, tokenizer,
                 eos_token_ids: Iterable[int], max_context: int, vocab_size: int,
                 encode: Callable[[str], list[int]] | None = None, speculator: Speculator | None = None):
        self.runner = runner
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids)
        self.max_context = max_context
        self.vocab_size = vocab_size
        self.encode = encode or (lambda text: list(tokenizer.encode(text)))
        self.speculator = speculator
        self._requests: dict[str, Request] = {}
        self._ready: list[RequestOutput] = []  # outputs made, not yet returned by step()
        self._seq_ids = itertools.count()
        self._counters = EngineCounters()
        # a server request's n choices, and check then new_request, tokenize one request's bad_words once
        self._cached_bad_words = functools.lru_cache(maxsize=BAD_WORDS_CACHE)(self._tokenize_bad_words)
        self.grammars = Grammars(tokenizer, vocab_size, self.eos_token_ids)

    # -- requests in ------------------------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> None:
        """Queue a request; every check runs now (a one-line GenerationError; InvalidArgumentError naming a bad
        argument), and a refused request changes nothing."""
        self.enqueue(self.new_request(request_id, prompt, params))

    def new_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> Request:
        """A checked Request that is not queued yet (tokenizes a text prompt). Reads only the core's fixed
        configuration, so another thread may call it while the core steps."""
        if not isinstance(request_id, str) or not request_id:
            raise InvalidArgumentError("request_id",
                                       f"request_id must be a non-empty string, got {describe(request_id)}")
        ids = self.check(prompt, params)
        self._check_duplicate(request_id)
        return Request(request_id, ids, params, self.tokenizer, prompt=prompt if isinstance(prompt, str) else None,
                       eos_token_ids=self.eos_token_ids, bad_words=self.tokenized_bad_words(params.bad_words),
                       grammar=(None if params.structured_outputs is None
                                else self.grammars.matcher(params.structured_outputs)),
                       seq_id=next(self._seq_ids))

    def enqueue(self, request: Request) -> None:
        """Queue a request made by new_request."""
        self._check_duplicate(request.request_id)
        self._requests[request.request_id] = request
        self._counters.prompt_tokens += len(request.prompt_token_ids)
        self.scheduler.add(request)

    def check(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """The prompt's token ids once prompt and params are checked for this model (InvalidArgumentError naming the
        argument, as the Python API's checks: runtime/request_validation.py): a valid-Unicode text or token ids of the
        vocabulary; not empty; prompt + max_tokens within the context and within the KV pool; stop_token_ids,
        logit_bias's and allowed_token_ids' ids within the vocabulary, some allowed id that min_tokens and
        bad_words let be sampled, and a structured_outputs that compiles."""
        if not isinstance(params, SamplingParams):
            raise InvalidArgumentError("params", f"params must be a SamplingParams, got {describe(params)}")
        if isinstance(prompt, str):
            ids = check_tokenized(self.encode(check_prompt(prompt)), self.vocab_size)
        else:
            ids = check_token_ids("prompt", prompt, self.vocab_size)
        check_prompt_length(len(ids), params.max_tokens, self.max_context)
        check_token_ids("stop_token_ids", params.stop_token_ids, self.vocab_size)  # one outside could never stop
        check_token_ids("logit_bias keys", [token for token, _ in params.logit_bias], self.vocab_size,
                        param="logit_bias")  # numpy would index past the row, or wrap a negative id
        if params.allowed_token_ids is not None:
            check_token_ids("allowed_token_ids", params.allowed_token_ids, self.vocab_size)
        if params.min_tokens or params.bad_words:
            self._check_something_to_sample(params)
        if params.structured_outputs is not None:
            self.grammars.compile(params.structured_outputs)  # one that does not compile is refused now
        self.scheduler.check_fits(len(ids), params.max_tokens)
        return ids

    def tokenized_bad_words(self, words: tuple[str, ...]) -> BadWords | None:
        """bad_words' token sequences (None for none; InvalidArgumentError: an empty word, or a token outside the
        vocabulary)."""
        return self._cached_bad_words(words) if words else None

    def _tokenize_bad_words(self, words: tuple[str, ...]) -> BadWords:
        bad_words = BadWords.from_words(words, lambda text: list(self.tokenizer.encode(text, add_special_tokens=False)))
        ids = sorted({token for sequence in bad_words.sequences for token in sequence})
        check_token_ids("bad_words' token ids", ids, self.vocab_size, param="bad_words")
        return bad_words

    def _check_something_to_sample(self, params: SamplingParams) -> None:
        """min_tokens masks every id that ends the request, bad_words the ids they always ban: refused when nothing
        would be left (the sampler would see a row without a finite logit, which it reports as a broken model, for
        the whole call). What a longer bad word bans depends on the output: a row it leaves empty ends only its
        request, at that token (Request.starved)."""
        banned = set(self.tokenized_bad_words(params.bad_words).always.tolist()) if params.bad_words else set()
        if banned and (params.allowed_token_ids is not None and banned.issuperset(params.allowed_token_ids)
                       or len(banned) >= self.vocab_size):
            raise InvalidArgumentError("bad_words", "bad_words ban every token that could be sampled"
                                       + (" (allowed_token_ids)" if params.allowed_token_ids is not None else ""))
        if not params.min_tokens:
            return
        ending = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids) | banned
        if params.allowed_token_ids is not None and ending.issuperset(params.allowed_token_ids):
            raise InvalidArgumentError("allowed_token_ids", "allowed_token_ids holds only end-of-sequence or stop "
                                                            f"token ids, which min_tokens ({params.min_tokens}) "
                                                            "forbids for the first tokens"
                                                            + (", or ids bad_words ban" if banned else ""))
        if len(ending) >= self.vocab_size:  # every id is checked to be < vocab_size
            raise InvalidArgumentError("stop_token_ids", "stop_token_ids and the end-of-sequence ids"
                                                         + (" (with the ids bad_words ban)" if banned else "")
                                                         + " cover the whole vocabulary, which min_tokens "
                                                         f"({params.min_tokens}) forbids for the first tokens")

    def abort(self, request_id: str, error: str | None = None) -> None:
        """Stop a request now: its KV blocks are free when this returns; the next step() returns its final output
        (finish_reason "abort", or "error" with this message when `error` is given). An unknown or finished id is
        a no-op (logged)."""
        request = self._requests.get(request_id)
        if request is None:
            logger.info("abort(%r): no such unfinished request; nothing to do", request_id)
            return
        if error is not None:
            self._ready.append(self._fail(request, error))
            return
        request.finish_reason = "abort"
        self._ready.append(self._finish(request, [], "", None))

    # -- stepping ---------------------------------------------------------------------------------------------------

    def has_unfinished(self) -> bool:
        return bool(self._requests or self._ready)

    def step(self) -> list[RequestOutput]:
        """One model call's outputs (and those of aborts and failures since the last step). None is ever lost: if
        something raises out of the step (an interrupt such as KeyboardInterrupt, which Python raises wherever the
        main thread happens to be), the outputs made so far are returned by the next step."""
        self._step()
        outputs, self._ready = self._ready, []
        return outputs

    def _step(self) -> None:
        if self.speculator is not None:
            self._draft()
        batch = self.scheduler.schedule()
        if batch is None:
            for request in list(self.scheduler.waiting):  # unreachable while add_request checks the pool size
                self._ready.append(self._fail(request, "no KV blocks free and nothing running: the pool is too small"))
            return
        now = time.monotonic()
        for request in batch.requests:
            if request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = now
        start = time.perf_counter()
        try:
            results = self._execute(batch)
        except BaseException as exc:  # a backend failure fails this call's requests, not the core
            # an interrupt too: what the call left in a contiguous cache or the draft is unknown; it is re-raised
            message = _one_line(exc) if isinstance(exc, Exception) else f"interrupted ({type(exc).__name__})"
            logger.info("a %s call failed; its %d requests fail with it: %s", batch.kind, len(batch.requests), message,
                        exc_info=logger.isEnabledFor(logging.DEBUG))
            if self.speculator is None and not self.runner.io.paged:
                self.runner.reset()
            self._ready += [self._fail(request, message) for request in batch.requests]
            if not isinstance(exc, Exception):
                raise
            return
        self._account(batch, time.perf_counter() - start)
        self.scheduler.update(batch, [result.cached for result in results])
        interrupt = None
        for request, start_position, result in zip(batch.requests, batch.positions, results):
            try:
                output = self._apply(request, start_position, result, batch.kind)
            except Exception as exc:  # e.g. the tokenizer fails on this request's tokens: only this request fails
                logger.info("request %r failed: %s", request.request_id, _one_line(exc))
                output = self._fail(request, _one_line(exc))
            except BaseException as exc:  # an interrupt: this request is half-updated and fails; the others' tokens
                output = self._fail(request, f"interrupted ({type(exc).__name__})")  # are still applied; re-raised
                interrupt = interrupt or exc
            if output is not None:
                self._ready.append(output)
        if interrupt is not None:
            raise interrupt

    def _draft(self) -> None:
        """The draft's proposals for every running request without any; a failing draft fails its request."""
        for request in self.speculator.needs_drafts(self.scheduler.running):
            try:
                self.speculator.draft(request)
            except Exception as exc:
                logger.info("drafting for %r failed: %s", request.request_id, _one_line(exc))
                self._ready.append(self._fail(request, _one_line(exc)))

    def _execute(self, batch: ScheduledBatch) -> list[SampledTokens]:
        if self.speculator is not None and self.speculator.handles(batch):
            return self.speculator.execute(batch)
        out = self.runner.execute(batch)
        prompt_logits = out.all_logits or [None] * len(batch.requests)
        if not batch.sample:
            return [SampledTokens([], None, logits) for logits in prompt_logits]
        logits = out.logits
        if any(request.logits_adjuster is not None for request in batch.requests):
            logits = np.concatenate([request.sampling_logits(logits[row:row + 1])
                                     for row, request in enumerate(batch.requests)])
        tokens = sample_rows(logits, [r.sampler for r in batch.requests])
        return [SampledTokens([int(token)], out.logits[row:row + 1], prompt_logits[row])
                for row, token in enumerate(tokens)]

    def _apply(self, request: Request, start: int, result: SampledTokens, kind: str) -> RequestOutput | None:
        """Append one call's tokens to a request (those after a stop are dropped); its output, if any."""
        if result.prompt_logits is not None and request.needs_prompt_logits:
            self._add_prompt_logprobs(request, start, result.prompt_logits)
        new_ids, delta, logprobs = [], "", []
        top = request.params.logprobs
        for row, token in enumerate(result.token_ids):
            if request.starved:  # bad_words left nothing at this position: the token is not the request's
                delta += request.finish_starved()
                break
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = time.monotonic()
            new_ids.append(token)
            if top is not None:
                logprobs += token_logprobs(result.logits[row:row + 1], [token], top)
            delta += request.append_token(token, self.eos_token_ids)
            if request.finish_reason is not None:
                break
        if new_ids:
            request.metrics.last_token_time = time.monotonic()
        self._counters.generation_tokens += len(new_ids)
        if kind != PREFILL:
            request.metrics.decode_tokens += len(new_ids)
        if request.final_only:  # one output at the end, with everything (no per-step output to build and deliver)
            request.pending_logprobs += logprobs
            if request.finish_reason is None:
                return None
            new_ids, delta, logprobs = list(request.output_token_ids), request.text, request.pending_logprobs
        if request.finish_reason is not None:
            return self._finish(request, new_ids, delta, logprobs if top is not None else None)
        if not new_ids:
            return None  # a prefill chunk before the last
        return self._output(request, new_ids, delta, logprobs if top is not None else None)

    def _add_prompt_logprobs(self, request: Request, start: int, logits: np.ndarray) -> None:
        """Row j of logits (the positions fed from `start`) predicts prompt token start + j + 1."""
        prompt = request.prompt_token_ids
        rows = list(range(len(request.prompt_logprobs) - 1 - start, min(len(prompt) - 1 - start, logits.shape[0])))
        if rows:
            request.prompt_logprobs += token_logprobs(logits[rows], [prompt[start + j + 1] for j in rows],
                                                      request.params.prompt_logprobs)

    def _account(self, batch: ScheduledBatch, seconds: float) -> None:
        c, ms = self._counters, seconds * 1e3
        c.steps += 1
        if batch.kind == PREFILL:
            c.prefill_steps += 1
            c.prefill_tokens += sum(len(chunk) for chunk in batch.token_ids)
            c.prefill_seconds += seconds
            for request in batch.requests:
                request.metrics.prefill_ms += ms
            return
        c.decode_steps += 1
        c.decode_seconds += seconds
        c.decode_batch_total += len(batch.requests)
        c.max_decode_batch = max(c.max_decode_batch, len(batch.requests))
        for request in batch.requests:
            request.metrics.decode_ms += ms
            request.metrics.decode_steps += 1

    # -- requests out -----------------------------------------------------------------------------------------------

    def _fail(self, request: Request, message: str) -> RequestOutput:
        request.finish_reason, request.error = "error", message
        return self._finish(request, [], "", None)

    def _finish(self, request: Request, new_ids: list[int], delta: str, logprobs) -> RequestOutput:
        """The request leaves: out of the scheduler, its blocks and speculative state freed at once."""
        request.status = RequestStatus.FINISHED
        request.metrics.finished_time = time.monotonic()
        self.scheduler.remove(request)
        if self.speculator is not None:
            self.speculator.release(request)
        self._requests.pop(request.request_id, None)
        self._counters.requests_finished += 1
        return self._output(request, new_ids, delta, logprobs)

    def _output(self, request: Request, new_ids: list[int], delta: str, logprobs) -> RequestOutput:
        prompt_logprobs = None
        if request.prompt_logprobs is not None and not request.prompt_logprobs_sent:
            prompt_logprobs, request.prompt_logprobs_sent = list(request.prompt_logprobs), True
        return RequestOutput(request.request_id, new_ids, delta, request.finished, request.finish_reason,
                             request.stop_reason, request.prompt_token_ids, len(request.prompt_token_ids),
                             len(request.output_token_ids), logprobs, prompt_logprobs, request.error,
                             request.metrics.snapshot())

    # -- helpers ----------------------------------------------------------------------------------------------------

    def _check_duplicate(self, request_id: str) -> None:
        """An id is in use until step() has returned its request's final output: an aborted request's comes with
        the next step, and a new request of that id meanwhile made two requests' outputs indistinguishable."""
        if request_id in self._requests:
            raise request_id_in_use(request_id, ended=False)
        if any(output.request_id == request_id and output.finished for output in self._ready):
            raise request_id_in_use(request_id, ended=True)

    def get_request(self, request_id: str) -> Request | None:
        """An unfinished request's state."""
        return self._requests.get(request_id)

    def score(self, token_ids: list[int]) -> np.ndarray:
        """Logits [T,V] of every position of one sequence, in a single prefill (evaluation). On a paged artifact it
        borrows blocks of the pool for the call (OutOfBlocks when running requests hold them)."""
        ids = check_token_ids("token_ids", token_ids, self.vocab_size)
        if not 0 < len(ids) <= self.max_context:
            raise InvalidArgumentError("token_ids", f"can score 1 to {self.max_context} tokens at once, got {len(ids)}")
        if not self.runner.io.paged:
            return self.runner.step_one(self.runner.new_cache(), ids, 0, all_logits=True)
        manager, seq_id = self.scheduler.manager, -1 - next(self._seq_ids)
        manager.allocate(seq_id, ids, reuse_cached=False)  # every slot is recomputed and written
        try:
            batch = ScheduledBatch(PREFILL, [], [ids], [0], sample=False, prompt_logits=True,
                                   block_tables=[manager.block_table(seq_id)],
                                   slots=[manager.slot_mapping(seq_id, 0, len(ids))])
            return self.runner.execute(batch).all_logits[0]
        finally:
            manager.free(seq_id)

    def stats(self) -> EngineStats:
        s, c = self.scheduler, self._counters
        manager = s.manager if isinstance(s, PagedScheduler) else None
        return EngineStats(
            running=s.num_running, waiting=len(s.waiting),
            kv_blocks_used=manager.num_used_blocks if manager else None,
            kv_blocks_total=manager.num_blocks if manager else None,
            prefix_cache_hits=manager.prefix_hits if manager else 0,
            prefix_cache_queries=manager.prefix_queries if manager else 0,
            preemptions=s.preemptions, prompt_tokens=c.prompt_tokens, generation_tokens=c.generation_tokens,
            requests_finished=c.requests_finished, steps=c.steps, prefill_steps=c.prefill_steps,
            decode_steps=c.decode_steps, prefill_tokens=c.prefill_tokens, prefill_cached_tokens=s.prefill_cached_tokens,
            prefill_seconds=c.prefill_seconds, decode_seconds=c.decode_seconds,
            decode_batch_total=c.decode_batch_total, max_decode_batch=c.max_decode_batch,
            peak_kv_blocks_used=s.peak_blocks_used if manager else None,
            kv_waste_at_peak=s.peak_waste if manager else None,
            speculative=self.speculator.metrics() if self.speculator is not None else None)

    def reset_peak_stats(self) -> None:
        """Start the peaks of stats() (max decode batch, peak KV blocks and their waste) afresh."""
        self._counters.max_decode_batch = 0
        if isinstance(self.scheduler, PagedScheduler):
            self.scheduler.reset_peaks()


def _one_line(exc: BaseException) -> str:
    """An error message for a RequestOutput: an FxllmError's own message, else the exception type and first line."""
    lines = str(exc).strip().splitlines()
    first = lines[0] if lines else ""
    return first if isinstance(exc, FxllmError) and first else f"{type(exc).__name__}: {first}".rstrip(": ")


def request_id_in_use(request_id: str, ended: bool) -> GenerationError:
    """The error for a request id already taken: by an unfinished request, or (`ended`) by one that ended (aborted or
    failed) and whose final output the next step still delivers."""
    if ended:
        return GenerationError(f"request id {request_id!r:.60} is still in use: its request ended (aborted or "
                               "failed), and its final output comes with the next step; use another id, or this one "
                               "after that step")
    return GenerationError(f"request id {request_id!r:.60} is already in use by an unfinished request")
