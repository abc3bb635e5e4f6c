"""Continuous batching in the server (server/worker.py over the engine core, core/) on the embedded demo model: requests that run together get
exactly the tokens each gets alone, join and leave a running batch, cancel without touching the others, wait in a
bounded queue (503 + Retry-After when it is full), prefill long prompts a chunk per round between the running
requests' steps, read every running request's step status with one host wait a round (a request whose status
step fails fails alone), and replay from the op-log identically."""

import itertools
import json
import threading

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from fastapi.testclient import TestClient  # noqa: E402

import diffgemma  # noqa: E402
from diffgemma import cli, oplog  # noqa: E402
from diffgemma.core import EngineCore, Request  # noqa: E402
from diffgemma.core import engine as engine_mod, lanes as lanes_mod  # noqa: E402
from diffgemma.core.request import DENOISE, PREFILL  # noqa: E402
from diffgemma.core.scheduler import Scheduler  # noqa: E402
from diffgemma.errors import InputError  # noqa: E402
from diffgemma.events import CancelledEvent, DoneEvent, ErrorEvent, StartEvent  # noqa: E402
from diffgemma.model.denoiser import StepStatus  # noqa: E402
from diffgemma.replay import replay  # noqa: E402
from diffgemma.server.app import create_app  # noqa: E402
from diffgemma.server.commands import served_name  # noqa: E402
from diffgemma.server.worker import QueueFull, Worker  # noqa: E402
from conftest import SESSION_SEED  # noqa: E402
from diffgemma.settings import GenerationSettings  # noqa: E402
from diffgemma.slots import Slot  # noqa: E402

PROMPTS = ["What is 17 + 25?", "Count from 1 to 200.", "What is 2 + 3?", "Name three colours."]


@pytest.fixture(scope="module")
def model():
    return diffgemma.load()


@pytest.fixture(scope="module")
def base(model):
    return GenerationSettings.resolve(model.generation_config, env={})


def ids_of(model, text: str) -> list[int]:
    return model.tokenizer.apply_chat_template([{"role": "user", "content": text}])


def hold(worker) -> threading.Event:
    """Park the worker thread until the returned event is set: jobs submitted meanwhile join in one round."""
    gate = threading.Event()
    worker.between_rounds(gate.wait, wait=False)
    return gate


def submitted(worker, prompts: list, settings: list, into: list | None = None) -> list:
    """Submit the requests while the worker is parked, so they join in one round -> the jobs (appended to `into`, if
    given, as each is made: before the worker runs)."""
    jobs = into if into is not None else []
    gate = hold(worker)
    try:
        for p, s in zip(prompts, settings):
            jobs.append(worker.submit(p, s))
    finally:
        gate.set()  # a refused submit must not leave the worker parked (close would wait forever)
    return jobs


def together(worker, prompts: list, settings: list) -> tuple[list, list]:
    """Submit the requests while the worker is parked, so they join in one round -> (jobs, each one's last event)."""
    jobs = submitted(worker, prompts, settings)
    return jobs, [finish(j)[-1] for j in jobs]


def finish(job, timeout=120) -> list:
    events = [job.get(timeout=timeout)]
    while not isinstance(events[-1], (DoneEvent, CancelledEvent, ErrorEvent)):
        events.append(job.get(timeout=timeout))
    return events


def run_alone(model, ids, settings, max_tokens=2048, prefill_chunk=None, turn=True):
    """The request run by itself (a core of its own, a fresh slot) -> its last event."""
    request = Request(settings, prompt=ids, slot=Slot(model.new_cache(max_tokens)), turn=turn,
                      prefill_chunk=prefill_chunk)
    return EngineCore(model).run([request])[0]


def alone(model, ids, settings, max_tokens=2048, prefill_chunk=None):
    """The request's turn run by itself -> its result."""
    end = run_alone(model, ids, settings, max_tokens, prefill_chunk)
    assert isinstance(end, DoneEvent), end
    return end.result


def forwards(trace) -> list[tuple]:
    return [e[2] for e in trace if e[1] == "forward"]


def spy_status_reads(monkeypatch, trace, poison=None):
    """Put each read_statuses call (core/lanes.read_asks makes them) in the scheduler's trace as (time, "status", its number
    of requests); poison(k,
    asks) -> a request index whose StepStatus is replaced by a stop code no step knows, "raise" (the read fails), or
    None."""
    real = lanes_mod.read_statuses
    calls = itertools.count()

    def spy(asks):
        trace.append((0.0, "status", len(asks)))
        out = real(asks)
        bad = None if poison is None else poison(next(calls), asks)
        if bad == "raise":
            raise RuntimeError("status read failed")
        if bad is not None:
            out[bad] = StepStatus(code=10**6, mean_entropy=0.0)
        return out

    monkeypatch.setattr(lanes_mod, "read_statuses", spy)


