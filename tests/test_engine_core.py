"""The engine core on a tiny paged artifact: requests join and leave between steps and are aborted midway, through
the core and through the asyncio wrapper; outputs equal running each request alone; blocks are freed at once; bad
input is refused at once; a failing model call fails only its own requests; logprobs match the model's scores."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
import time

import numpy as np
import pytest

import fxllm
from fxllm.errors import GenerationError, InvalidArgumentError
from fxllm.runtime.async_engine import AsyncEngine
from fxllm.runtime.backend import Backend
from fxllm.runtime.logprobs import log_softmax
from fxllm.runtime.request import SamplingParams
from tests.backend_wrapper import WrappedBackend
from tests.conftest import PROMPTS

PROMPTS32 = [(prompt + " ") * (1 + i % 3) + str(i) for i, prompt in enumerate(PROMPTS * 8)]  # 6-60 tokens
NEW32 = [8 + (i * 5) % 17 for i in range(32)]  # 8-24 new tokens
ABORTED = (3, 8, 13)


@pytest.fixture(scope="module")
def paged_artifact(tiny_paged_artifact):
    return tiny_paged_artifact


@pytest.fixture(scope="module")
def alone(paged_artifact):
    """Every prompt's token ids and its result when it runs alone on a fresh engine."""
    engine = fxllm.load(paged_artifact)
    ids = [engine.encode(prompt) for prompt in PROMPTS32]
    return ids, [engine.generate_ids([i], max_new_tokens=n)[0] for i, n in zip(ids, NEW32)]


class FailingBackend(WrappedBackend):
    """Wraps a real backend; once armed, the first call whose batch has at least `rows` rows raises."""

    def __init__(self, inner: Backend):
        super().__init__(inner)
        self.armed_rows = None

    def arm(self, rows: int = 1) -> None:
        self.armed_rows = rows

    def run(self, feeds):
        if self.armed_rows is not None and feeds["input_ids"].shape[0] >= self.armed_rows:
            self.armed_rows = None
            raise RuntimeError("injected backend failure\nsecond line")
        return self.inner.run(feeds)


class HoldingBackend(WrappedBackend):
    """Wraps a real backend; every call waits while `hold()` is true (at most `limit` seconds, so a bug fails the
    test instead of hanging it). The engine thread cannot run a request to its end before the test acts on it."""

    def __init__(self, inner: Backend, hold, limit: float = 30.0):
        super().__init__(inner)
        self.hold, self.limit = hold, limit

    def run(self, feeds):
        deadline = time.monotonic() + self.limit
        while self.hold() and time.monotonic() < deadline:
            time.sleep(0.001)
        return self.inner.run(feeds)


def assert_pool_whole(engine) -> None:
    manager = engine.core.scheduler.manager
    manager.check_invariants()
    assert manager.num_free_blocks == manager.num_blocks
    stats = engine.stats()
    assert (stats.running, stats.waiting, stats.kv_blocks_used) == (0, 0, 0)


@pytest.mark.parametrize("kv_blocks", [None, 40])  # 40 blocks of 4 tokens: requests get preempted
def test_sixteen_requests_join_between_steps_and_three_are_aborted(paged_artifact, alone, kv_blocks):
    ids, expected = alone
    engine = fxllm.load(paged_artifact, kv_blocks=kv_blocks)
    core, manager = engine.core, engine.core.scheduler.manager
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(16)}
    finished = {}
    step = 0
    while len(finished) < 16:
        if step % 2 == 0 and step // 2 < 16:  # a request joins every other step, while the others run
            i = step // 2
            core.add_request(f"r{i}", ids[i], SamplingParams(max_tokens=NEW32[i]))
        for rid in (f"r{i}" for i in ABORTED):
            if len(tokens[rid]) == 3 and rid not in finished and core.get_request(rid) is not None:
                request = core.get_request(rid)
                held = manager.block_table(request.seq_id) if request.seq_id in manager else []
                private = sum(manager.ref_count(block) == 1 for block in held)
                free = manager.num_free_blocks
                core.abort(rid)
                assert request.seq_id not in manager and manager.num_free_blocks == free + private
                manager.check_invariants()
        for output in core.step():
            tokens[output.request_id] += output.new_token_ids
            if output.finished:
                finished[output.request_id] = output
        step += 1
        assert step < 2000
    for i in range(16):
        rid = f"r{i}"
        if i in ABORTED:
            assert finished[rid].finish_reason == "abort" and tokens[rid] == expected[i].token_ids[:3]
        else:
            assert tokens[rid] == expected[i].token_ids, rid
            assert finished[rid].finish_reason in ("length", "stop")
            assert finished[rid].num_output_tokens == len(tokens[rid])
    assert_pool_whole(engine)
    stats = engine.stats()
    assert stats.requests_finished == 16 and stats.max_decode_batch > 4
    if kv_blocks is not None:
        assert stats.preemptions > 0


