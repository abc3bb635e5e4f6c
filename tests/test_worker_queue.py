"""The server's queue bound counts live requests only: a client that leaves while its request waits frees its place
at once (a new request is accepted in its stead) and the request is dropped with a CancelledEvent at the worker's
next round, before any model work (issue 55: abandoned queued requests kept counting against --max-queue)."""

import threading

import pytest

import diffgemma
from diffgemma.core import EngineCore, Request
from diffgemma.events import CancelledEvent, DoneEvent
from diffgemma.server.worker import QueueFull, Worker
from diffgemma.settings import GenerationSettings
from diffgemma.slots import Slot


@pytest.fixture(scope="module")
def model():
    return diffgemma.load()


def test_a_request_cancelled_while_queued_frees_its_place_at_once(model):
    base = GenerationSettings.resolve(model.generation_config, env={}, overrides={"max_new_tokens": 16})
    ids = model.tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}])
    trace: list = []
    worker = Worker(model, slots=1, max_tokens=512, max_batch=1, max_queue=2, trace=trace)
    gate = threading.Event()
    worker.between_rounds(gate.wait, wait=False)  # the worker is busy: everything submitted now waits
    try:
        jobs = [worker.submit(ids, base.replace(seed=k)) for k in range(3)]  # one free lane + two queued
        with pytest.raises(QueueFull):
            worker.submit(ids, base)
        assert worker.queued == 3
        jobs[0].cancel()
        jobs[1].cancel()
        assert worker.queued == 1  # their places are free now, before any round
        late = [worker.submit(ids, base.replace(seed=10 + k)) for k in range(2)]
        with pytest.raises(QueueFull):
            worker.submit(ids, base)
        gate.set()
        ends = [j.get(timeout=120) for j in jobs[:2]]
        assert all(isinstance(e, CancelledEvent) and e.kept is None and e.blocks == 0 for e in ends)
        served = [jobs[2]] + late
        finals = []
        for job in served:
            event = job.get(timeout=120)
            while not isinstance(event, (DoneEvent, CancelledEvent)):
                event = job.get(timeout=120)
            finals.append(event)
    finally:
        gate.set()
        worker.close()
    assert all(isinstance(e, DoneEvent) for e in finals)
    started = {e[2] for e in trace if e[1] == "prefill"} | {i for e in trace if e[1] == "forward" for i in e[2]}
    assert not started & {jobs[0].id, jobs[1].id}  # dropped before any model work


def test_the_core_drops_a_cancelled_waiting_request_in_the_next_round(model):
    """EngineCore alone: a request cancelled before it starts ends with CancelledEvent() in the next step, without
    a slot or a generation; the others in the queue are not touched."""
    base = GenerationSettings.resolve(model.generation_config, env={}, overrides={"max_new_tokens": 8})
    core = EngineCore(model, max_batch=1)
    events = {k: [] for k in range(2)}
    reqs = [Request(base.replace(seed=k), prompt=[5, 6, 7], slot=Slot(model.new_cache(256)),
                    sink=events[k].append) for k in range(2)]
    for r in reqs:
        core.add_request(r)
    reqs[1].cancel()
    core.step()
    assert reqs[1].done and events[1] == [CancelledEvent()] and reqs[1].run is None
    assert not reqs[0].done
    while not reqs[0].done:
        core.step()
    assert isinstance(reqs[0].end, DoneEvent)


def test_a_call_between_rounds_runs_on_the_worker_thread_once_its_requests_are_done(model):
    """Worker.between_rounds: fn runs on the worker thread after the requests queued before it have ended (their
    last commits included: the trace's last block is in and the core is idle), its result or error handed back."""
    base = GenerationSettings.resolve(model.generation_config, env={}, overrides={"max_new_tokens": 16})
    ids = model.tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}])
    trace: list = []
    worker = Worker(model, slots=2, max_tokens=512, max_batch=2, trace=trace)
    try:
        jobs = [worker.submit(ids, base.replace(seed=k)) for k in range(2)]
        seen = worker.between_rounds(lambda: (threading.get_ident(), worker.core.idle, len(trace),
                                              [j.request.done for j in jobs]))
        assert seen[0] != threading.get_ident() and seen[1] and seen[2] == len(trace) and seen[3] == [True, True]
        assert all(j.request.done for j in jobs)
        with pytest.raises(ZeroDivisionError):
            worker.between_rounds(lambda: 1 / 0)
        assert worker.between_rounds(lambda: "still serving") == "still serving"
    finally:
        worker.close()