def test_batched_requests_get_their_solo_tokens_and_leave_when_done(model, base, monkeypatch):
    """Four requests step together from one round on; each gets exactly its solo tokens, steps and stop reasons, and
    one whose turn ends leaves the batch while the others go on. Every round's forward is followed by one status read
    for all its requests, not one per request."""
    settings = [base.replace(seed=10 + i, max_new_tokens=64 * (1 + i % 3)) for i in range(4)]
    trace: list = []
    spy_status_reads(monkeypatch, trace)
    worker = Worker(model, slots=4, max_tokens=2048, max_batch=4, trace=trace)
    try:
        jobs, ends = together(worker, [ids_of(model, p) for p in PROMPTS], settings)
    finally:
        worker.close()
    fw = forwards(trace)
    assert fw[0] == tuple(j.id for j in jobs)  # all four in the first round's forward
    ops = [(e[1], e[2] if e[1] == "status" else len(e[2])) for e in trace if e[1] in ("forward", "status")]
    assert ops == [op for f in fw for op in (("forward", len(f)), ("status", len(f)))]
    assert len({len(f) for f in fw}) > 1  # some left while others went on
    for job, end, p, s in zip(jobs, ends, PROMPTS, settings):
        solo = alone(model, ids_of(model, p), s)
        assert isinstance(end, DoneEvent)
        assert end.result.tokens == solo.tokens
        assert end.result.steps_per_block == solo.steps_per_block and end.result.stop_reasons == solo.stop_reasons
        assert sum(job.id in f for f in fw) == solo.forwards  # a request steps only while it runs


def test_requests_ending_blocks_together_read_them_in_one_wait_before_committing(model, base, monkeypatch):
    """Three requests that step together end each block in the same round: the scheduler reads their three blocks in
    one host wait (core/lanes.read_asks) and only then do they commit, so no block event waits for another request's
    commit. Each gets its solo tokens."""
    from test_status_batch import FIXED, spy_reads_and_commits

    log = spy_reads_and_commits(monkeypatch, engine_mod)
    C = model.config.canvas_length
    settings = [base.replace(seed=60 + i, max_new_tokens=2 * C, max_denoising_steps=4, **FIXED) for i in range(3)]
    worker = Worker(model, slots=3, max_tokens=2048, max_batch=3)
    try:
        jobs, ends = together(worker, [ids_of(model, p) for p in PROMPTS], settings)
    finally:
        worker.close()
    blocks = [k for k, e in enumerate(log) if e != "commit" and "BlockRead" in e]
    assert [log[k] for k in blocks] == [["BlockRead"] * 3] * 2
    for k in blocks:  # a slot keeps its cache: every block is committed, after the round's reads
        assert log[k + 1: k + 4] == ["commit"] * 3, log[k - 1: k + 5]
    for end, p, s in zip(ends, PROMPTS, settings):
        assert end.result.tokens == alone(model, ids_of(model, p), s).tokens


def test_a_request_joins_a_running_batch_mid_block(model, base):
    trace: list = []
    worker = Worker(model, slots=2, max_tokens=2048, max_batch=2, trace=trace)
    long_s, short_s = base.replace(seed=3, max_new_tokens=192), base.replace(seed=4, max_new_tokens=64)
    try:
        a = worker.submit(ids_of(model, PROMPTS[1]), long_s)
        while len(forwards(trace)) < 3:  # a is three steps into its first block
            threading.Event().wait(0.01)
        b = worker.submit(ids_of(model, PROMPTS[0]), short_s)
        end_a, end_b = finish(a)[-1], finish(b)[-1]
    finally:
        worker.close()
    fw = forwards(trace)
    first_b = next(k for k, f in enumerate(fw) if b.id in f)
    assert first_b >= 3 and fw[first_b] == (a.id, b.id)  # joined the running batch, not after it
    assert fw[-1] == (a.id,)  # b left first; a went on alone
    assert end_a.result.tokens == alone(model, ids_of(model, PROMPTS[1]), long_s).tokens
    assert end_b.result.tokens == alone(model, ids_of(model, PROMPTS[0]), short_s).tokens


def test_a_request_whose_step_fails_fails_alone(model, base, monkeypatch):
    """The first request's status in the third round's read is one its step cannot take: that request ends with an
    ErrorEvent (its slot emptied), while the others, read in the same wait, go on to their solo tokens."""
    trace: list = []
    spy_status_reads(monkeypatch, trace, poison=lambda k, asks: 0 if k == 2 and len(asks) == 3 else None)
    worker = Worker(model, slots=3, max_tokens=2048, max_batch=3, trace=trace)
    settings = [base.replace(seed=30 + i, max_new_tokens=96) for i in range(3)]
    prompts = [ids_of(model, PROMPTS[1])] * 3
    try:
        jobs, ends = together(worker, prompts, settings)
        emptied = [k for k, slot in enumerate(worker.slots) if slot.ids == [] and slot.cache.length == 0]
    finally:
        worker.close()
    fw = forwards(trace)
    assert fw[:3] == [tuple(j.id for j in jobs)] * 3 and all(jobs[0].id not in f for f in fw[3:])
    assert isinstance(ends[0], ErrorEvent) and len(emptied) == 1  # the other two slots hold their conversations
    for k in (1, 2):
        assert ends[k].result.tokens == alone(model, prompts[k], settings[k]).tokens