def test_thirty_two_coroutines_on_the_async_engine(paged_artifact, alone):
    ids, expected = alone
    engine = fxllm.load(paged_artifact)
    core, manager, driver = engine.core, engine.core.scheduler.manager, engine.driver
    # Once a request to abort has 3 tokens, the engine holds until its abort is queued: under CPU contention the
    # engine thread could otherwise run it to its end before the starved event loop sees its third token.
    abort_queued = {f"a{i}": threading.Event() for i in ABORTED}
    queue_abort = driver.queue_abort

    def queue_abort_and_release(request_id: str, notify: bool = True) -> None:
        queue_abort(request_id, notify)
        if request_id in abort_queued:
            abort_queued[request_id].set()

    def a_request_to_abort_waits() -> bool:
        return any(len(request.output_token_ids) >= 3 and not queued.is_set()
                   for request_id, queued in abort_queued.items()
                   if (request := core.get_request(request_id)) is not None)

    driver.queue_abort = queue_abort_and_release
    engine.runner.backend = HoldingBackend(engine.runner.backend, a_request_to_abort_waits)

    async def main():
        server = AsyncEngine(engine)
        tokens = {i: [] for i in range(32)}
        outcome = {}

        async def client(i: int) -> None:
            await asyncio.sleep(0.003 * i)  # arrivals spread over the run
            # the aborted ones run long: only their abort ends them
            params = SamplingParams(max_tokens=150, ignore_eos=True) if i in ABORTED else SamplingParams(max_tokens=NEW32[i])
            stream = server.generate(ids[i], params, f"a{i}")
            async with contextlib.aclosing(stream):
                async for output in stream:
                    tokens[i] += output.new_token_ids
                    if output.finished:
                        outcome[i] = output
                    if i == ABORTED[0] and len(tokens[i]) == 3:
                        seq_id = core.get_request(f"a{i}").seq_id
                        break  # the client goes away: closing the iterator aborts the request
            if i == ABORTED[0]:
                assert seq_id not in manager  # its blocks are free as soon as the iterator is closed

        async def end_after_three_tokens(i: int, how: str) -> None:
            while len(tokens[i]) < 3:
                await asyncio.sleep(0.001)
            seq_id = core.get_request(f"a{i}").seq_id
            if how == "cancel":  # a disconnect: the task reading the stream is cancelled
                tasks[i].cancel()
                with pytest.raises(asyncio.CancelledError):
                    await tasks[i]
            else:
                await server.abort(f"a{i}")
            assert seq_id not in manager

        tasks = {i: asyncio.create_task(client(i)) for i in range(32)}
        # side by side: the engine holds for whichever of the two reaches 3 tokens first
        await asyncio.gather(end_after_three_tokens(ABORTED[1], "cancel"), end_after_three_tokens(ABORTED[2], "abort"))
        await asyncio.gather(*(task for i, task in tasks.items() if i != ABORTED[1]))
        assert await server.shutdown(drain_timeout=5.0) == 0
        with pytest.raises(GenerationError, match="shutting down"):
            await anext(server.generate("late", SamplingParams(), "late"))
        return tokens, outcome

    tokens, outcome = asyncio.run(main())
    assert outcome[ABORTED[2]].finish_reason == "abort"
    for i in range(32):
        if i in ABORTED:
            assert tokens[i][:3] == expected[i].token_ids[:3]
        else:
            assert tokens[i] == expected[i].token_ids, i
            assert outcome[i].finished and outcome[i].metrics.time_to_first_token_ms > 0
    assert_pool_whole(engine)


def test_a_batch_that_repeats_a_request_id_names_that_id(paged_artifact):
    """A batch submitted with one id twice is refused whole, naming the repeated id (it named the batch's first id,
    as "already in use by an unfinished request", which it was not)."""
    engine = fxllm.load(paged_artifact, kv_blocks=48)
    params = SamplingParams(max_tokens=2)
    with pytest.raises(GenerationError, match="^request id 'b' is given to more than one request of the batch$"):
        engine.driver.submit([("a", [5], params), ("b", [6], params), ("b", [7], params)], [print] * 3)
    assert not engine.driver.has_work() and engine.stats().waiting == 0


