"""The scheduler's lifecycle on a tiny model: shutdown answers every ticket, and the worker
outlives the event loops of the clients it answers."""

from __future__ import annotations

import asyncio

import numpy as np

from warmspec.core.engine import Finished
from warmspec.server.scheduler import Job, Scheduler
from warmspec.core import SamplingParams

import tiny
from conftest import wait_idle
from test_engine import CountingModel, tiny_engine

PROMPT = np.random.default_rng(9).integers(0, tiny.VOCAB, 300).tolist()


def held_scheduler() -> tuple[Scheduler, CountingModel]:
    """A started scheduler whose first forward pass waits until ``release`` is set."""
    engine = tiny_engine(tiny.build("llama"))
    counting = CountingModel(engine.model, hold=True)
    engine.model = counting
    scheduler = Scheduler(engine)
    scheduler.start()
    return scheduler, counting


def job(max_tokens: int = 4) -> Job:
    return Job(prompt=PROMPT, params=SamplingParams(), max_tokens=max_tokens)


async def until_finished(ticket) -> list:
    """The ticket's events up to its Finished; fails (no hang) if that never comes."""
    async def collect():
        return [ev async for ev in ticket]
    return await asyncio.wait_for(collect(), timeout=60)


def test_stop_finishes_queued_and_active_tickets():
    scheduler, counting = held_scheduler()

    async def scenario():
        active = scheduler.submit(job())
        queued = [scheduler.submit(job()), scheduler.submit(job())]
        assert await asyncio.to_thread(counting.entered.wait, 60)
        stopping = asyncio.ensure_future(asyncio.to_thread(scheduler.stop))
        for _ in range(6000):  # stop() has cancelled the active job once its flag is set
            if active.cancelled.is_set():
                break
            await asyncio.sleep(0.01)
        counting.release.set()
        events = [await until_finished(t) for t in (active, *queued)]
        await stopping
        return events

    try:
        events = asyncio.run(scenario())
    finally:
        counting.release.set()
        scheduler.stop()
    for evs in events:
        assert isinstance(evs[-1], Finished) and evs[-1].finish_reason == "cancelled"
    assert counting.calls == 1  # the active job stopped after the chunk in flight
    assert not scheduler._thread.is_alive()


def test_worker_survives_a_client_loop_that_closed():
    """A client's event loop closes while its job runs (a transport shut down): the worker's
    pushes go nowhere, the job is not counted as failed, and the next job is served."""
    scheduler, counting = held_scheduler()

    async def submit_and_leave():
        scheduler.submit(job())
        assert await asyncio.to_thread(counting.entered.wait, 60)

    async def next_job():
        return await until_finished(scheduler.submit(job(2)))

    try:
        asyncio.run(submit_and_leave())  # its loop is closed from here on
        counting.release.set()
        wait_idle(scheduler)
        assert scheduler._thread.is_alive() and scheduler.failed == 0
        events = asyncio.run(next_job())
    finally:
        counting.release.set()
        scheduler.stop()
    assert events[-1].finish_reason == "length" and len(events[-1].tokens) == 2


def test_a_waiting_job_is_not_starved_by_interactive_ones(monkeypatch):
    """Ghost text jumps the queue, but a job that has waited STARVE_S runs next: editors typing
    must not keep an agent's chat waiting for minutes. The queue is ordered by hand (the worker is
    not started), with the clock moved instead of waited on."""
    import time

    from warmspec.server import scheduler as sch

    s = Scheduler(tiny_engine(tiny.build("llama")))
    now = [1000.0]
    monkeypatch.setattr(sch.time, "perf_counter", lambda: now[0])

    async def scenario():
        chat = s.submit(job())
        ghosts = [s.submit(Job(prompt=PROMPT, params=SamplingParams(), max_tokens=2,
                               priority=sch.PRIORITY_INTERACTIVE)) for _ in range(3)]
        with s._cv:
            first = s._take()
        assert first is ghosts[0]  # interactive first while the chat has not waited long
        now[0] += sch.STARVE_S
        with s._cv:
            second = s._take()
        assert second is chat  # it waited STARVE_S behind them: its turn
        with s._cv:
            assert s._take() is ghosts[1]

    asyncio.run(scenario())


def test_cancelled_queued_tickets_leave_the_queue_and_are_answered():
    """Superseded ghost text must not fill the queue behind a long job: cancelled tickets are
    dropped at the next submission, each answered with Finished('cancelled')."""
    s = Scheduler(tiny_engine(tiny.build("llama")), max_queue=4)

    async def scenario():
        dead = [s.submit(job()) for _ in range(4)]
        for t in dead:
            t.cancel()
        alive = [s.submit(job()) for _ in range(4)]  # the queue had room once the dead were gone
        assert s.queue_depth == 4
        finished = [await until_finished(t) for t in dead]
        assert all(ev[-1].finish_reason == "cancelled" for ev in finished)
        return alive

    asyncio.run(scenario())
