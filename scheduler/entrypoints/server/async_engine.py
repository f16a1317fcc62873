"""One engine loop for every connection: the engine steps in a worker thread, streams get asyncio queues.

The event loop never runs the engine: handlers put commands (add, abort, reset the
prefix cache) on a thread-safe queue (a request's LoRA adapter files already read and checked in a
worker thread, :meth:`AsyncEngine.read_lora`: the engine thread never waits on a disk to queue one);
the worker thread applies them between steps, runs
``engine.step``, detokenizes through an :class:`OutputProcessor` and hands
each request's deltas back to its handler's asyncio queue with
``call_soon_threadsafe``. Only the worker thread touches the engine.

A request that fails on its own (its sampling, its detokenization: see
:mod:`scheduler.engine.faults`) gets an error event (:class:`RequestFailed`, a 500 or a stream's
error event) while the others are served on; a failed engine step aborted every request, and
each gets an error event naming the cause.

A beam search (its parameters a :class:`BeamSearchParams`) runs in the same steps as the sampled
requests. Its handler gets an empty event once it is admitted (so a client that leaves is noticed
and the search aborted), then its hypotheses in one event when the search ends. Its metrics count
it as a request whose first token (TTFT) is that final event and whose generation tokens are
those of the hypotheses returned.

An embedding request (its parameters a :class:`PoolingParams`) runs in the same steps too; its handler gets one
event, its :class:`EmbeddingRequestOutput`, after the step that computed its prompt. Its metrics count its prompt
tokens (prefill done at that event: its TTFT) and no generation token.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from paged_kv.errors import PagedKVError
from scheduler.core.lora_request import LoRARequest, request_salt
from scheduler.core.outputs import EmbeddingRequestOutput
from scheduler.core.params import SamplingParams
from scheduler.core.pooling_params import PoolingParams
from scheduler.core.sequence import SequenceGroup
from scheduler.engine.beam_selection import BeamSearchParams, check_beam_fits
from scheduler.engine.llm_engine import LLMEngine
from scheduler.engine.metrics import RequestTimes
from scheduler.engine.request_checks import check_pooling_fits, check_prompt, check_request_fits, longest_sample
from scheduler.entrypoints.output_processor import (
    OutputProcessor,
    SampleDelta,
    TextCompletion,
    TextRequest,
    TextRequestOutput,
)
from scheduler.entrypoints.server.metrics import EngineSnapshot, FinishedRequest, ServerMetrics
from scheduler.runner.lora_manager import ReadLoRA

T = TypeVar("T")

log = logging.getLogger("paged_kv.server")
_STOP = object()
SNAPSHOT_INTERVAL_S = 0.1  # how stale /metrics gauges may be while the engine is busy


class Overloaded(Exception):
    """The server holds as many requests as it may; the client should retry later."""


class RequestFailed(RuntimeError):
    """The request failed inside the engine, alone or with every request of a failed step (a 500 or a stream's
    error event; the engine logged the cause)."""


@dataclass(frozen=True)
class Event:
    """An update of one prompt of a handler's request: new deltas, and the result once it is done."""

    key: int  # index of the prompt within the HTTP request
    deltas: list[SampleDelta]
    result: TextRequestOutput | EmbeddingRequestOutput | None = None
    error: Exception | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None  # when asked for, once the prompt is computed


@dataclass
class _Live:
    """Worker-side state of a request: where its events go, its engine group and its timings."""

    sink: Callable[[Event], None]
    key: int
    arrival: float
    group: SequenceGroup | None = None
    first_token: float | None = None
    last_token: dict[int, float] = field(default_factory=dict)  # per sample: when its latest tokens came