def test_an_aborted_id_is_taken_until_its_end_has_passed(paged_artifact, alone):
    """A request aborted without notice (a cancelled stream) still ends with an output the next step delivers: until
    then its id is refused, naming why, in the driver and the core alike; afterwards the id runs a new request to
    its own end. (A new request of that id got the old one's "abort" at once, and its own tokens went nowhere.)"""
    ids, results = alone
    engine = fxllm.load(paged_artifact)
    driver, first, second = engine.driver, [], []
    driver.submit([("x", ids[0], SamplingParams(max_tokens=NEW32[0]))], [first.append])
    driver.step()
    driver.abort("x", notify=False)
    with pytest.raises(GenerationError, match="^request id 'x' is still in use: its request ended"):
        driver.submit([("x", ids[1], SamplingParams(max_tokens=NEW32[1]))], [second.append])
    with pytest.raises(GenerationError, match="^request id 'x' is still in use: its request ended"):
        engine.core.add_request("x", ids[1], SamplingParams(max_tokens=NEW32[1]))
    driver.step()  # delivers the abort's end to nobody
    driver.submit([("x", ids[1], SamplingParams(max_tokens=NEW32[1]))], [second.append])
    while driver.step():
        pass
    assert len(first) == 1 and not first[0].finished  # the first step's output; nothing after the abort
    assert [t for out in second for t in out.new_token_ids] == results[1].token_ids
    assert second[-1].finish_reason == results[1].finish_reason and sum(out.finished for out in second) == 1
    assert_pool_whole(engine)


def test_bad_input_is_refused_at_once_and_the_core_keeps_running(paged_artifact, alone, caplog):
    ids, expected = alone
    engine = fxllm.load(paged_artifact, kv_blocks=48)
    core = engine.core
    core.add_request("good", ids[0], SamplingParams(max_tokens=NEW32[0]))
    tokens = [t for out in core.step() for t in out.new_token_ids]  # running while the bad requests arrive
    bad = [  # (arguments, message, the argument InvalidArgumentError names, or None for a plain GenerationError)
        (("long", [5] * engine.max_context, SamplingParams()), "the prompt is 256 tokens; the model's context is 256",
         "prompt"),
        (("room", ids[1], SamplingParams(max_tokens=250)), "together more than the model's context of 256 tokens",
         "max_tokens"),
        (("pool", ids[0], SamplingParams(max_tokens=240)), r"needs \d+ KV blocks, but the pool has 48 \(192 tokens\)",
         "max_tokens"),
        (("vocab", [1, 2, 10**6], SamplingParams()), r"prompt\[2\] = 1000000 is not a token id of this model", "prompt"),
        (("float", [1, 2.5], SamplingParams()), r"prompt\[1\] must be an integer, got float 2.5", "prompt"),
        (("text", "a\ud800", SamplingParams()), "prompt is not valid Unicode", "prompt"),
        (("empty", [], SamplingParams()), "the prompt is empty", "prompt"),
        (("stop", ids[1], SamplingParams(stop_token_ids=[10**6])),
         r"stop_token_ids\[0\] = 1000000 is not a token id of this model", "stop_token_ids"),
        (("type", ids[1], {"max_tokens": 4}), "params must be a SamplingParams", "params"),
        ((7, ids[1], SamplingParams()), "request_id must be a non-empty string", "request_id"),
        (("good", ids[1], SamplingParams()), "request id 'good' is already in use", None),
    ]
    for args, message, param in bad:
        with pytest.raises(GenerationError, match=message) as raised:
            core.add_request(*args)
        assert "\n" not in str(raised.value) and getattr(raised.value, "param", None) == param
    for kwargs, name in (({"temperature": float("nan")}, "temperature"), ({"top_p": 1.5}, "top_p"),
                         ({"max_tokens": 0}, "max_tokens"), ({"logprobs": 21}, "logprobs"),
                         ({"stop": [3]}, "stop"), ({"seed": -2**63 - 1}, "seed"), ({"top_k": 2.5}, "top_k"),
                         ({"stop_token_ids": [-1]}, "stop_token_ids"), ({"ignore_eos": 1}, "ignore_eos")):
        with pytest.raises(InvalidArgumentError, match=name) as raised:
            SamplingParams(**kwargs)
        assert raised.value.param == name
    with caplog.at_level(logging.INFO, logger="fxllm.engine"):
        core.abort("never-added")
    assert any("never-added" in record.getMessage() for record in caplog.records)
    while core.has_unfinished():
        tokens += [t for out in core.step() for t in out.new_token_ids]
    assert tokens == expected[0].token_ids
    assert_pool_whole(engine)


