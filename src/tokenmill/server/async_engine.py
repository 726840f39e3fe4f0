"""The bridge between asyncio handlers and the (single-threaded) Engine.

One engine thread owns the :class:`~tokenmill.engine.Engine`; nothing else calls it. The lifecycle of one
HTTP request (n choices = n engine requests, one :class:`RequestGroup`):

1. The handler calls :meth:`AsyncEngine.submit`. The bounded queue is checked there (see below); a full
   queue raises :class:`QueueFullError` at once, before anything crosses threads. A choice's constraint
   (structured outputs) is compiled next, on a compile thread within its time budget, so neither the event
   loop nor the engine thread waits on it; a bad one rejects the whole group there.
2. An ``_Add`` command goes on a thread-safe queue and the engine thread is woken. Between two steps the
   thread drains its commands: ``engine.add_request`` for each choice (a ``ValueError`` there rejects the
   whole group, which ``submit`` re-raises), ``engine.abort`` for aborts.
3. The thread steps while the engine has work, and sleeps on an event when it has none (after checking
   the block pool's integrity once: an idle pool must hold every block free or cached, so a leak shows at once).
4. After each step the deltas are grouped per RequestGroup and handed to the event loop with one
   ``loop.call_soon_threadsafe`` per group; the handler reads them from an ``asyncio.Queue``.
5. Each engine request ends exactly once: its first finished delta is delivered and the request is
   forgotten, so anything later for that id is dropped. A disconnecting client calls
   :meth:`RequestGroup.abort`, which the thread turns into ``engine.abort`` before its next step (the
   engine frees the blocks at once and reports the final delta from that step).
6. A step whose forward fails ends only that step's requests (with ``finish_reason="error"``, their blocks
   back in the pool: ``Engine.step``) and the loop goes on. ``max_consecutive_failures`` failed steps in a
   row, or ``engine.step`` raising (a broken invariant), mean the engine is broken: every live request ends
   with ``finish_reason="error"``, ``alive`` turns False (``/health`` answers 503), ``submit`` raises
   :class:`EngineDeadError`, and ``on_dead`` is called (the server exits non-zero so a supervisor restarts
   it). A submit racing with the thread's end is answered too: commands sent after it closed are refused.

The bounded queue: ``max_queue`` bounds the engine requests that are accepted but not running, i.e.
``num_in_flight - num_running`` with ``num_running`` as of the engine's last step (requests still in the
command queue plus the engine's waiting queue, preempted ones included). A request whose choices would
push that past ``max_queue`` is refused with 429 (all n choices or none). Requests in the running batch
never count, so a full batch plus ``max_queue`` waiting are accepted; but a request counts as waiting
until a step admits it, so a burst arriving between two steps is bounded by ``max_queue`` alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenmill.errors import BadRequestError, QueueFullError, UnavailableError
from tokenmill.outputs import RequestDelta, RequestMetrics
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.metrics import EngineSnapshot, RequestEvent, ServerMetrics
from tokenmill.server.observers import AddedRequest, Observers, RequestObserver, current_trace_headers

logger = logging.getLogger("tokenmill.server")

IDLE_POLL_S = 1.0  # how long the idle engine thread sleeps before looking at its queue again
MAX_CONSECUTIVE_FAILURES = 3  # failed steps in a row after which the engine counts as broken


class EngineBrokenError(RuntimeError):
    """Too many steps in a row failed."""


class EngineDeadError(UnavailableError):
    """The engine loop has died (or stopped): answer 503."""


class DrainingError(UnavailableError):
    """The server is shutting down and admits nothing new: answer 503."""


@dataclass
class _Add:
    group: RequestGroup
    prompts: list[tuple[list[int], SamplingParams]]
    arrival_s: float
    cache_salt: str | None = None
    trace_headers: dict[str, str] | None = None
    grammars: list[Any] = field(default_factory=list)  # per prompt: its compiled constraint, or None
    lora_request: Any = None  # the LoRA adapter every prompt runs with (a LoRARequest), or None


@dataclass
class _Run:
    """A function of the engine, run on the engine thread (loading and unloading LoRA adapters)."""

    fn: Callable[[Any], Any]
    future: asyncio.Future[Any]


@dataclass
class _Abort:
    request_ids: list[str]


@dataclass
class _AbortAll:
    reason: str


@dataclass
class _Stop:
    pass


@dataclass
class _Tracked:
    """Engine-thread bookkeeping for one live engine request."""

    group: RequestGroup
    index: int
    arrival_s: float
    added: AddedRequest
    admitted_s: float | None = None
    last_token_s: float | None = None
    announced: bool = False  # prompt tokens counted


class RequestGroup:
    """The async side of one HTTP request: ``n`` engine requests and one queue of ``(index, delta)``.

    Created on the event loop; the engine thread only ever touches it through ``loop.call_soon_threadsafe``.
    """

    def __init__(
        self, engine: AsyncEngine, request_ids: Sequence[str], loop: asyncio.AbstractEventLoop
    ) -> None:
        self._async_engine = engine
        self.request_ids = list(request_ids)
        self.loop = loop
        self.accepted: asyncio.Future[None] = loop.create_future()
        self._queue: asyncio.Queue[tuple[int, RequestDelta]] = asyncio.Queue()
        self._unfinished = set(range(len(self.request_ids)))
        self.aborted_by_client = False

    @property
    def finished(self) -> bool:
        return not self._unfinished

    # --- called on the event loop (scheduled by the engine thread) ------------------------------------
    def _push(self, items: list[tuple[int, RequestDelta]]) -> None:
        for item in items:
            self._queue.put_nowait(item)

    def _resolve(self, error: BaseException | None) -> None:
        if self.accepted.done():
            return
        if error is None:
            self.accepted.set_result(None)
        else:
            self.accepted.set_exception(error)

    # --- the handler's side ---------------------------------------------------------------------------
    async def stream(self) -> AsyncIterator[tuple[int, RequestDelta]]:
        """Every delta of every choice, in arrival order, until each choice has finished once."""
        while self._unfinished:
            index, delta = await self._queue.get()
            if index not in self._unfinished:
                continue  # cannot happen (the engine thread delivers one terminal per id); be safe
            if delta.finished:
                self._unfinished.discard(index)
            yield index, delta

    def abort(self) -> None:
        """The client is gone: abort every unfinished choice (idempotent, safe to call from the loop)."""
        self.aborted_by_client = True
        ids = [self.request_ids[i] for i in sorted(self._unfinished)]
        if ids:
            self._async_engine._send(_Abort(ids))


@dataclass
class _Counters:
    num_in_flight: int = 0
    num_running: int = 0


class AsyncEngine:
    """Owns the engine thread. Handlers call :meth:`submit` and read the returned group's stream."""

    def __init__(
        self,
        engine: Any,
        *,
        max_queue: int = 256,
        metrics: ServerMetrics | None = None,
        idle_poll_s: float = IDLE_POLL_S,
        max_consecutive_failures: int = MAX_CONSECUTIVE_FAILURES,
        on_dead: Callable[[BaseException], None] | None = None,
        observers: Sequence[RequestObserver] = (),
    ) -> None:
        """``observers``: called on the engine thread as requests are added, steps run and requests end (the
        traffic recorder, the tracer: ``server/observers.py``)."""
        if max_queue < 1:
            raise ValueError(f"max_queue must be a positive integer, got {max_queue}")
        if max_consecutive_failures < 1:
            raise ValueError(f"max_consecutive_failures must be positive, got {max_consecutive_failures}")
        self.max_consecutive_failures = max_consecutive_failures
        self.on_dead = on_dead  # called once, on the engine thread, when the loop dies
        self.num_failed_steps = 0  # every failed step, for the record
        self._failures_in_a_row = 0
        self._engine = engine  # the engine thread's alone
        # Read-only facts the handlers may use without crossing into the engine thread.
        self.tokenizer = engine.tokenizer
        self.max_model_len: int = engine.max_model_len
        # the sampling defaults for fields a request leaves unset (generation_defaults.py); an engine double
        # in the tests may have none
        defaults = getattr(engine, "generation_defaults", None)
        self.sampling_defaults: dict[str, Any] = dict(defaults.values) if defaults is not None else {}
        self.model_name: str = engine.model_name
        self.quantization: str | None = engine.quantization
        self.arithmetic: str = engine.arithmetic
        self.is_pooling: bool = bool(getattr(engine, "is_pooling", False))  # an embedding model
        self.embedding_size: int | None = int(engine.loaded.config.hidden_size) if self.is_pooling else None
        loaded = getattr(engine, "loaded", None)
        self.facts = ModelFacts.of(loaded) if loaded is not None else None
        self.clock: Callable[[], float] = getattr(engine, "clock", time.perf_counter)
        self.max_queue = max_queue
        self.metrics = metrics or ServerMetrics(self.model_name)
        self.idle_poll_s = idle_poll_s
        self.observers = Observers(observers)

        self._commands: queue.SimpleQueue[_Add | _Abort | _AbortAll | _Stop] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._lock = threading.Lock()  # guards _counters
        self._counters = _Counters()
        self._tracked: dict[str, _Tracked] = {}  # engine thread only
        self._thread: threading.Thread | None = None
        self._closed = False  # the thread has finished: nothing sent now would be read (guarded by _lock)
        self._stopping = False
        self._draining = False
        self._error: BaseException | None = None
        self._next_id = 0
        self.snapshot = EngineSnapshot()

    # --- lifecycle ------------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._publish()
        self._thread = threading.Thread(target=self._run, name="tokenmill-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._error is None

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def error(self) -> BaseException | None:
        return self._error

    @property
    def num_in_flight(self) -> int:
        with self._lock:
            return self._counters.num_in_flight

    def begin_drain(self) -> None:
        """Admit nothing new from now on; what is in flight keeps running."""
        self._draining = True

    def abort_all(self, reason: str = "shutdown") -> None:
        """Abort every live request (each gets its terminal delta)."""
        self._send(_AbortAll(reason))

    def stop(self, timeout_s: float = 30.0) -> None:
        """Abort what is left, let the thread deliver the terminals, and join it."""
        self._draining = True
        thread = self._thread
        if thread is None or not thread.is_alive():
            return
        self._send(_Stop())
        thread.join(timeout_s)
        if thread.is_alive():
            logger.error("engine thread did not stop within %.1f s", timeout_s)

    # --- submission (event loop) ------------------------------------------------------------------------
    async def submit(
        self,
        prompts: Sequence[tuple[list[int], SamplingParams]],
        request_id: str | None = None,
        cache_salt: str | None = None,
        lora_request: Any = None,
    ) -> RequestGroup:
        """Queue one engine request per ``(prompt_token_ids, params)``; return once the engine accepted them.
        ``lora_request``: the LoRA adapter they run with.

        Raises QueueFullError, DrainingError, EngineDeadError, or the engine's BadRequestError for bad input.
        """
        arrival_s = self.clock()
        self._reserve(len(prompts))
        if request_id is None:
            self._next_id += 1
            request_id = f"req-{self._next_id}"
        try:
            grammars = await self._compile_constraints([sp for _, sp in prompts])
        except BaseException:
            with self._lock:
                self._counters.num_in_flight -= len(prompts)
            raise
        ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        group = RequestGroup(self, ids, asyncio.get_running_loop())
        headers = current_trace_headers.get()
        add = _Add(
            group,
            [(list(p), sp) for p, sp in prompts],
            arrival_s,
            cache_salt,
            headers,
            grammars,
            lora_request,
        )
        if not self._send(add):
            with self._lock:
                self._counters.num_in_flight -= len(prompts)
            raise EngineDeadError(self.dead_message())
        try:
            await asyncio.shield(group.accepted)
        except asyncio.CancelledError:
            group.abort()
            raise
        return group

    def _reserve(self, num_requests: int) -> None:
        """Count ``num_requests`` in flight, or refuse them: BadRequestError for more than the queue could ever
        hold, DrainingError, EngineDeadError, QueueFullError (a 429) while the waiting queue is full."""
        if not num_requests:
            raise ValueError("nothing to submit")
        if num_requests > self.max_queue:  # a 429 would be retried forever: it can never be queued
            raise BadRequestError(
                f"n: the request needs {num_requests} engine requests (n x prompts) and the server queues at "
                f"most {self.max_queue} (--max-queue); it could never be accepted",
                param="n",
            )
        if self._draining:
            raise DrainingError("the server is shutting down")
        if not self.alive:
            raise EngineDeadError(self.dead_message())
        with self._lock:
            waiting = self._counters.num_in_flight - self._counters.num_running
            rejected = waiting + num_requests > self.max_queue
            if not rejected:
                self._counters.num_in_flight += num_requests
        if rejected:
            self.metrics.count_rejection()
            raise QueueFullError(
                f"the server's queue is full ({self.max_queue} requests waiting); retry after a moment"
            )

    async def _compile_constraints(self, params: Sequence[SamplingParams]) -> list[Any]:
        """Each choice's constraint compiled before the engine thread sees it (off the event loop and off the
        engine thread, within the compile's time budget: a compile that overruns is abandoned, not waited
        for); one compile per distinct constraint, a copy of its matcher for each further choice. None where
        a choice has no constraint or the engine compiles its own."""
        compilers = getattr(self._engine, "structured_outputs", None)
        grammars: list[Any] = [None] * len(params)
        if compilers is None or all(sp.structured_outputs is None for sp in params):
            return grammars
        compiler = await asyncio.to_thread(compilers)  # the first one builds llguidance's tokenizer (~1 s)
        compiled: dict[int, Any] = {}
        for index, sp in enumerate(params):
            constraint = sp.structured_outputs
            if constraint is None:
                continue
            if id(constraint) in compiled:
                grammars[index] = compiled[id(constraint)].deep_copy()
                continue
            future = await asyncio.to_thread(compiler.start, constraint)
            try:
                matcher = await asyncio.wait_for(asyncio.wrap_future(future), compiler.compile_timeout_s)
            except TimeoutError:
                raise compiler.timed_out() from None
            compiled[id(constraint)] = grammars[index] = matcher
        return grammars

    def constraint_compiler(self) -> Any:
        """The engine's constraint compiler once a constrained request built it, else None (for /metrics)."""
        return getattr(self._engine, "built_structured_outputs", None)

    async def run_on_engine(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(engine)`` on the engine thread, between steps; its result, or its exception raised here."""
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        if not self._send(_Run(fn, future)):
            raise EngineDeadError(self.dead_message())
        return await future

    def _send(self, command: _Add | _Abort | _AbortAll | _Stop | _Run) -> bool:
        """Queue a command for the engine thread; False when the thread has finished and will not read it."""
        with self._lock:
            if self._closed:
                return False
            self._commands.put(command)
        self._wakeup.set()
        return True

    def dead_message(self) -> str:
        if self._error is not None:
            return f"the engine loop has died: {type(self._error).__name__}: {self._error}"
        return "the engine loop is not running"

    # --- the engine thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        engine = self._engine
        busy = False
        try:
            while True:
                if self._drain_commands():
                    break
                if engine.has_unfinished():
                    start_s = self.clock()
                    result = engine.step()
                    if self.observers:
                        self.observers.on_step(start_s, self.clock(), engine.has_unfinished())
                    self.metrics.observe_step(
                        getattr(result, "roofline_kind", None), getattr(result, "roofline_fraction", None)
                    )
                    self._dispatch(result.deltas, result.record)
                    busy = True
                    error = getattr(result, "error", None)
                    if error is not None:
                        self._on_failed_step(error)
                    else:
                        self._failures_in_a_row = 0
                    continue
                if busy:
                    engine.check_integrity()  # the pool must be whole whenever nothing runs
                    busy = False
                    self._publish()
                if self._stopping:
                    break
                self._wakeup.wait(self.idle_poll_s)
                self._wakeup.clear()
        except BaseException as exc:  # the loop is dead: fail everything, loudly
            logger.exception("engine loop died")
            self._error = exc
            self._fail_all(f"the engine loop has died: {type(exc).__name__}: {exc}")
        finally:
            with self._lock:
                self._closed = True
            self._fail_pending_commands()
            self._publish(alive=False)
            self.observers.close()
            if getattr(engine, "kv_disk", None) is not None:  # the blocks still queued reach the disk
                engine.kv_disk.close()
        if self._error is not None and self.on_dead is not None:
            self.on_dead(self._error)

    def _on_failed_step(self, error: Exception) -> None:
        self.num_failed_steps += 1
        self._failures_in_a_row += 1
        logger.error(
            "step failed (%d in a row, bound %d): its requests ended with an error",
            self._failures_in_a_row,
            self.max_consecutive_failures,
            exc_info=error,
        )
        if self._failures_in_a_row >= self.max_consecutive_failures:
            raise EngineBrokenError(
                f"{self._failures_in_a_row} steps in a row failed; last: {type(error).__name__}: {error}"
            ) from error

    def _drain_commands(self) -> bool:
        """Apply queued commands; True when the thread should exit now (stopped with nothing left)."""
        changed = False
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            changed = True
            if isinstance(command, _Add):
                self._add(command)
            elif isinstance(command, _Run):
                self._run_command(command)
            elif isinstance(command, _Abort):
                for request_id in command.request_ids:
                    if request_id in self._tracked:
                        self._engine.abort(request_id)
            elif isinstance(command, _AbortAll):
                self._abort_tracked()
            else:
                self._stopping = True
                self._draining = True
                self._abort_tracked()
        if changed:
            self._publish()
        return self._stopping and not self._engine.has_unfinished()

    def _run_command(self, command: _Run) -> None:
        future = command.future
        try:
            result = command.fn(self._engine)
        except Exception as exc:
            self._settle(future, None, exc)
        else:
            self._settle(future, result, None)

    @staticmethod
    def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
        def settle() -> None:
            if future.done():
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)

        with contextlib.suppress(RuntimeError):  # a closed event loop: nobody is listening any more
            future.get_loop().call_soon_threadsafe(settle)

    def _abort_tracked(self) -> None:
        for request_id in list(self._tracked):
            self._engine.abort(request_id)

    def _add(self, command: _Add) -> None:
        group = command.group
        added: list[str] = []
        try:
            if self._stopping:
                raise DrainingError("the server is shutting down")
            for index, ((token_ids, params), request_id) in enumerate(
                zip(command.prompts, group.request_ids, strict=True)
            ):
                extra: dict[str, Any] = (
                    {} if command.cache_salt is None else {"cache_salt": command.cache_salt}
                )
                if command.grammars and command.grammars[index] is not None:
                    extra["grammar"] = command.grammars[index]
                if command.lora_request is not None:
                    extra["lora_request"] = command.lora_request
                self._engine.add_request(
                    token_ids, params, request_id=request_id, arrival_time_s=command.arrival_s, **extra
                )
                added.append(request_id)
                record = AddedRequest(
                    request_id,
                    token_ids,
                    params,
                    command.arrival_s,
                    command.cache_salt,
                    command.trace_headers,
                )
                self._tracked[request_id] = _Tracked(group, index, command.arrival_s, record)
        except Exception as exc:
            for request_id in added:
                self._engine.abort(request_id)
                self._tracked.pop(request_id, None)
            # The aborted ones still produce a final delta from the next step; it is dropped (untracked).
            with self._lock:
                self._counters.num_in_flight -= len(group.request_ids)
            self._call(group, group._resolve, exc)
            return
        if self.observers:  # only a group the engine took whole: a refused one never reaches them (no end)
            now_s = self.clock()
            for request_id in group.request_ids:
                self.observers.on_add(self._tracked[request_id].added, now_s)
        self._call(group, group._resolve, None)

    def _dispatch(self, deltas: list[RequestDelta], record: Any) -> None:
        now_s = self.clock()
        events: list[RequestEvent] = []
        for request_id in getattr(record, "admitted_ids", ()):
            tracked = self._tracked.get(request_id)
            if tracked is not None and tracked.admitted_s is None:
                tracked.admitted_s = now_s
                events.append(RequestEvent(queue_time_s=now_s - tracked.arrival_s))
        per_group: dict[RequestGroup, list[tuple[int, RequestDelta]]] = {}
        num_finished = 0
        for delta in deltas:
            tracked = self._tracked.get(delta.request_id)
            if tracked is None:
                continue  # finished already (or never ours): every request ends exactly once
            event = RequestEvent(num_new_tokens=len(delta.new_token_ids))
            if delta.new_token_ids:
                if not tracked.announced:
                    tracked.announced = True
                    event.num_prompt_tokens = delta.num_prompt_tokens
                if tracked.last_token_s is None:
                    event.ttft_s = now_s - tracked.arrival_s
                else:
                    event.itl_s = now_s - tracked.last_token_s
                tracked.last_token_s = now_s
            if delta.finished:
                del self._tracked[delta.request_id]
                num_finished += 1
                if self.observers:
                    self.observers.on_finish(tracked.added, delta)
                event.finish_reason = delta.finish_reason or "stop"
                event.e2e_s = now_s - tracked.arrival_s
                event.metrics = delta.metrics
            events.append(event)
            per_group.setdefault(tracked.group, []).append((tracked.index, delta))
        if num_finished:
            with self._lock:
                self._counters.num_in_flight -= num_finished
        self.metrics.observe_requests(events)
        self._publish()
        for group, items in per_group.items():
            self._call(group, group._push, items)

    def _fail_all(self, message: str) -> None:
        per_group: dict[RequestGroup, list[tuple[int, RequestDelta]]] = {}
        for request_id, tracked in self._tracked.items():
            delta = RequestDelta(
                request_id=request_id,
                new_token_ids=[],
                new_text="",
                finished=True,
                finish_reason="error",
                error=message,
            )
            per_group.setdefault(tracked.group, []).append((tracked.index, delta))
            if self.observers:
                self.observers.on_finish(tracked.added, delta)
        with self._lock:
            self._counters.num_in_flight -= len(self._tracked)
        self.metrics.observe_requests([RequestEvent(finish_reason="error")] * len(self._tracked))
        self._tracked.clear()
        for group, items in per_group.items():
            self._call(group, group._push, items)

    def _fail_pending_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Run):
                self._settle(command.future, None, EngineDeadError(self.dead_message()))
            if isinstance(command, _Add):
                with self._lock:
                    self._counters.num_in_flight -= len(command.group.request_ids)
                error: Exception = (
                    EngineDeadError(self.dead_message())
                    if self._error is not None
                    else DrainingError("the server is shutting down")
                )
                self._call(command.group, command.group._resolve, error)

    def _call(self, group: RequestGroup, fn: Callable[..., None], *args: Any) -> None:
        with contextlib.suppress(RuntimeError):  # a closed event loop: nobody is listening any more
            group.loop.call_soon_threadsafe(fn, *args)

    def _publish(self, alive: bool = True) -> None:
        """Publish a snapshot of the engine's counters (engine thread, or before the thread starts)."""
        engine = self._engine
        stats = engine.stats
        snap = EngineSnapshot(
            num_running=engine.num_running,
            num_waiting=engine.num_waiting,
            kv_cache_usage=float(engine.kv_cache_usage),
            num_free_blocks=engine.num_free_blocks,
            num_total_blocks=engine.num_total_blocks,
            totals=stats.totals(),
        )
        if getattr(engine, "lora_manager", None) is not None:
            running, waiting = engine.lora_requests()
            snap = dataclasses.replace(
                snap,
                max_loras=engine.config.max_loras,
                running_loras=tuple(running),
                waiting_loras=tuple(waiting),
            )
        self.snapshot = snap
        with self._lock:
            self._counters.num_running = snap.num_running
            num_in_flight = self._counters.num_in_flight
        self.metrics.update_engine(
            snap,
            num_in_flight=num_in_flight,
            alive=alive and self._error is None,
            num_failed_steps=self.num_failed_steps,
        )


@dataclass(frozen=True)
class ModelFacts:
    """What the served model is, for the routes that describe it (Ollama's ``/api/show``, ``/api/tags``)."""

    source: str  # the file or directory loaded
    family: str  # the config's model_type
    hidden_size: int
    num_layers: int
    num_parameters: int  # the decoder's matmuls, the token embedding and an untied head
    file_bytes: int
    file_type: str  # the GGUF's own quantization name (Q4_K_M ...), or the tensors' dtype

    @classmethod
    def of(cls, loaded: Any) -> ModelFacts:
        from pathlib import Path

        from tokenmill.measure.cost_model import ModelShape

        config = loaded.config
        shape = ModelShape.from_config(config)
        tied = getattr(config, "tie_word_embeddings", True)
        count = shape.matmul_params + shape.lm_head_params * (1 if tied else 2)
        path = Path(loaded.source)
        size = (
            path.stat().st_size
            if path.is_file()
            else sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
        )
        return cls(
            source=str(path), family=str(config.model_type), hidden_size=int(config.hidden_size),
            num_layers=int(config.num_hidden_layers), num_parameters=int(count), file_bytes=int(size),
            file_type=_file_type(path),
        )  # fmt: skip


def _file_type(path: Any) -> str:
    """A GGUF's quantization as its name says it (``...-q4_k_m.gguf``: Q4_K_M), else its format."""
    import re

    match = re.search(r"[.-](q\d+_[0-9a-z_]+|f16|f32|bf16)\.gguf$", str(path).lower())
    if match:
        return match.group(1).upper()
    return "GGUF" if str(path).endswith(".gguf") else "F32"


@dataclass
class ChoiceResult:
    """Everything one choice produced, gathered from its deltas (non-streaming responses)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)
    prompt_logprobs: list[Any] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    error_kind: str | None = None
    embedding: list[float] | None = None  # an embedding model's vector
    metrics: RequestMetrics | None = None  # from the final delta

    def add(self, delta: RequestDelta) -> None:
        self.text += delta.new_text
        self.token_ids.extend(delta.new_token_ids)
        if delta.new_logprobs:
            self.logprobs.extend(delta.new_logprobs)
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.num_prompt_tokens:
            self.num_prompt_tokens = delta.num_prompt_tokens
        self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)
        if delta.embedding is not None:
            self.embedding = delta.embedding
        if delta.finished:
            self.finish_reason = delta.finish_reason
            self.stop_reason = delta.stop_reason
            self.error, self.error_kind = delta.error, delta.error_kind
            self.metrics = delta.metrics


async def collect(group: RequestGroup) -> list[ChoiceResult]:
    results = [ChoiceResult() for _ in group.request_ids]
    async for index, delta in group.stream():
        results[index].add(delta)
    return results
