"""One engine, one worker thread, requests in order: the asyncio loop never waits on the model.

Transports submit ``Job``s and iterate the returned ``Ticket`` for events (``Delta``s, then one
``Finished``). The worker decodes one job at a time, because on one device interleaving two
decodes only makes both slower, and it keeps the engine's single live cache -- and with it the
prefix cache and the n-gram state -- coherent. Interactive jobs (inline completions) jump the
queue -- but not forever: a job that has waited ``STARVE_S`` runs next whatever keeps arriving
ahead of it (three editors typing kept agents' chats waiting for minutes in a soak run). Cancelling a ticket stops its job within one prefill chunk or decode step; a job cancelled
while queued never runs.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import threading
import time
from collections import deque
from typing import AsyncIterator

import msgspec


from ..core import Delta, Engine, EngineError, Finished, GenerationStats, SamplingParams
from ..core import heap
from ..workspace import Workspace
from .keepalive import Progress

log = logging.getLogger("warmspec.scheduler")

PRIORITY_INTERACTIVE = 0
PRIORITY_NORMAL = 10
# A queued job waiting this long runs before jobs of higher priority that arrived after it. Ghost
# text asks on every keystroke; without a bound, editors typing starve an agent's chat.
STARVE_S = 2.0
# The C heap is trimmed after a job at most this often: a few milliseconds each (soak: the queue
# never emptied, so "when idle" never came).
TRIM_EVERY_S = 1.0


class Job(msgspec.Struct, kw_only=True):
    """One generation request as the engine sees it: token ids, not text."""

    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    stop: list[str] = []
    speculate: bool = True
    priority: int = PRIORITY_NORMAL
    conversation: str | None = None  # ranks files read in this conversation first
    label: str = ""  # for logs: transport and request id
    prediction: list[int] = []  # the client's predicted output (OpenAI's), drafted first


class Busy(EngineError):
    """The daemon cannot take the job now (queue full, shutting down): retry later."""


class JobError(msgspec.Struct):
    """The job failed; ``client_error`` separates bad requests from daemon faults."""

    message: str
    client_error: bool


Event = Delta | Finished | JobError | Progress


class Ticket:
    """A submitted job: async-iterate it for events; ``cancel()`` from anywhere."""

    def __init__(self, job: Job, loop: asyncio.AbstractEventLoop):
        self.job = job
        self.loop = loop
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.cancelled = threading.Event()
        self.submitted = time.perf_counter()
        self.done = False

    def cancel(self) -> None:
        self.cancelled.set()

    def _push(self, event: Event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # its event loop has closed (shutdown): nobody is left to tell
            log.debug("dropped an event for %s: its event loop is closed", self.job.label or "?")

    async def __aiter__(self) -> AsyncIterator[Event]:
        while not self.done:
            event = await self.events.get()
            if isinstance(event, (Finished, JobError)):
                self.done = True
            yield event

    async def next_event(self, timeout: float | None = None) -> Event:
        """The next event, or ``asyncio.TimeoutError`` after ``timeout`` seconds (keep-alives)."""
        event = await asyncio.wait_for(self.events.get(), timeout)
        if isinstance(event, (Finished, JobError)):
            self.done = True
        return event


class Scheduler:
    def __init__(self, engine: Engine, *, workspace: Workspace | None = None, max_queue: int = 256):
        self.engine = engine
        self.workspace = workspace
        self.max_queue = max_queue
        self._heap: list[tuple[int, int, Ticket]] = []
        self._seq = itertools.count()
        self._cv = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.active: Ticket | None = None
        self.completed = 0
        self.failed = 0
        self.keepalive = None  # keepalive.KeepAlive: idle unload, reload before the next job
        self.recent: deque[GenerationStats] = deque(maxlen=64)  # finished jobs, for the status page
        self._trimmed = 0.0  # when the C heap was last trimmed

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="warmspec-engine", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Refuse new jobs, answer every queued one with Finished("cancelled") (they never
        run), stop the active one within a prefill chunk or decode step, and wait for it."""
        with self._cv:
            self._stopping = True
            queued, self._heap = self._heap, []
            active = self.active  # under the lock: _next hands a job over and marks it active at once
            self._cv.notify_all()
        for _, _, t in queued:
            t.cancel()
            t._push(_cancelled(t.job))
        if active is not None:
            active.cancel()
        if self._thread is not None:
            self._thread.join(timeout=30)

    # -- submission -----------------------------------------------------------------------------

    @property
    def queue_depth(self) -> int:
        return len(self._heap)

    def submit(self, job: Job) -> Ticket:
        """Queue ``job``; raises ``Busy`` when the queue is full or the daemon is stopping."""
        ticket = Ticket(job, asyncio.get_running_loop())
        with self._cv:
            if self._stopping:
                raise Busy("the daemon is shutting down")
            gone = self._drop_cancelled()
            if len(self._heap) >= self.max_queue:
                raise Busy(f"queue full ({self.max_queue} requests waiting)")
            heapq.heappush(self._heap, (job.priority, next(self._seq), ticket))
            self._cv.notify()
        for t in gone:
            t._push(_cancelled(t.job))
        return ticket

    def _drop_cancelled(self) -> list[Ticket]:
        """Take the cancelled tickets out of the queue (under the lock). Ghost text is superseded on
        every keystroke: left queued behind one long prefill, three typing editors filled the
        256-slot queue with dead tickets and every other request was refused as busy (soak)."""
        if not any(t.cancelled.is_set() for _, _, t in self._heap):
            return []
        gone = [t for _, _, t in self._heap if t.cancelled.is_set()]
        self._heap = [e for e in self._heap if not e[2].cancelled.is_set()]
        heapq.heapify(self._heap)
        return gone

    # -- worker ---------------------------------------------------------------------------------

    def _next(self) -> Ticket | None:
        idle = self.keepalive
        while True:
            with self._cv:
                while not self._heap and not self._stopping:
                    wait = idle.wait_s() if idle is not None else None
                    if wait is not None and wait <= 0:
                        break
                    self._cv.wait(wait)
                if self._stopping:
                    return None
                if self._heap:
                    self.active = self._take()
                    return self.active
            idle.idle()  # idle past the keep-alive: unload, outside the lock (submit never waits)

    def _take(self) -> Ticket:
        """The next job: the highest priority, first come first served -- unless one has waited
        ``STARVE_S`` behind jobs that jumped it: then the one that waited longest. Under the lock."""
        top = self._heap[0][2]
        now = time.perf_counter()
        starved = [e for e in self._heap if e[2].job.priority > top.job.priority
                   and now - e[2].submitted >= STARVE_S]
        if not starved:
            return heapq.heappop(self._heap)[2]
        entry = min(starved, key=lambda e: e[1])
        self._heap.remove(entry)
        heapq.heapify(self._heap)
        return entry[2]

    def _work(self) -> None:
        while (ticket := self._next()) is not None:
            try:
                self._run(ticket)
            finally:
                self.active = None
                if self.keepalive is not None:
                    self.keepalive.done()
            if time.perf_counter() - self._trimmed >= TRIM_EVERY_S:  # core/heap.py says why
                heap.trim()
                self._trimmed = time.perf_counter()

    def _run(self, ticket: Ticket) -> None:
        job = ticket.job
        if ticket.cancelled.is_set():
            ticket._push(_cancelled(job))
            return
        if self.keepalive is not None and (why := self.keepalive.ready(ticket._push)) is not None:
            self.failed += 1
            ticket._push(JobError(f"the model could not be reloaded: {why}", client_error=False))
            return
        sources = self.workspace.sources(job.conversation) if self.workspace and job.speculate else ()
        try:
            for event in self.engine.generate(job.prompt, job.params, max_tokens=job.max_tokens,
                                              stop=job.stop, speculate=job.speculate,
                                              sources=sources, prediction=job.prediction,
                                              cancelled=ticket.cancelled.is_set):
                ticket._push(event)
                if isinstance(event, Finished):
                    self.recent.append(event.stats)
            self.completed += 1
        except EngineError as e:
            self.failed += 1
            ticket._push(JobError(str(e), client_error=True))
        except Exception as e:  # the worker must outlive any one request: log it loudly
            self.failed += 1
            log.exception("request %s failed", job.label or "?")
            self.engine.reset()
            ticket._push(JobError(f"internal error: {type(e).__name__}: {e}", client_error=False))


def _cancelled(job: Job) -> Finished:
    """The answer to a job that never ran."""
    return Finished("cancelled", "", [], GenerationStats(prompt_tokens=len(job.prompt)))