def test_a_failing_model_call_fails_only_its_requests(paged_artifact, alone):
    ids, expected = alone
    engine = fxllm.load(paged_artifact)
    failing = FailingBackend(engine.runner.backend)
    assert isinstance(failing, Backend)
    engine.runner.backend = failing
    core = engine.core

    def run(requests: dict[str, int], arm_after: int, rows: int) -> dict:
        for rid, i in requests.items():
            core.add_request(rid, ids[i], SamplingParams(max_tokens=NEW32[i]))
        got, done, step = {rid: [] for rid in requests}, {}, 0
        while core.has_unfinished():
            if step == arm_after:
                failing.arm(rows)
            for output in core.step():
                got[output.request_id] += output.new_token_ids
                if output.finished:
                    done[output.request_id] = output
                    assert core.get_request(output.request_id) is None
            step += 1
        return {rid: (got[rid], done[rid]) for rid in requests}

    # The second call prefills p1 alone: only p1 fails.
    results = run({"p0": 0, "p1": 1, "p2": 2}, arm_after=1, rows=1)
    assert results["p1"][1].finish_reason == "error" and results["p1"][0] == []
    assert results["p1"][1].error == "RuntimeError: injected backend failure"
    for rid, i in (("p0", 0), ("p2", 2)):
        assert results[rid][0] == expected[i].token_ids
    assert_pool_whole(engine)
    # A decode of d0 and d1 fails: both end with "error" (their blocks freed), d2 joins afterwards and completes.
    results = run({"d0": 3, "d1": 4}, arm_after=2, rows=2)
    assert all(done.finish_reason == "error" and got == expected[i].token_ids[:len(got)]
               for (got, done), i in zip(results.values(), (3, 4)))
    assert run({"d2": 5}, arm_after=-1, rows=1)["d2"][0] == expected[5].token_ids
    assert_pool_whole(engine)
    # The blocking API raises the failure as a one-line GenerationError and the engine still serves.
    failing.arm(1)
    with pytest.raises(GenerationError, match="generation failed: RuntimeError: injected backend failure$"):
        engine.generate_ids([ids[6]], max_new_tokens=4)
    assert engine.generate_ids([ids[6]], max_new_tokens=NEW32[6])[0].token_ids == expected[6].token_ids


def test_async_engine_keeps_serving_after_a_failing_call(paged_artifact, alone):
    ids, expected = alone
    engine = fxllm.load(paged_artifact)
    failing = FailingBackend(engine.runner.backend)
    engine.runner.backend = failing

    async def main():
        server = AsyncEngine(engine)

        async def client(i: int) -> list:
            return [out async for out in server.generate(ids[i], SamplingParams(max_tokens=NEW32[i]), f"c{i}")]

        failing.arm(2)  # the first decode of two or more requests fails
        first = await asyncio.gather(*(client(i) for i in range(4)))
        after = await client(4)
        update = engine.core.scheduler.update

        def broken_update(batch, *_):  # a bug inside a step (not a model call): every unfinished request fails
            engine.core.scheduler.update = update
            raise AssertionError("scheduler bug")

        engine.core.scheduler.update = broken_update
        bug = await asyncio.gather(*(client(i) for i in range(2)))
        assert all(outs[-1].finish_reason == "error" and "internal error" in outs[-1].error for outs in bug)
        assert_pool_whole(engine)
        again = await client(5)
        await server.shutdown(drain_timeout=1.0)
        return first, after, again

    first, after, again = asyncio.run(main())
    assert [t for out in again for t in out.new_token_ids] == expected[5].token_ids
    failed = [outs for outs in first if outs[-1].finish_reason == "error"]
    assert len(failed) >= 2 and all(outs[-1].error.startswith("RuntimeError") for outs in failed)
    for i, outs in enumerate(first):
        got = [t for out in outs for t in out.new_token_ids]
        assert got == expected[i].token_ids[:len(got)]
    assert [t for out in after for t in out.new_token_ids] == expected[4].token_ids
    assert_pool_whole(engine)


def test_shutdown_aborts_queued_requests_before_they_run(paged_artifact, alone):
    """shutdown(drain_timeout=0) aborts every unfinished request in one batch before the next step: a request
    queued behind a running one (max_batch 1) ends "abort" without a token. Aborted one at a time, each abort
    waiting for the step lock, the stepping thread ran the queued requests in between (a queued request served
    240 tokens to a server that was told to stop at once)."""
    ids, _ = alone
    engine = fxllm.load(paged_artifact, max_batch=1)

    async def main():
        server = AsyncEngine(engine)
        params = SamplingParams(max_tokens=200, ignore_eos=True)
        running = server.generate(ids[0], params, "running")
        first = await anext(running)
        queued = [asyncio.create_task(collect(server.generate(ids[i], params, f"q{i}"))) for i in range(1, 5)]
        deadline = time.monotonic() + 60
        while engine.core.stats().waiting < 4 and time.monotonic() < deadline:
            await asyncio.sleep(0.001)
        assert await server.shutdown(drain_timeout=0) == 5
        rest = [output async for output in running]
        return first, rest, await asyncio.gather(*queued)

    async def collect(stream) -> list:
        return [output async for output in stream]

    first, rest, queued = asyncio.run(main())
    assert rest[-1].finish_reason == "abort" and len(first.new_token_ids) + sum(len(o.new_token_ids) for o in rest) < 200
    for outputs in queued:
        assert outputs[-1].finish_reason == "abort"
        assert [t for output in outputs for t in output.new_token_ids] == []
    assert_pool_whole(engine)


