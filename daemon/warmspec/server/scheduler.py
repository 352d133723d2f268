"""One engine, one worker thread, requests in order: the asyncio loop never waits on the model.

Transports submit ``Job``s and iterate the returned ``Ticket`` for events (``Delta``s, then one
``Finished``). The worker decodes one job at a time, because on one device interleaving two
decodes only makes both slower, and it keeps the engine's single live cache -- and with it the
prefix cache and the n-gram state -- coherent. Interactive jobs (inline completions) jump the
queue. Cancelling a ticket stops its job within one decode step; a job cancelled while queued
never runs.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import threading
import time
from typing import AsyncIterator

import msgspec

from warmspec_protocol import GenerationStats, SamplingParams

from ..engine import Delta, Engine, EngineError, Finished
from ..workspace import Workspace

log = logging.getLogger("warmspec.scheduler")

PRIORITY_INTERACTIVE = 0
PRIORITY_NORMAL = 10


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


Event = Delta | Finished | JobError


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
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)

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

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="warmspec-engine", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        with self._cv:
            self._stopping = True
            for _, _, t in self._heap:
                t.cancel()
            self._cv.notify_all()
        if self.active is not None:
            self.active.cancel()
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
            if len(self._heap) >= self.max_queue:
                raise Busy(f"queue full ({self.max_queue} requests waiting)")
            heapq.heappush(self._heap, (job.priority, next(self._seq), ticket))
            self._cv.notify()
        return ticket

    # -- worker ---------------------------------------------------------------------------------

    def _next(self) -> Ticket | None:
        with self._cv:
            while not self._heap and not self._stopping:
                self._cv.wait()
            if self._stopping:
                return None
            return heapq.heappop(self._heap)[2]

    def _work(self) -> None:
        while (ticket := self._next()) is not None:
            self.active = ticket
            try:
                self._run(ticket)
            finally:
                self.active = None

    def _run(self, ticket: Ticket) -> None:
        job = ticket.job
        if ticket.cancelled.is_set():
            ticket._push(Finished("cancelled", "", [], GenerationStats(prompt_tokens=len(job.prompt))))
            return
        sources = self.workspace.sources(job.conversation) if self.workspace and job.speculate else ()
        try:
            for event in self.engine.generate(job.prompt, job.params, max_tokens=job.max_tokens,
                                              stop=job.stop, speculate=job.speculate,
                                              sources=sources, prediction=job.prediction,
                                              cancelled=ticket.cancelled.is_set):
                ticket._push(event)
            self.completed += 1
        except EngineError as e:
            self.failed += 1
            ticket._push(JobError(str(e), client_error=True))
        except Exception as e:  # the worker must outlive any one request: log it loudly
            self.failed += 1
            log.exception("request %s failed", job.label or "?")
            self.engine.reset()
            ticket._push(JobError(f"internal error: {type(e).__name__}: {e}", client_error=False))

