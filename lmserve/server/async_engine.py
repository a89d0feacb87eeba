"""AsyncEngine: one thread drives Engine.step() for every request; asyncio handlers talk to it
through queues, so the event loop never runs a forward pass. It is the server's only door to the
Engine: tokenizer and model facts, tokenize / validate, submit and stream, abort, stats.

Tokenizing and validating (`tokenize`, `process_request`) read only what never changes after
start-up (and the lock-guarded grammar cache), so any thread may run them: handlers run them on a
worker thread (compiling a structured-output grammar may take seconds); the Request they make is
queued as is.

Requests enter and leave only between steps: `generate` and `abort` put work on thread-safe lists that
the loop drains before each step; each request's outputs are pushed to its own asyncio.Queue with
`loop.call_soon_threadsafe`.

The web console's engine view (`view`, server/engine_view.py) is built the same way, only while watched.

Readers on other threads (/metrics, the queue limit) never touch the Engine: the loop publishes a
snapshot of `Engine.stats()` at start, when idle, after a step that follows new arrivals, and
otherwise every STATS_INTERVAL_S (the snapshot walks the KV free queue: not on every step), and they
read that.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from lmserve.config import EngineConfig
from lmserve.engine import Engine, EngineStats
from lmserve.outputs import RequestOutput
from lmserve.sequence import Request, SamplingParams
from lmserve.server.engine_view import EngineView
from lmserve.tokenizer import Tokenizer
from lmserve.utils import EngineFatalError

log = logging.getLogger("lmserve.server")

STATS_INTERVAL_S = 0.05
MAX_UNREAD = 1024  # outputs a request may have waiting for its reader; past it, the reader is too slow


class SlowReaderError(RuntimeError):
    """A request's outputs piled up unread (a client that stopped reading its stream): it was aborted."""


class EngineDeadError(RuntimeError):
    """The engine loop has stopped; no request can be served."""


class QueueFullError(RuntimeError):
    """Too many requests are waiting."""


@dataclass
class _Stream:
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    finished: bool = False
    sent: int = 0  # outputs put (engine thread)
    read: int = 0  # outputs taken (the reader)

    def put(self, item: object) -> bool:
        """Hand an item to the reader's event loop; False when that loop is closed (nobody will read)."""
        self.sent += 1
        return _call_soon(self.loop, self.queue.put_nowait, item)

    @property
    def unread(self) -> int:
        return self.sent - self.read


def _put_all(streams: list[_Stream], item: object) -> None:
    """The same item to many readers, in one callback per event loop: a loop's readers all hold it from
    the same iteration on (a request of several prompts failed by one step sees them fail together, not
    some failed and the rest still running, as one callback each let it)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[asyncio.Queue]] = {}
    for stream in streams:
        stream.sent += 1
        by_loop.setdefault(stream.loop, []).append(stream.queue)
    for loop, queues in by_loop.items():
        _call_soon(loop, _put_each, queues, item)


def _put_each(queues: list[asyncio.Queue], item: object) -> None:
    for q in queues:  # (unbounded queues: put_nowait cannot raise)
        q.put_nowait(item)


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> bool:
    """fn(*args) on `loop` from the engine thread; False when the loop is closed (its reader is gone:
    an event loop that ended with a request in flight must not take the engine loop down with it)."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # "Event loop is closed"
        return False
    return True