class ArmedTokenizer:
    """Wraps a real tokenizer; once armed, its next decode raises the given exception (a failing tokenizer, or
    Ctrl-C arriving while the step detokenizes)."""

    def __init__(self, inner):
        self.inner, self.armed = inner, None

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def decode(self, *args, **kwargs):
        exc, self.armed = self.armed, None
        if exc is not None:
            raise exc
        return self.inner.decode(*args, **kwargs)


def test_an_interrupt_inside_a_step_loses_no_other_requests_output(paged_artifact, alone):
    """A KeyboardInterrupt raised while a step applies its tokens (Python raises it wherever the main thread is)
    fails the request it cut in two and goes on up; the other request of that step keeps the token the step made
    (returned by the next step) and ends with exactly the tokens it makes alone. Before, the step's other outputs
    were lost: that request skipped a token, and one that finished in that step never ended."""
    ids, expected = alone
    engine = fxllm.load(paged_artifact)
    core = engine.core
    core.tokenizer = tokenizer = ArmedTokenizer(core.tokenizer)
    outputs: dict[str, list] = {"r0": [], "r1": []}
    for i, request_id in enumerate(outputs):
        core.add_request(request_id, ids[i], SamplingParams(max_tokens=NEW32[i]))

    def take(step_outputs) -> None:
        for output in step_outputs:
            outputs[output.request_id].append(output)

    while min(len(outs) for outs in outputs.values()) < 2:  # both decoding, in the same batch
        take(core.step())
    tokenizer.armed = KeyboardInterrupt()
    with pytest.raises(KeyboardInterrupt):
        core.step()
    while core.has_unfinished():
        take(core.step())
    ends = {request_id: outs[-1] for request_id, outs in outputs.items()}
    cut = [request_id for request_id, end in ends.items() if end.finish_reason == "error"]
    assert len(cut) == 1 and ends[cut[0]].error == "interrupted (KeyboardInterrupt)"
    kept = 1 - int(cut[0][1])
    assert [t for output in outputs[f"r{kept}"] for t in output.new_token_ids] == expected[kept].token_ids
    assert_pool_whole(engine)


def test_a_tokenizer_failure_fails_only_its_request_across_threads(paged_artifact, alone):
    """Two threads share the engine (a stream and a blocking generate, batched together); the tokenizer raises
    once inside a step, on whichever thread drives it: that request's caller gets a GenerationError naming the
    error, the other caller its exact tokens, and every KV block is free. Before, the raw error reached whichever
    caller was stepping and the other request's output of that step was lost."""
    ids, expected = alone
    engine = fxllm.load(paged_artifact)
    engine.core.tokenizer = tokenizer = ArmedTokenizer(engine.core.tokenizer)
    results: dict[int, object] = {}
    both_running = threading.Barrier(2)

    def streamed() -> None:
        tokens = []
        try:
            for output in engine.stream_outputs(ids[0], SamplingParams(max_tokens=NEW32[0])):
                tokens += output.new_token_ids
                if len(tokens) == 2:
                    both_running.wait(timeout=60)
                    tokenizer.armed = ValueError("cannot decode")
            results[0] = tokens
        except Exception as exc:  # noqa: BLE001 - the test records what each caller got
            results[0] = exc

    def blocking() -> None:
        both_running.wait(timeout=60)
        try:
            results[1] = engine.generate_ids([ids[1]], max_new_tokens=NEW32[1])[0].token_ids
        except Exception as exc:  # noqa: BLE001
            results[1] = exc

    threads = [threading.Thread(target=streamed), threading.Thread(target=blocking)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads)
    failed = [i for i, got in results.items() if isinstance(got, Exception)]
    assert len(failed) == 1, results
    assert isinstance(results[failed[0]], GenerationError) and "ValueError: cannot decode" in str(results[failed[0]])
    kept = 1 - failed[0]
    assert results[kept] == expected[kept].token_ids
    assert_pool_whole(engine)