def test_a_failed_status_read_fails_the_requests_it_read_and_the_worker_goes_on(model, base, monkeypatch):
    trace: list = []
    spy_status_reads(monkeypatch, trace, poison=lambda k, asks: "raise" if k == 1 else None)
    worker = Worker(model, slots=2, max_tokens=2048, max_batch=2, trace=trace)
    prompt = ids_of(model, PROMPTS[1])
    try:
        jobs, ends = together(worker, [prompt] * 2, [base.replace(seed=40 + i, max_new_tokens=64) for i in range(2)])
        probe = worker.submit(prompt, base.replace(seed=1, max_new_tokens=32))
        probe_end = finish(probe)[-1]
    finally:
        worker.close()
    assert all(isinstance(e, ErrorEvent) and "status read failed" in str(e.error) for e in ends)
    assert forwards(trace)[:3] == [tuple(j.id for j in jobs)] * 2 + [(probe.id,)]
    assert probe_end.result.tokens == alone(model, prompt, base.replace(seed=1, max_new_tokens=32)).tokens


def test_cancel_mid_batch_stops_that_request_only(model, base, tmp_path):
    log = oplog.OpLog(tmp_path, oplog.header(model, 3, 2048))
    trace: list = []
    worker = Worker(model, slots=3, max_tokens=2048, max_batch=3, log=log, trace=trace)
    settings = [base.replace(seed=20 + i, max_new_tokens=128) for i in range(3)]
    prompts = [ids_of(model, p) for p in PROMPTS[1:]]
    try:
        jobs = submitted(worker, prompts, settings)
        assert isinstance(jobs[1].get(timeout=60), StartEvent)
        while len(forwards(trace)) < 2:
            threading.Event().wait(0.01)
        jobs[1].cancel()
        at = len(forwards(trace))
        ends = [finish(j)[-1] for j in jobs]
        slot = worker.slots[1]
        assert slot.ids == prompts[1] and slot.cache.length == len(prompts[1])  # rewound to its prompt
    finally:
        worker.close()
        log.close()
    assert isinstance(ends[1], CancelledEvent) and ends[1].kept == len(prompts[1])
    assert sum(jobs[1].id in f for f in forwards(trace)[at:]) <= 1  # stopped within one step
    assert len(forwards(trace)[at:]) >= 2  # while the others ran on
    for k in (0, 2):
        assert ends[k].result.tokens == alone(model, prompts[k], settings[k]).tokens
    report = replay(log.path, model)  # the batched session's interleaved log replays identically
    assert report.ok, report.problems
    assert report.generations == 3