class AsyncEngine:
    """Serves concurrent requests from one engine stepped by one worker thread."""

    def __init__(self, engine: LLMEngine, tokenizer, *, max_in_flight: int = 256, metrics: ServerMetrics | None = None,
                 model_name: str = "paged-kv") -> None:  # fmt: skip
        """``model_name``: the served name, the ``model_name`` label of the metrics made here (unless ``metrics``)."""
        self.engine = engine
        self.processor = OutputProcessor(engine, tokenizer)
        self.max_in_flight = max_in_flight
        self.metrics = metrics or ServerMetrics(model_name, engine.model.config.max_position_embeddings)
        self.num_in_flight = 0  # requests admitted and not yet done; event-loop thread only
        self.num_aborted = 0  # requests aborted by their client; worker thread only
        self.pinned = bool(engine.block_manager.pinned)  # prefixes pinned at start-up, held unchanged until shutdown
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[str, _Live] = {}  # worker thread only
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._snapshot_time = 0.0

    # -- lifecycle --------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread."""
        self._thread = threading.Thread(target=self._run, name="paged-kv-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Abort what is live and stop the engine thread."""
        if self._thread is not None:
            self._commands.put(_STOP)
            self._thread.join()
            self._thread = None

    # -- admission (event-loop thread) -------------------------------------
    def max_new_tokens(self, prompt_len: int, n: int, pinned: int = 0) -> int:
        """The most tokens each of ``n`` samples of a prompt can generate: model context and KV pool (beside the
        ``pinned`` blocks pinned prefixes hold that it does not share)."""
        pool = self.engine.block_manager.config
        usable = pool.num_blocks - pool.watermark_blocks - pinned
        fits = longest_sample((usable // n) * pool.block_size)  # each sample's share of the KV slots
        return min(self.engine.model.config.max_position_embeddings, fits) - prompt_len

    def pinned_apart(self, prompt_token_ids: list[int], cache_salt: str | None, lora: ReadLoRA | None = None) -> int:
        """Blocks the start-up pins hold that a prompt (through ``lora``'s adapter: its salt, as the engine's) would
        not share (their blocks and index never change while the server runs, so this reads them off the engine
        thread); 0 without pins."""
        if not self.pinned:
            return 0
        salt = request_salt(cache_salt, lora)
        return self.engine.block_manager.num_pinned_blocks_apart(prompt_token_ids, cache_salt=salt)

    async def read_lora(self, lora_request: LoRARequest | ReadLoRA | None) -> ReadLoRA | None:
        """A request's adapter read and checked in a worker thread (off the event loop and the engine thread; the
        loaded one if loaded from the same folder); typed errors. None: the base model."""
        if lora_request is None or isinstance(lora_request, ReadLoRA):
            return lora_request
        loras = self.engine.runner.loras
        if loras is None:  # the engine's own refusal: raises at once, touching nothing
            self.engine.load_lora(lora_request)
        return await asyncio.to_thread(loras.read, lora_request)

    def check(self, prompt_token_ids: list[int], params: SamplingParams | BeamSearchParams | PoolingParams,
              lora: ReadLoRA | None = None) -> None:  # fmt: skip
        """Raise (a PagedKVError) if the engine could never serve the request (through ``lora``); reads only what
        never changes while serving (the config, the EOS ids, the start-up pins)."""
        prompt = check_prompt(prompt_token_ids, self.engine.model.config.vocab_size)
        e = self.engine
        if isinstance(params, PoolingParams):
            e.pooler.config.resolve(params, e.model.config.hidden_size)
            check_pooling_fits(len(prompt), e.model.config, e.config.scheduler, e.block_manager.config,
                               pinned_blocks=self.pinned_apart(prompt, None))  # fmt: skip
            return
        beam = isinstance(params, BeamSearchParams)
        sampling = params.engine_params() if beam else params
        check_request_fits(len(prompt), sampling, e.model.config, e.config.scheduler, e.block_manager.config,
                           pinned_blocks=self.pinned_apart(prompt, params.cache_salt, lora))  # fmt: skip
        if beam:
            check_beam_fits(len(prompt), params, e.scheduler.eos_token_ids, e.model.config)

    async def generate(self, prompts: list[tuple[list[int], str | None]],
                       params: list[SamplingParams | BeamSearchParams | PoolingParams], *, priority: int = 0,
                       lora_request: LoRARequest | ReadLoRA | None = None) -> AsyncIterator[Event]:  # fmt: skip
        """Run every prompt (a beam search for BeamSearchParams, an embedding request for PoolingParams), through
        ``lora_request``'s adapter if given (its files read here, in a worker thread, unless already read); yield
        events until each is done. Closing the iterator early aborts what is left.

        ``priority`` (vLLM's: lower is more important) orders the eviction of the requests' cached blocks,
        and their scheduling under ``scheduling_policy="priority"``.

        Raises Overloaded when the server is full and a PagedKVError on a request it can never serve,
        both before anything is queued.
        """
        if self.num_in_flight + len(prompts) > self.max_in_flight:
            raise Overloaded(f"{self.num_in_flight} requests in flight, at most {self.max_in_flight}")
        lora = await self.read_lora(lora_request)
        for (ids, _), p in zip(prompts, params):
            self.check(ids, p, lora)
        loop, events = asyncio.get_running_loop(), asyncio.Queue()
        sink = lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev)  # noqa: E731
        rids = [f"req-{next(self._ids)}" for _ in prompts]
        now, left = time.perf_counter(), set(range(len(prompts)))
        self.num_in_flight += len(prompts)
        try:
            for key, (rid, (ids, text), p) in enumerate(zip(rids, prompts, params)):
                self._commands.put(("add", rid, ids, text, p, priority, lora, _Live(sink, key, now)))
            while left:
                ev = await events.get()
                if ev.result is not None or ev.error is not None:
                    left.discard(ev.key)
                yield ev
        finally:
            self.num_in_flight -= len(prompts)
            for key in left:
                self._commands.put(("abort", rids[key]))

    async def reset_prefix_cache(self) -> int:
        """Forget the engine's cached blocks on the engine thread between two steps; the device blocks forgotten."""
        return await self.call(self.engine.reset_prefix_cache)

    async def call(self, work: Callable[[], T]) -> T:
        """``work()`` run on the engine thread between two steps; its result, or what it raised."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._commands.put(("call", work, lambda result: loop.call_soon_threadsafe(_resolve, done, result)))
        return await done

    # -- the worker thread -------------------------------------------------
    def _run(self) -> None:
        while True:
            block = not self.processor.has_unfinished()
            commands = [self._commands.get()] if block else []
            while True:
                try:
                    commands.append(self._commands.get_nowait())
                except queue.Empty:
                    break
            for command in commands:
                if command is _STOP:
                    self._abort_all()
                    return
                self._apply(command)
            if self.processor.has_unfinished():
                self._step()  # publishes the gauges itself
            else:
                self._snapshot()

    def _snapshot(self) -> None:
        """Publish the engine's gauges: when idle, else at most every SNAPSHOT_INTERVAL_S (stats cost O(blocks))."""
        now = time.perf_counter()
        if not self.processor.has_unfinished() or now - self._snapshot_time >= SNAPSHOT_INTERVAL_S:
            self.metrics.snapshot = EngineSnapshot.of(self.engine)
            self._snapshot_time = now

    def _apply(self, command: tuple) -> None:
        """Run one handler's command on the engine thread: ("add", ...), ("abort", rid) or ("call", work, reply)."""
        if command[0] == "call":
            self._call(*command[1:])
        elif command[0] == "add":
            self._add(*command[1:])
        elif command[1] in self._live:  # abort of a request still running
            self._abort(command[1])

    def _add(self, rid: str, ids: list[int], text: str | None,
             params: SamplingParams | BeamSearchParams | PoolingParams, priority: int,
             lora_request: ReadLoRA | None, live: _Live) -> None:  # fmt: skip
        """Queue a request (a beam search for BeamSearchParams, an embedding request for PoolingParams: never
        through an adapter; an adapter already read, only placed in the host LRU here); a refused one gets its
        error event."""
        beam = isinstance(params, BeamSearchParams)
        add = self.processor.add_beam_search if beam else self.processor.add
        try:
            if isinstance(params, PoolingParams):
                self.processor.add_embedding(rid, ids, params, priority=priority)
            else:
                add(rid, ids, params, text, priority=priority, lora_request=lora_request)
        except Exception as e:  # PagedKVError: a bad request (400); anything else: a bug, still answered
            _send(live, Event(live.key, [], error=e))
            return
        live.group = self.engine.scheduler.requests[rid]  # its timestamps, for the metrics
        self._live[rid] = live
        if beam:  # admitted: its handler may answer (and watch its client) before the search ends
            _send(live, Event(live.key, []))

    def _abort(self, rid: str) -> None:
        """Abort a live request (its client left) and record it."""
        live = self._live.pop(rid)
        try:
            req = self.processor.abort(rid)
        except Exception:  # a bug; the loop must keep serving the others
            log.exception("abort of %s failed", rid)
            req = None
        self._record(live, _outputs(req), time.perf_counter(), "abort")
        self.num_aborted += 1

    def _call(self, work: Callable[[], object], reply: Callable[[object], None]) -> None:
        """Run a handler's ``work``; ``reply`` gets its result, or the exception (a PagedKVError: a 400)."""
        try:
            result = work()
        except Exception as e:  # the loop keeps serving
            if not isinstance(e, PagedKVError):
                log.exception("engine-thread call failed")
            result = e
        with contextlib.suppress(RuntimeError):  # the handler's event loop is closed: the server is shutting down
            reply(result)

    def _step(self) -> None:
        try:
            changed = self.processor.step()
        except Exception as e:  # the engine aborted every request (it logged the cause): fail them all
            log.error("engine step failed, every live request aborted: %s: %s", type(e).__name__, e)
            self._abort_all(RequestFailed(f"engine step failed, every request aborted: {type(e).__name__}: {e}"))
            self._snapshot()
            return
        now = time.perf_counter()
        self.metrics.record_step(self.engine.metrics.steps[-1].num_batched_tokens)
        events = [self._update(req, deltas, done, now) for req, deltas, done in changed]
        events += [self._embedded(out, now) for out in self.processor.take_embedded()]
        self._snapshot()  # before the events: a client's last answer is never ahead of /metrics
        for live, event in events:
            _send(live, event)

    def _update(self, req: TextRequest, deltas: list[SampleDelta], done: bool, now: float) -> tuple[_Live, Event]:
        """Count a request's new tokens (and its end); the event for its handler."""
        live = self._live[req.request_id]
        self._count_tokens(req, live, deltas, now)
        scored = req.last.prompt_logprobs if req.last else None
        if not done:
            return live, Event(live.key, deltas, prompt_logprobs=scored)
        del self._live[req.request_id]
        result = req.result()
        self._record(live, result.outputs, now, "abort" if result.error is None else "error")
        if result.error is not None:  # this request alone failed
            return live, Event(live.key, [], error=RequestFailed(f"request failed: {result.error}"))
        return live, Event(live.key, deltas, result, prompt_logprobs=scored)

    def _embedded(self, out: EmbeddingRequestOutput, now: float) -> tuple[_Live, Event]:
        """Count a finished embedding request (its prompt tokens, no generation); the event for its handler."""
        live = self._live.pop(out.request_id)
        if out.error is not None:
            self._record(live, [], now, "error")
            return live, Event(live.key, [], error=RequestFailed(f"request failed: {out.error}"))
        live.first_token = now
        self.metrics.record_first_token(len(out.prompt_token_ids), now - live.arrival)
        self._record(live, [], now, "stop")
        return live, Event(live.key, [], out)

    def _count_tokens(self, req: TextRequest, live: _Live, deltas: list[SampleDelta], now: float) -> None:
        """Token counters: the request's first token (prefill done), each sample's new tokens and their interval."""
        for d in deltas:
            if not d.token_ids:
                continue
            if live.first_token is None:
                live.first_token = now
                self.metrics.record_first_token(len(req.prompt_token_ids), now - live.arrival)
            last = live.last_token.get(d.index)
            self.metrics.record_tokens(len(d.token_ids), None if last is None else now - last)
            live.last_token[d.index] = now

    def _record(self, live: _Live, samples: list[TextCompletion], now: float, default: str) -> None:
        """Count a request at its end: every one of its ``n`` samples by finish reason (``default`` if unknown)."""
        params = live.group.params
        reasons = [s.finish_reason or default for s in samples]
        tokens = [len(s.token_ids) for s in samples]
        missing = params.n - len(samples)  # samples never forked or never seen
        self.metrics.record_finished(FinishedRequest(
            reasons=(*reasons, *[default] * missing), prompt_tokens=len(live.group.prompt_token_ids),
            generation_tokens=(*tokens, *[0] * missing), max_tokens=params.max_tokens, e2e=now - live.arrival,
            times=RequestTimes.of(live.group),
        ))  # fmt: skip

    def _abort_all(self, error: Exception | None = None) -> None:
        reason = "abort" if error is None else "error"
        for rid, live in list(self._live.items()):
            try:
                req = self.processor.abort(rid)
            except Exception:  # after a failed step the engine may not know the request any more
                req = self.processor.requests.pop(rid, None)
            self._record(live, _outputs(req), time.perf_counter(), reason)
            _send(live, Event(live.key, [], error=error or RuntimeError("the server is shutting down")))
        self._live.clear()


def _outputs(req: TextRequest | None) -> list[TextCompletion]:
    """The samples of a request that ended early (none if the text layer had already dropped it)."""
    return req.result().outputs if req is not None else []


def _resolve(future: asyncio.Future, result: object) -> None:
    """Settle a handler's future with a result (an exception: raised in the handler) unless it gave up."""
    if future.done():
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)


def _send(live: _Live, event: Event) -> None:
    """Hand an event to its handler's event loop (gone if the server is shutting down)."""
    try:
        live.sink(event)
    except RuntimeError:  # event loop closed
        pass