def test_a_request_another_thread_steps_for_returns_without_the_step_lock(paged_artifact, alone):
    """A caller whose request another thread's steps deliver returns once it is done, without ever winning the step
    lock: here the stepping thread never lets go of it. Before, that caller waited for the lock, which a thread
    stepping a long request wins again and again (on SmolLM2 a 5-token request batched with a 300-token one
    returned after 6.6 s instead of 1.2 s, when the long one ended)."""
    ids, expected = alone
    engine = fxllm.load(paged_artifact)
    driver, result = engine.driver, {}
    caller = threading.Thread(target=lambda: result.update(out=engine.generate_ids([ids[1]], max_new_tokens=NEW32[1])))
    with driver._step_lock:  # a thread that steps and never lets go
        caller.start()
        while not driver.has_work():  # the caller's request is queued
            time.sleep(0.001)
        while driver.has_work():
            driver.step_locked()
        caller.join(timeout=30)
        returned = not caller.is_alive()
    caller.join(timeout=30)
    assert returned, "the caller waited for the step lock"
    assert result["out"][0].token_ids == expected[1].token_ids
    # an abort from another thread (a server's disconnect) returns once the stepping thread has applied it
    outputs = []
    driver.submit([("long", ids[0], SamplingParams(max_tokens=100, ignore_eos=True))], [outputs.append])
    with driver._step_lock:
        driver.step_locked()
        aborter = threading.Thread(target=driver.abort, args=("long",))
        aborter.start()
        while driver.core.get_request("long") is not None:
            driver.step_locked()
        aborter.join(timeout=30)
        returned = not aborter.is_alive()
    aborter.join(timeout=30)
    assert returned, "abort waited for the step lock"
    assert outputs[-1].finish_reason == "abort" and len(outputs) < 100
    assert_pool_whole(engine)


class CtrlCBackend(WrappedBackend):
    """Wraps a real backend; once armed, its next call made on the main thread sends this process SIGINT (Ctrl-C)
    in the middle of the model call."""

    def __init__(self, inner: Backend):
        super().__init__(inner)
        self.armed, self.sent = False, False

    def run(self, feeds):
        if self.armed and threading.current_thread() is threading.main_thread():
            self.armed, self.sent = False, True
            os.kill(os.getpid(), signal.SIGINT)
        return self.inner.run(feeds)


def test_ctrl_c_during_a_step_is_raised_after_it(paged_artifact, alone):
    """Ctrl-C while the main thread steps for itself and another thread: the step ends first (no request in it is
    cut in two), then the main thread's call raises KeyboardInterrupt; the other thread's request ends with its
    exact tokens and every KV block comes back. Before, the interrupt landed inside the step: anywhere in the
    scheduler's bookkeeping (leaked blocks, lost requests), ONNX Runtime's bindings, or the model call, which
    failed the whole batch, the other thread's request included."""
    ids, expected = alone
    engine = fxllm.load(paged_artifact)
    backend = engine.runner.backend = CtrlCBackend(engine.runner.backend)
    other: dict[str, object] = {}
    started = threading.Event()

    def other_thread() -> None:
        started.set()
        try:
            other["tokens"] = engine.generate_ids([ids[1]], max_new_tokens=NEW32[1])[0].token_ids
        except Exception as exc:  # noqa: BLE001 - the test checks what the caller got
            other["tokens"] = exc

    thread = threading.Thread(target=other_thread)
    got = []
    # Python's own SIGINT handler, as in a program: a pytest-xdist worker ignores SIGINT
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    with contextlib.ExitStack() as restore, pytest.raises(KeyboardInterrupt):
        restore.callback(signal.signal, signal.SIGINT, previous)
        for output in engine.stream_outputs(ids[0], SamplingParams(max_tokens=200, ignore_eos=True)):
            got += output.new_token_ids
            if len(got) == 2:
                thread.start()
                started.wait(30)
            if len(got) >= 4 and engine.stats().running == 2:  # both decode: the next call is theirs together
                backend.armed = True
    thread.join(timeout=120)
    assert backend.sent and not thread.is_alive()
    assert other["tokens"] == expected[1].token_ids
    engine.driver.flush()  # the interrupted stream's abort
    engine.generate_ids([ids[2]], max_new_tokens=2)  # a step delivers it
    assert_pool_whole(engine)