def _settle(done: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if not done.done():
        done.set_exception(exc) if exc is not None else done.set_result(result)


class AsyncEngine:
    """Owns the engine thread. All Engine mutation happens on that thread."""

    def __init__(self, engine: Engine, max_queue: int | None = None) -> None:
        self._engine = engine
        self.max_queue = max_queue
        self._lock = threading.RLock()
        self._pending: list[tuple[str, Request, _Stream, float]] = []  # + arrival time (stamped at submit)
        self._aborts: list[str] = []
        self._calls: list[tuple[Callable[[Engine], Any], asyncio.AbstractEventLoop, asyncio.Future]] = []
        self._streams: dict[str, _Stream] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lmserve-engine", daemon=True)
        self.error: BaseException | None = None
        self.on_fatal: Callable[[BaseException], None] | None = None  # the server: exit non-zero
        self.draining = False  # the server got SIGTERM / SIGINT: finishing what is in flight (lmserve serve)
        self._stats = engine.stats()  # no thread yet: safe to read here
        self._stats_at = time.monotonic()
        self._unpublished = 0  # requests handed to the engine since the last snapshot
        self.view = EngineView()  # the web console's snapshots, built only while someone watches

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the engine thread."""
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop; requests still in flight are aborted."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():  # (never started: a server that failed before its lifespan began)
            self._thread.join(timeout)

    def die(self, error: BaseException) -> None:
        """A fatal error (EngineFatalError: a tensor-parallel rank lost), from any thread: /health turns
        503, requests in flight fail, and on_fatal runs."""
        with self._lock:
            first, self.error = self.error is None or not self._stop.is_set(), self.error or error
            self._stop.set()
        self._wake.set()
        if first and self.on_fatal is not None:
            self.on_fatal(error)

    @property
    def thread_alive(self) -> bool:
        """Whether the engine thread still runs (a step may be under way)."""
        return self._thread.is_alive()

    @property
    def alive(self) -> bool:
        """Whether the engine loop is running."""
        return self._thread.is_alive() and self.error is None

    @property
    def stats(self) -> EngineStats:
        """The engine's stats as the engine thread last published them."""
        return self._stats

    @property
    def num_waiting(self) -> int:
        """Requests not yet scheduled: queued here, or waiting in the engine as of the last snapshot."""
        with self._lock:
            return len(self._pending) + self._unpublished + self._stats.num_waiting

    def has_room(self, n: int = 1) -> bool:
        """Whether n more requests may wait without passing max_queue."""
        return self.max_queue is None or self.num_waiting + n <= self.max_queue

    # ------------------------------------------------------------ the model (fixed after start-up)
    @property
    def tokenizer(self) -> Tokenizer | None:
        """The model's tokenizer (None for a model without one)."""
        return self._engine.tokenizer

    @property
    def max_model_len(self) -> int:
        """The most tokens (prompt + output) one sequence may hold."""
        return self._engine.max_model_len

    @property
    def config(self) -> EngineConfig:
        """The engine's options (frozen)."""
        return self._engine.config

    @property
    def vocab_size(self) -> int:
        """Token ids run from 0 to vocab_size - 1."""
        return self._engine.vocab_size

    def info(self) -> dict[str, Any]:
        """The engine's description: model, architecture, dtype, device, max_model_len, load time."""
        return self._engine.info()

    def tokenize(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        """A prompt (text or token ids) -> checked token ids; ValueError naming the field."""
        return self._engine.tokenize_prompt(prompt, add_special_tokens)

    def truncate(self, prompt: str | list[int], ids: list[int], keep: int | None, fill: bool = False) -> list[int]:
        """The prompt's (tokenized as ids) last `keep` tokens (InputProcessor.truncate; fill: an embedding's,
        which may fill the context); ValueError naming the field."""
        return self._engine.inputs.truncate(prompt, ids, keep, fill)

    @property
    def max_logprobs(self) -> int:
        """The most logprobs / prompt_logprobs a request may ask (the engine's max_logprobs, resolved)."""
        return self._engine.inputs.max_logprobs

    def room(self, prompt_len: int, family: int = 1) -> int:
        """The most tokens a request may generate after a prompt of prompt_len tokens (InputProcessor.room)."""
        return self._engine.inputs.room(prompt_len, family)

    def process_request(self, prompt: str | list[int], params: SamplingParams, lora_request: Any = None) -> Request:
        """Tokenize and validate a request once, on the caller's thread; ValueError naming the field."""
        return self._engine.process_request(prompt, params, lora_request)

    def load_lora(self, req: Any) -> None:
        """Load a LoRARequest's adapter now (any thread: the registry locks); ValueError naming the problem."""
        self._engine.inputs.adapter(req)

    def unload_lora(self, lora_int_id: int) -> None:
        """Let an adapter go (requests running with it finish with it)."""
        if self._engine.lora is not None:
            self._engine.lora.remove(lora_int_id)

    # ------------------------------------------------------------ requests
    def submit(self, request_id: str, request: Request) -> _Stream:
        """Queue a processed request now (QueueFullError / EngineDeadError at once, before anything is
        read: a stream's 429 goes out before its headers); `generate(..., stream)` reads its outputs."""
        if not self.alive:
            raise EngineDeadError("the engine loop is not running")
        stream = _Stream(asyncio.Queue(), asyncio.get_running_loop())
        with self._lock:
            if not self.has_room():
                raise QueueFullError(f"{self.max_queue} requests are already waiting")
            if not self.alive or self._stop.is_set():  # (a stopping loop may have failed its last pending ones)
                raise EngineDeadError("the engine loop is not running")
            self._pending.append((request_id, request, stream, time.time()))  # TTFT counts a step's wait too
        self._wake.set()
        return stream

    async def generate(self, request_id: str, request: Request, stream: _Stream | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """Queue a processed request (or read one `submit` queued: `stream`) and yield its outputs step by
        step; aborts it if the consumer goes away."""
        if stream is None:
            stream = self.submit(request_id, request)
        try:
            while True:
                item = await stream.queue.get()
                stream.read += 1
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    stream.finished = True
                    return
        finally:
            if not stream.finished:
                self.abort(request_id)

    async def call(self, fn: Callable[[Engine], Any]) -> Any:
        """fn(engine) on the engine thread between steps (what reads or writes the KV cache: a KV transfer);
        its result, or its exception, here."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()
        with self._lock:  # the loop's last _fail_all takes this lock too: nothing queued after it is lost
            if not self.alive or self._stop.is_set():
                raise EngineDeadError("the engine loop is not running")
            self._calls.append((fn, loop, done))
        self._wake.set()
        return await done

    def watch(self, delta: int) -> None:
        """A web-console viewer connected (+1) or left (-1); on a connection the loop publishes at once."""
        with self._lock:
            self.view.viewers += delta
            if delta > 0:
                self.view.stale()
        self._wake.set()

    def abort(self, request_id: str) -> None:
        """Abort a request (applied between steps)."""
        with self._lock:
            self._aborts.append(request_id)
        self._wake.set()

    # ------------------------------------------------------------ the loop
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain()
                if not self._engine.has_unfinished_requests():
                    self._publish()
                    if self.view.watched:
                        self._watched(self.view.idle)
                    self._wake.wait(0.5)
                    self._wake.clear()
                    continue
                try:
                    outputs = self._engine.step()
                except EngineFatalError:
                    raise
                except Exception as e:  # a failed forward: fail the requests in flight, keep serving
                    log.exception("engine step failed")
                    self._fail_all(e)
                    continue
                for out in outputs:
                    stream = self._streams.get(out.request_id)
                    if stream is None:
                        continue
                    if stream.unread >= MAX_UNREAD and not out.finished:  # the reader stopped reading:
                        self._engine.abort_request(out.request_id)  # drop it, not the engine's memory
                        del self._streams[out.request_id]
                        stream.put(SlowReaderError(f"{MAX_UNREAD} outputs unread: the client is not reading"))
                        continue
                    if not stream.put(out) and not out.finished:  # its reader's loop closed: drop it
                        self._engine.abort_request(out.request_id)
                        del self._streams[out.request_id]
                    elif out.finished:
                        del self._streams[out.request_id]
                if self.view.watched:
                    self._watched(self.view.after_step, outputs)
                if self._unpublished or time.monotonic() - self._stats_at >= STATS_INTERVAL_S:
                    self._publish()
        except BaseException as e:  # the loop itself died: /health turns 503
            log.exception("engine loop died")
            self.error = e
        finally:
            self._fail_all(EngineDeadError("the server is shutting down" if self.error is None else
                                          f"the engine loop died: {type(self.error).__name__}: {self.error}"),
                           pending_too=True)
        if self.error is not None:  # whatever killed the loop: the server exits (on_fatal), as vLLM's does
            self.die(self.error)

    def _drain(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
            aborts, self._aborts = self._aborts, []
            calls, self._calls = self._calls, []
            self._unpublished += len(pending)
        for fn, loop, done in calls:
            try:
                result, exc = fn(self._engine), None
            except Exception as e:  # the caller's alone
                result, exc = None, e
            _call_soon(loop, _settle, done, result, exc)
        for rid, request, stream, arrived in pending:
            try:
                self._engine.add_request(rid, request, arrival_time=arrived)
                self._streams[rid] = stream
            except Exception as e:  # validated already; anything left is this request's alone
                stream.put(e)
        for rid in aborts:
            self._engine.abort_request(rid)
            self._streams.pop(rid, None)

    def _watched(self, fn: Callable[..., None], *args: Any) -> None:
        """A web-console view update: its failure is logged and the view goes dark, the engine goes on."""
        try:
            fn(self._engine, *args)
        except Exception:  # noqa: BLE001
            log.exception("engine view failed; the web console's engine view stops updating")
            self.view.failed = True

    def _publish(self) -> None:
        """Snapshot the engine's stats for readers on other threads (engine thread only)."""
        st = self._engine.stats()
        with self._lock:
            self._stats, self._stats_at, self._unpublished = st, time.monotonic(), 0

    def _fail_all(self, error: BaseException, pending_too: bool = False) -> None:
        """Every request in flight (and, pending_too, every queued one and call) gets `error`; then the
        engine's requests are aborted. The readers are told first: an abort that raises (an engine left
        inconsistent by a failed step) must not leave them waiting forever."""
        _put_all(list(self._streams.values()), error)
        self._streams.clear()
        if pending_too:
            with self._lock:
                pending, self._pending = self._pending, []
                calls, self._calls = self._calls, []
            _put_all([stream for _, _, stream, _ in pending], error)
            for _, loop, done in calls:
                _call_soon(loop, _settle, done, None, error)
        for rid in list(self._engine.requests):
            try:
                self._engine.abort_request(rid)
            except Exception:  # noqa: BLE001
                log.exception("aborting %s after a failure failed", rid)