def test_long_prompt_prefills_a_chunk_per_round_between_steps(model, base, tmp_path):
    """A long prompt's prefill is spread over rounds, each chunk followed by the running request's next step; its
    tokens are those of a one-shot prefill, and its log replays identically."""
    log = oplog.OpLog(tmp_path, oplog.header(model, 2, 2048))
    trace: list = []
    worker = Worker(model, slots=2, max_tokens=2048, max_batch=2, prefill_chunk=48, log=log, trace=trace)
    run_s = base.replace(seed=5, max_new_tokens=128, stop_ids=[])  # no stop token: it runs its whole budget
    long_s = base.replace(seed=6, max_new_tokens=32)
    long_ids = ids_of(model, "Summarise this: " + " ".join(f"item {i} is blue." for i in range(45)))
    assert len(long_ids) > 6 * 48
    try:
        a = worker.submit(ids_of(model, PROMPTS[1]), run_s)
        while len(forwards(trace)) < 2:
            threading.Event().wait(0.01)
        b = worker.submit(long_ids, long_s)
        end_a, end_b = finish(a)[-1], finish(b)[-1]
    finally:
        worker.close()
        log.close()
    ops = [(e[1], e[2]) for e in trace]
    chunks = [k for k, op in enumerate(ops) if op == ("prefill", b.id)]
    assert len(chunks) == -(-len(long_ids) // 48)
    last_a = max(k for k, op in enumerate(ops) if op[0] == "forward" and a.id in op[1])
    during = [k for k in chunks[:-1] if k < last_a]
    assert len(during) >= 4  # a kept running while b prefilled
    for k in during:  # each chunk is followed by a step of the running request before b's next chunk
        assert ops[k + 1] == ("forward", (a.id,)), ops[k - 1:k + 3]
    assert all(e[3] <= 48 for e in trace if e[1] == "prefill")
    assert end_a.result.tokens == alone(model, ids_of(model, PROMPTS[1]), run_s).tokens
    assert end_b.result.tokens == alone(model, long_ids, long_s).tokens  # the one-shot prefill's
    generate_ops = [r for r in oplog.read(log.path) if r.get("op") == "generate"]
    assert {r["prefill_chunk"] for r in generate_ops} == {48}
    assert replay(log.path, model).ok


def test_a_prompt_joining_running_streams_prefills_busy_chunks_and_yields_to_commits(model, base, tmp_path):
    """A request that starts on an idle server prefills prefill_chunk tokens a round; a long one (over two chunks)
    that joins while another generates prefills busy_prefill_chunk tokens a round, in chunks of that size
    (journaled, so replay prefills the same), and holds its chunk back in the round after a running request ended a
    block (that round's step already waits for the block's commit), but never two rounds in a row. A shorter prompt
    joining then keeps whole chunks."""
    log = oplog.OpLog(tmp_path, oplog.header(model, 3, 2048))
    trace: list = []
    worker = Worker(model, slots=3, max_tokens=2048, max_batch=3, prefill_chunk=96, busy_prefill_chunk=16, log=log,
                    trace=trace)
    run_s = base.replace(seed=5, max_new_tokens=640, stop_ids=[])  # no stop token: blocks end all along
    long_s = base.replace(seed=6, max_new_tokens=32)
    long_ids = ids_of(model, "Summarise this: " + " ".join(f"item {i} is blue." for i in range(45)))
    a_ids = ids_of(model, "Summarise this: " + " ".join(f"thing {i} is red." for i in range(12)))
    short_ids = ids_of(model, "Summarise this: " + " ".join(f"shape {i} is green." for i in range(14)))
    assert len(a_ids) > 96 and len(long_ids) > 2 * 96 and 96 < len(short_ids) <= 2 * 96
    try:
        a = worker.submit(a_ids, run_s)
        while len(forwards(trace)) < 2:
            threading.Event().wait(0.01)
        b = worker.submit(long_ids, long_s)
        c = worker.submit(short_ids, long_s)  # joins a running request too
        end_a, end_b, end_c = finish(a)[-1], finish(b)[-1], finish(c)[-1]
    finally:
        worker.close()
        log.close()
    assert all(isinstance(e, DoneEvent) for e in (end_a, end_b, end_c))
    fills = [(e[2], e[3]) for e in trace if e[1] == "prefill"]
    assert [n for j, n in fills if j == a.id][0] == 96  # a started alone: whole chunks
    assert [n for j, n in fills if j == c.id][0] == 96  # c is short: whole chunks
    c_first = next(k for k, e in enumerate(trace) if e[1] == "prefill" and e[2] == c.id)
    assert any(e[1] == "forward" and a.id in e[2] for e in trace[c_first:])  # ... though a was running
    assert {n for j, n in fills if j == b.id} <= set(range(1, 17)) and len([j for j, _ in fills if j == b.id]) \
        == -(-len(long_ids) // 16)
    # the rounds: each one's prefills, its forward, then the blocks its requests ended (committed) after it
    rounds: list = []
    for e in trace:
        if not rounds or (e[1] != "block" and any(op[0] == "forward" for op in rounds[-1])):
            rounds.append([])
        rounds[-1].append(e[1:])
    b_rounds = [k for k, r in enumerate(rounds) if any(op == ("prefill", b.id, n) for op in r for n in [op[-1]])]
    first, last = b_rounds[0], b_rounds[-1]
    held = 0
    for k in range(first + 1, last + 1):
        filled = any(op[0] == "prefill" for op in rounds[k])
        ended = any(op[0] == "block" for op in rounds[k - 1])
        ns = [op[2] for op in rounds[k] if op[0] == "prefill"]
        assert sum(ns[:-1]) < 16  # chunks are taken while the busy budget lasts
        if ended and any(op[0] == "prefill" for op in rounds[k - 1]):  # the round after a block's commit holds
            assert not filled, k
            held += 1
        if not filled:  # ... only then, and never twice in a row
            assert ended and any(op[0] == "prefill" for op in rounds[k - 1]), (k, rounds[k - 2:k + 1])
    assert held >= 1  # the case happened
    assert end_b.result.tokens == alone(model, long_ids, long_s, prefill_chunk=16).tokens
    chunks = {r["prefill_chunk"] for r in oplog.read(log.path) if r.get("op") == "generate"}
    assert chunks == {96, 16}
    assert replay(log.path, model).ok


def _prefilling(chunks: int | None, one_chunk: bool) -> Request:
    """A running request waiting to prefill `chunks` chunks of 16 tokens (None: endless)."""
    r = Request(None, prompt=[1])
    r.phase, r.chunks, r.one_chunk = PREFILL, [16] * (chunks or 10**6), one_chunk
    return r


def _round(sched: Scheduler, ended: bool = False) -> list:
    """One round's plan, its chunks taken as the core would -> the id of the request of each chunk, in order."""
    sched.block_ended = ended
    plan = sched.schedule()
    out = []
    for r, n in plan.prefill:
        out += [r.id] * n
        del r.chunks[:n]
        if not r.chunks:
            r.phase = DENOISE
    return out


def test_the_prefill_budget_and_its_hold_round_by_round():
    """The scheduler alone: the whole budget when nobody denoises, the busy one when some request does, held in a
    round after a block ended while someone denoises, never two rounds in a row."""
    sched = Scheduler(2, prefill_chunk=64, busy_chunk=16)
    filler = _prefilling(None, False)
    stream = Request(None, prompt=[1])
    stream.phase = DENOISE  # waits for a forward

    sched.running = [filler]
    assert len(_round(sched, False)) * 16 == 64 and len(_round(sched, True)) * 16 == 64  # alone: no hold
    sched.running = [stream, filler]
    assert [len(_round(sched, e)) * 16 for e in (False, True, True, True, False, True)] == [16, 0, 16, 0, 16, 0]
    assert sched.schedule().denoise == [stream]


def test_one_chunk_prompts_prefill_in_the_round_they_join_outside_the_budget():
    """The scheduler alone: every waiting prompt that is one chunk takes it in the round it joins, idle or busy,
    without spending the budget the longer prompts share in join order (at least one chunk a round); a round held
    after a block's commit holds them too."""
    sched = Scheduler(8, prefill_chunk=32, busy_chunk=16)

    def join(chunks, one_chunk):
        r = _prefilling(chunks, one_chunk)
        sched.running.append(r)
        return r.id

    long1, short1, short2 = join(None, False), join(1, True), join(1, True)
    join(None, False)  # a second long prompt: it waits for long1 throughout
    # idle: long1 spends the budget (two chunks), the one-chunk prompts come anyway, the second long one waits
    assert _round(sched) == [long1, long1, short1, short2]
    assert _round(sched) == [long1]  # the shorts denoise now: the busy budget, one chunk of 16
    short3 = join(1, True)
    assert _round(sched, ended=True) == []  # held after a commit, the one-chunk prompt too
    assert _round(sched, ended=True) == [long1, short3]  # never held twice in a row
    short4, short5 = join(1, True), join(1, True)
    assert _round(sched) == [long1, short4, short5]


def test_a_burst_of_one_chunk_prompts_starts_denoising_together(model, base):
    """Prompts that are one chunk each, sent together, all prefill in the round they join and step together from
    the next forward on: on an idle server (their chunks sum past prefill_chunk) and beside a running request (each
    past busy_prefill_chunk). Each gets its solo tokens."""
    trace: list = []
    worker = Worker(model, slots=4, max_tokens=2048, max_batch=4, prefill_chunk=96, busy_prefill_chunk=16,
                    trace=trace)
    texts = [lead + " ".join(f"{w} {i} is {c}." for i in range(6))
             for lead, w, c in (("Summarise this: ", "fruit", "ripe"), ("List these: ", "tool", "sharp"),
                                ("Sort these: ", "stone", "grey"))]
    prompts = [ids_of(model, t) for t in texts]
    assert all(16 < len(p) <= 96 for p in prompts) and sum(len(p) for p in prompts) > 96
    settings = [base.replace(seed=20 + i, max_new_tokens=32) for i in range(3)]
    run_s = base.replace(seed=5, max_new_tokens=192, stop_ids=[])
    try:
        idle, idle_ends = together(worker, prompts, settings)
        idle_trace = list(trace)
        trace.clear()
        a = worker.submit(ids_of(model, PROMPTS[1]), run_s)
        while len(forwards(trace)) < 2:
            threading.Event().wait(0.01)
        joined = submitted(worker, prompts, settings)
        joined_ends = [finish(j)[-1] for j in joined + [a]]
    finally:
        worker.close()
    for jobs, tr in ((idle, idle_trace), (joined, trace)):
        ids = {j.id for j in jobs}
        ops = [e for e in tr if e[1] in ("prefill", "forward")]
        first = next(k for k, e in enumerate(ops) if e[1] == "prefill" and e[2] in ids)
        assert [e[2] for e in ops[first:first + 3]] == [j.id for j in jobs], ops[first:first + 4]
        assert ops[first + 3][1] == "forward" and ids <= set(ops[first + 3][2])  # one forward for all three
    for end, p, s in zip(idle_ends + joined_ends, prompts * 2, settings * 2):
        assert end.result.tokens == alone(model, p, s).tokens
    assert joined_ends[-1].result.tokens == alone(model, ids_of(model, PROMPTS[1]), run_s).tokens


def test_cancel_while_the_prompt_prefills_keeps_the_chunks_and_replays(model, base, tmp_path):
    log = oplog.OpLog(tmp_path, oplog.header(model, 1, 2048))
    jobs = []

    class CancelOnFirstChunk(list):  # the client leaves as the first chunk is about to prefill
        def append(self, entry):
            super().append(entry)
            if entry[1] == "prefill":
                jobs[0].cancel()

    trace = CancelOnFirstChunk()
    worker = Worker(model, slots=1, max_tokens=2048, max_batch=1, prefill_chunk=32, log=log, trace=trace)
    ids = ids_of(model, " ".join(f"word{i}" for i in range(150)))
    try:
        (job,) = submitted(worker, [ids], [base.replace(seed=1, max_new_tokens=64)], into=jobs)
        end = finish(job)[-1]  # seen before its second chunk: the first one always runs (a short prompt is never cut)
        slot = worker.slots[0]
        assert isinstance(end, CancelledEvent) and end.blocks == 0 and end.kept == 32
        assert slot.ids == ids[:32] and slot.cache.length == 32
    finally:
        worker.close()
        log.close()
    assert [e[1] for e in trace] == ["prefill", "prefill"]  # asked twice; prefilled once
    report = replay(log.path, model)
    assert report.ok and report.generations == 1, report.problems


def test_full_queue_is_a_503_with_retry_after(model, base):
    worker = Worker(model, slots=1, max_tokens=1024, max_batch=1, max_queue=1)
    client = TestClient(create_app(worker, model.tokenizer, served_name(model), base))
    body = {"messages": [{"role": "user", "content": "What is 2 + 3?"}], "max_tokens": 16}
    gate = hold(worker)
    try:
        waiting = [worker.submit(ids_of(model, "What is 2 + 3?"), base.replace(max_new_tokens=16)) for _ in range(2)]
        with pytest.raises(QueueFull, match="--max-queue 1"):
            worker.submit(ids_of(model, "What is 2 + 3?"), base)
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 503, r.text
        assert int(r.headers["retry-after"]) >= 1
        err = r.json()["error"]
        assert err["type"] == "server_error" and err["code"] == "server_busy" and "--max-queue 1" in err["message"]
        gate.set()
        assert all(isinstance(finish(j)[-1], DoneEvent) for j in waiting)
        assert client.post("/v1/chat/completions", json=body).status_code == 200  # served again once it drains
    finally:
        gate.set()  # a failed assertion above must not leave the worker parked (close would wait forever)
        worker.close()


def test_concurrent_streams_through_the_app_match_one_at_a_time(model, base):
    """The real app: streams that run batched add up to the replies a max-batch-1 server gives one at a time."""
    def serve(max_batch):
        trace: list = []
        worker = Worker(model, slots=3, max_tokens=2048, max_batch=max_batch, trace=trace)
        client = TestClient(create_app(worker, model.tokenizer, served_name(model), base))
        out = {}

        def ask(i):
            body = {"messages": [{"role": "user", "content": PROMPTS[i]}], "stream": True, "seed": 7 + i,
                    "max_tokens": 128}
            with client.stream("POST", "/v1/chat/completions", json=body) as r:
                lines = [ln for ln in r.iter_lines() if ln.startswith("data: {")]
            out[i] = "".join(json.loads(ln[6:])["choices"][0]["delta"].get("content") or "" for ln in lines)

        gate = hold(worker)
        try:
            threads = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
            for t in threads:
                t.start()
            while worker.queued < 3:
                threading.Event().wait(0.01)
            gate.set()
            for t in threads:
                t.join()
        finally:
            gate.set()  # released whatever failed above, so close does not wait on a parked worker
            worker.close()
        return out, forwards(trace)

    batched, fw8 = serve(3)
    serial, fw1 = serve(1)
    assert batched == serial and all(batched.values())
    assert max(map(len, fw8)) == 3 and max(map(len, fw1)) == 1


def test_a_slot_in_use_is_not_picked_and_the_queue_waits_for_one(model, base):
    trace: list = []
    worker = Worker(model, slots=1, max_tokens=1024, max_batch=4, trace=trace)
    s = base.replace(max_new_tokens=64)
    try:
        assert worker.pick([1, 2, 3], busy={0}) is None
        a, b = submitted(worker, [ids_of(model, PROMPTS[0]), ids_of(model, PROMPTS[2])], [s, s])
        assert isinstance(finish(a)[-1], DoneEvent) and isinstance(finish(b)[-1], DoneEvent)
    finally:
        worker.close()
    assert max(map(len, forwards(trace))) == 1  # one slot: one request at a time, whatever max_batch says


def test_chunked_prefill_gives_the_one_shot_tokens(model, base):
    ids = ids_of(model, "Repeat after me: " + "the quick brown fox jumps over the lazy dog. " * 12)
    s = base.replace(seed=2, max_new_tokens=64)
    whole = run_alone(model, ids, s, 1024, turn=False)
    for chunk in (64, 17):
        part = run_alone(model, ids, s, 1024, prefill_chunk=chunk, turn=False)
        assert part.result.tokens == whole.result.tokens, chunk


def test_bad_batching_values_are_one_line_errors(model, capsys):
    for flag in ("--max-batch", "--max-queue", "--prefill-chunk-tokens", "--busy-prefill-tokens"):
        assert cli.main(["serve", flag, "0"]) == 2
        err = capsys.readouterr().err.strip()
        assert f"{flag} 0: expected a positive number" in err and "\n" not in err
    for kw, needle in ((dict(max_batch=0), "max_batch"), (dict(max_queue=-1), "max_queue"),
                       (dict(prefill_chunk=1.5), "prefill_chunk"), (dict(max_batch=True), "max_batch"),
                       (dict(busy_prefill_chunk=0), "busy_prefill_chunk")):
        with pytest.raises(InputError, match=needle):
            Worker(model, **kw)

    class OneCanvas:  # a model whose forward takes one canvas (no max_batch attribute)
        config = model.config

    with pytest.raises(InputError, match="takes at most 1 canvas"):
        Worker(OneCanvas(), max_batch=2)


def test_the_default_batch_fits_the_free_device_memory():
    """serve's default --max-batch on CUDA (worker.fitting_batch): the slots' KV caches and logits buffers within
    the free memory beside the reserve, never past the model's cap, never below one."""
    from diffgemma.model.engine_batch import KEPT_GRAPHS
    from diffgemma.server.worker import SERVE_RESERVE_BYTES, default_max_batch, fitting_batch

    GiB = 2**30
    # a full-size 8k slot: 0.5 GiB of KV, [256, 262144] bf16 logits, [256, 2816] bf16 SC rows
    cache, logits, buckets, sc = GiB // 2, 128 * 2**20, 4, 256 * 2816 * 2
    per = cache + logits * (buckets + 1) + sc * KEPT_GRAPHS  # the batch graphs share one logits buffer
    assert fitting_batch(120 * GiB, cache, logits, buckets, 8, sc) == 8  # an H200 after the q4 weights
    assert fitting_batch(SERVE_RESERVE_BYTES + 3 * per, cache, logits, buckets, 8, sc) == 3
    assert fitting_batch(SERVE_RESERVE_BYTES + 3 * per - 1, cache, logits, buckets, 8, sc) == 2
    assert fitting_batch(20 * GiB, cache, logits, buckets, 8, sc) == 8  # an 80 GB card after bf16 weights: all 8
    assert fitting_batch(GiB, cache, logits, buckets, 8, sc) == 1  # nothing fits: one request still runs
    assert fitting_batch(120 * GiB, cache, logits, buckets, 1, sc) == 1
    # off CUDA the cap alone: 8 for a model that takes any number
    assert default_max_batch(diffgemma.load(), 4096) == 8


def test_random_arrivals_cancels_and_a_full_queue_never_lose_or_corrupt_a_request(model, base):
    """A hypothesis schedule over the real worker: requests arrive in bursts while the worker is held or running, some
    are cancelled (before they start, or a few steps in), a small queue refuses some with QueueFull, and max_batch /
    slots / the prefill chunk vary. Every accepted request ends with exactly one terminal event, a refused one gets
    nothing, every finished one has exactly its solo tokens, and the worker still serves a request afterwards."""
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies
    prompts = [ids_of(model, p) for p in PROMPTS]

    @hypothesis.seed(SESSION_SEED)  # the suite's seed: pinned in CI, fresh in a developer's run (tests/conftest.py)
    @hypothesis.settings(max_examples=8, deadline=None, database=None)
    @hypothesis.given(st.data())
    def run(data):
        max_batch = data.draw(st.integers(1, 3), "max_batch")
        slots = data.draw(st.integers(max_batch, 4), "slots")
        queue = data.draw(st.integers(1, 3), "max_queue")
        chunk = data.draw(st.sampled_from([8, 2048]), "prefill_chunk")
        n = data.draw(st.integers(2, 6), "requests")
        plan = [(data.draw(st.integers(0, 3)), data.draw(st.sampled_from([32, 64])), data.draw(st.integers(0, 99)),
                 data.draw(st.sampled_from([None, "before", "steps"])), data.draw(st.booleans())) for _ in range(n)]
        trace: list = []
        worker = Worker(model, slots=slots, max_tokens=1024, max_batch=max_batch, max_queue=queue,
                        prefill_chunk=chunk, trace=trace)
        accepted, refused = [], 0
        gate = hold(worker)
        try:
            for p, budget, seed, cancel, burst in plan:
                if not burst:  # let the worker run between arrivals
                    gate.set()
                    gate = hold(worker)
                s = base.replace(seed=seed, max_new_tokens=budget)
                try:
                    job = worker.submit(prompts[p], s)
                except QueueFull:
                    refused += 1
                    continue
                if cancel == "before":
                    job.cancel()
                accepted.append((job, p, s, cancel))
            gate.set()
            for job, p, s, cancel in accepted:
                if cancel == "steps":
                    job.cancel()
            ends = [finish(job, timeout=300) for job, *_ in accepted]
            probe = worker.submit(prompts[0], base.replace(seed=1, max_new_tokens=32))
            probe_end = finish(probe, timeout=300)[-1]
        finally:
            gate.set()  # released whatever failed above, so close does not wait on a parked worker
            worker.close()
        assert isinstance(probe_end, DoneEvent)
        assert refused + len(accepted) == n
        for (job, p, s, cancel), events in zip(accepted, ends):
            terminal = [e for e in events if isinstance(e, (DoneEvent, CancelledEvent, ErrorEvent))]
            assert len(terminal) == 1 and terminal[0] is events[-1]
            assert job.events.empty()  # nothing after the terminal event
            end = events[-1]
            assert not isinstance(end, ErrorEvent), end
            if cancel is None:
                assert isinstance(end, DoneEvent)
            if isinstance(end, DoneEvent):
                assert end.result.tokens == alone(model, prompts[p], s, max_tokens=1024).tokens

    run()


def test_metrics_report_the_rounds_and_the_queue(model, base):
    """GET /metrics (server/metrics.py, the Prometheus text format): the limits, the running and queued requests
    while the worker is held, then what the rounds did once three requests ran together (each started and left,
    one forward a round over every asking request, their prompts prefilled); behind the API key like the API."""
    from prometheus_client.parser import text_string_to_metric_families

    worker = Worker(model, slots=3, max_tokens=1024, max_batch=3, max_queue=4)
    client = TestClient(create_app(worker, model.tokenizer, served_name(model), base, api_key="k"))
    auth = {"Authorization": "Bearer k"}

    def scrape():
        r = client.get("/metrics", headers=auth)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain"), r.text
        out = {}
        for fam in text_string_to_metric_families(r.text):
            for s in fam.samples:
                out[s.name + "".join(f"{{{k}={v}}}" for k, v in sorted(s.labels.items()))] = s.value
        return out

    try:
        # every count exists from the start: a scrape copies them from another thread while the worker counts
        assert set(worker.core.counts) == set(engine_mod.COUNTED)
        assert client.get("/metrics").status_code == 401
        m = scrape()
        assert (m["diffgemma_max_batch"], m["diffgemma_max_queue"], m["diffgemma_slots"]) == (3, 4, 3)
        assert m["diffgemma_context_tokens"] == 1024 and m["diffgemma_requests_started_total"] == 0
        prompts = [ids_of(model, p) for p in PROMPTS[:3]]
        gate = hold(worker)
        try:
            jobs = [worker.submit(ids, base.replace(max_new_tokens=16)) for ids in prompts]
            m = scrape()
        finally:
            gate.set()  # released whatever failed above, so close does not wait on a parked worker
        assert m["diffgemma_requests_queued"] == 3 and m["diffgemma_requests_running"] == 0
        assert all(isinstance(finish(j)[-1], DoneEvent) for j in jobs)
        worker.close()
        m = scrape()
        assert m["diffgemma_requests_queued"] == 0 and m["diffgemma_requests_running"] == 0
        assert m["diffgemma_requests_started_total"] == 3 and m["diffgemma_requests_left_total"] == 3
        assert m["diffgemma_requests_failed_total"] == 0
        assert m["diffgemma_prefill_tokens_total"] == sum(len(p) for p in prompts)
        steps, fwd = m["diffgemma_canvas_steps_total"], m["diffgemma_forwards_total"]
        assert fwd >= 1 and fwd < steps <= 3 * fwd  # rounds stepped several requests at once
        assert m["diffgemma_request_seconds_count"] == 3 and m["diffgemma_request_seconds_sum"] > 0
        assert m["diffgemma_round_seconds_count"] == fwd and m["diffgemma_round_seconds_bucket{le=+Inf}"] == fwd
        assert {k for k in m if k.startswith("diffgemma_batch_forwards_total")} == {
            "diffgemma_batch_forwards_total{how=captured}", "diffgemma_batch_forwards_total{how=eager}",
            "diffgemma_batch_forwards_total{how=replayed}"}
    finally:
        worker.close()


def test_metrics_without_prometheus_client_is_a_404_naming_it(model, base, monkeypatch):
    """A bare app (bench_serve, the GPU image) may lack prometheus_client: /metrics then says what to install."""
    import sys

    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    monkeypatch.delitem(sys.modules, "diffgemma.server.metrics", raising=False)
    worker = Worker(model, slots=1, max_tokens=1024, max_batch=1)
    try:
        r = TestClient(create_app(worker, model.tokenizer, served_name(model), base)).get("/metrics")
        assert r.status_code == 404 and "prometheus_client" in r.json()["error"]["message"], r.text
    finally:
        worker.close()