def test_logprobs_and_stop_conditions(paged_artifact, alone):
    ids, expected = alone
    engine = fxllm.load(paged_artifact)
    prompt, reference = ids[1], expected[1].token_ids
    scores = log_softmax(engine.score(prompt + reference[:5]))
    for attempt in range(2):  # the second run's prompt blocks are cached: prompt logprobs must not use them
        outputs = list(engine.stream_outputs(prompt, SamplingParams(max_tokens=5, logprobs=3, prompt_logprobs=2)))
        assert sum(len(out.logprobs) for out in outputs) == 5 and outputs[-1].finish_reason == "length"
        first = outputs[0].prompt_logprobs
        assert first[0] is None and len(first) == len(prompt)
        assert all(out.prompt_logprobs is None for out in outputs[1:])
        for i in range(1, len(prompt)):
            assert first[i].token_id == prompt[i] and abs(first[i].logprob - scores[i - 1, prompt[i]]) < 1e-4
            assert len(first[i].top) == 2 and first[i].top[0][1] >= first[i].top[1][1]
        chosen = [lp for out in outputs for lp in out.logprobs]
        for j, lp in enumerate(chosen):
            row = scores[len(prompt) - 1 + j]
            assert lp.token_id == reference[j] == lp.top[0][0]  # greedy: the most likely token
            assert abs(lp.logprob - row[reference[j]]) < 1e-4 and len(lp.top) == 3
            assert np.allclose([p for _, p in lp.top], np.sort(row)[::-1][:3], atol=1e-4)

    def final(params: SamplingParams):
        outputs = list(engine.stream_outputs(prompt, params))
        return [t for out in outputs for t in out.new_token_ids], outputs[-1]

    stop_token = reference[2]
    tokens, last = final(SamplingParams(max_tokens=8, stop_token_ids=[stop_token]))
    assert tokens == reference[:reference.index(stop_token) + 1]
    assert (last.finish_reason, last.stop_reason) == ("stop", stop_token)
    engine.eos_token_ids = {reference[1]}
    tokens, last = final(SamplingParams(max_tokens=8))
    assert tokens == reference[:reference.index(reference[1]) + 1] and last.stop_reason == reference[1]
    tokens, last = final(SamplingParams(max_tokens=8, ignore_eos=True))
    assert tokens == reference[:8] and last.finish_reason == "length"
    assert_pool_whole(engine)


def test_a_final_only_request_gets_one_output_with_what_the_deltas_add_up_to(paged_artifact, alone):
    """output_kind "final" (what generate() and generate_ids() ask for): one output, when the request finishes, whose
    tokens, text, logprobs and finish reason are what the per-step outputs of the same request add up to; with and
    without stop strings (decoded as it goes, or once at the end), stop ids, EOS and logprobs."""
    from dataclasses import replace

    ids, expected = alone
    engine = fxllm.load(paged_artifact)
    prompt, reference = ids[4], expected[4]
    text_stop = reference.text[len(reference.text) // 2:][:3]
    engine.eos_token_ids = {reference.token_ids[6]}
    cases = [SamplingParams(max_tokens=12, ignore_eos=True), SamplingParams(max_tokens=12, stop=[text_stop]),
             SamplingParams(max_tokens=12), SamplingParams(max_tokens=12, stop_token_ids=[reference.token_ids[3]]),
             SamplingParams(max_tokens=5, logprobs=2, prompt_logprobs=1, ignore_eos=True),
             SamplingParams(max_tokens=9, temperature=0.8, seed=5, ignore_eos=True)]
    for params in cases:
        deltas = list(engine.stream_outputs(prompt, params))
        final = list(engine.stream_outputs(prompt, replace(params, output_kind="final")))
        assert len(final) == 1 and final[0].finished and len(deltas) > 1, params
        (out,) = final
        assert out.new_token_ids == [t for d in deltas for t in d.new_token_ids], params
        assert out.text_delta == "".join(d.text_delta for d in deltas), params
        assert (out.finish_reason, out.stop_reason) == (deltas[-1].finish_reason, deltas[-1].stop_reason), params
        assert out.num_output_tokens == deltas[-1].num_output_tokens == len(out.new_token_ids)
        if params.logprobs is None:
            assert out.logprobs is None
        else:
            assert out.logprobs == [lp for d in deltas for lp in d.logprobs]
            assert out.prompt_logprobs == deltas[0].prompt_logprobs and len(out.prompt_logprobs) == len(prompt)
    assert {d.finish_reason for d in (list(engine.stream_outputs(prompt, p))[-1] for p in cases)} == {"stop", "length"}
    assert_pool_whole(engine)


def test_contiguous_batches_take_requests_that_arrive_while_one_runs(make_tiny_artifact):
    engine = fxllm.load(make_tiny_artifact("llama"))
    core = engine.core
    ids = [engine.encode(prompt) for prompt in PROMPTS]
    expected = [engine.generate_ids([i], max_new_tokens=10)[0].token_ids for i in ids]
    core.add_request("b0", ids[0], SamplingParams(max_tokens=10))
    core.add_request("b1", ids[1], SamplingParams(max_tokens=10))
    tokens = {f"b{i}": [] for i in range(4)}
    for step in range(40):
        if step == 2:  # joins the queue while b0 and b1 decode: the next batch (b2, b3) starts when they drain
            core.add_request("b2", ids[2], SamplingParams(max_tokens=10))
            core.add_request("b3", ids[3], SamplingParams(max_tokens=10))
        if step == 4:
            core.abort("b1")  # leaves the running batch; b0 continues alone
        for output in core.step():
            tokens[output.request_id] += output.new_token_ids
            if output.request_id in ("b2", "b3") and output.new_token_ids:
                assert len(tokens["b0"]) == 10  # b0's batch drained first
    assert tokens["b0"] == expected[0] and tokens["b1"] == expected[1][:len(tokens["b1"])] and len(tokens["b1"]) < 10
    assert tokens["b2"] == expected[2] and tokens["b3"] == expected[3]
    assert not core.has_unfinished()


def _overlap(engine, prompts: list[str], new_tokens: list[int], threads: int, calls: int, streams: int) -> tuple:
    """`threads` threads × `calls` blocking calls (alternately generate and generate_ids) while this thread reads
    `streams` open streams piece by piece, round robin. Returns (call results by prompt index, stream texts)."""
    import threading

    results, errors = {}, []

    def worker(t: int) -> None:
        try:
            for c in range(calls):
                i = streams + t * calls + c
                if c % 2:
                    results[i] = engine.generate_ids([engine.encode(prompts[i])], max_new_tokens=new_tokens[i])[0]
                else:
                    results[i] = engine.generate(prompts[i], max_new_tokens=new_tokens[i])
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    open_streams = [engine.stream(prompts[i], max_new_tokens=new_tokens[i]) for i in range(streams)]
    texts = [next(stream) for stream in open_streams]  # every stream is open before the threads start
    workers = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    for thread in workers:
        thread.start()
    active = set(range(streams))
    while active:
        for s in sorted(active):
            piece = next(open_streams[s], None)
            if piece is None:
                active.discard(s)
            else:
                texts[s] += piece
    for thread in workers:
        thread.join(timeout=300)
        assert not thread.is_alive()
    assert not errors, errors
    return results, texts


def test_threads_and_open_streams_share_a_paged_engine(paged_artifact, alone):
    """#16: 8 threads × 4 generate calls plus 4 open streams, interleaved, on one engine."""
    _, expected = alone
    engine = fxllm.load(paged_artifact)
    prompts, new_tokens = PROMPTS32 + PROMPTS32[:4], NEW32 + NEW32[:4]
    results, texts = _overlap(engine, prompts, new_tokens, threads=8, calls=4, streams=4)
    assert texts == [expected[i].text for i in range(4)]
    assert {i: r.token_ids for i, r in results.items()} == {i: expected[i % 32].token_ids for i in range(4, 36)}
    assert engine.stats().max_decode_batch > 4  # the callers' requests ran together
    assert_pool_whole(engine)


def test_threads_and_open_streams_share_a_contiguous_engine(make_tiny_artifact):
    engine = fxllm.load(make_tiny_artifact("llama"))
    prompts, new_tokens = PROMPTS32[:12], NEW32[:12]
    expected = [engine.generate(p, max_new_tokens=n) for p, n in zip(prompts, new_tokens)]
    results, texts = _overlap(engine, prompts, new_tokens, threads=4, calls=2, streams=4)
    assert texts == [expected[i].text for i in range(4)]
    assert {i: r.token_ids for i, r in results.items()} == {i: expected[i].token_ids for i in range(4, 12)}
    assert not engine.core.has_unfinished()


@pytest.mark.parametrize("contiguous", [False, True])
def test_a_stream_the_garbage_collector_closes_mid_step_does_not_deadlock(paged_artifact, make_tiny_artifact,
                                                                          contiguous):
    """An abandoned stream caught in a reference cycle is closed by the cycle collector, which may run inside a step
    on the stepping thread: its cleanup waited for the step lock that thread held (a deadlock, single-threaded). It
    now aborts without waiting, and the engine goes on with every block free."""
    import gc

    engine = fxllm.load(make_tiny_artifact("llama") if contiguous else paged_artifact, threads=1)
    expected = engine.generate("Paris is", max_new_tokens=100).token_ids
    results = []

    def run():
        for _ in range(20):  # the collector's default thresholds land a collection inside a step within a few
            stream = engine.stream("The quick brown fox", max_new_tokens=50)
            next(stream)
            cycle = [stream]
            cycle.append(cycle)
            del stream, cycle
            results.append(engine.generate("Paris is", max_new_tokens=100).token_ids)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(120)
    assert not worker.is_alive(), "the engine deadlocked"
    gc.collect()
    assert results == [expected] * 20
    stats = engine.stats()
    assert stats.running == stats.waiting == 0 and stats.kv_blocks_used in (0, None)
