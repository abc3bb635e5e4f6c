"""The ranks of one expert-parallel run: their process groups, the collectives the model makes, and the watchdog.

Two process groups (docs/ARCHITECTURE.md, 'Several GPUs'):
  data     the default group: NCCL on GPUs (one device per rank), gloo on the CPU. The forward's all-reduce and the
           calls' tensor inputs; its timeout (`timeout_s`) bounds every collective of a forward or a call
  control  gloo, on the host: rank 0's call headers and the start-up barrier. Rank 0 may be idle for hours (a server
           between requests, a load), so the other ranks wait on it that long; rank 0's own sends wait no longer than
           a collective of a call. A rank that dies closes its sockets, which gloo reports at once

Any collective that fails (a dead peer, a timeout) raises ParallelError, naming the rank and the collective. The
launcher's watchdog (`Watchdog`) ends a run whose ranks died while a collective is blocked inside NCCL.
"""

from __future__ import annotations

import os
import pickle
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from ..errors import InputError

DEFAULT_TIMEOUT_S = 120.0  # a collective of a call: far above a step or a prefill, short enough to end a dead run
IDLE_TIMEOUT = timedelta(days=30)  # the control group's: rank 0 may be idle or loading for this long
LOAD_TIMEOUT = timedelta(hours=1)  # the start-up barrier: every rank has loaded its share by then
HEADER = 8  # int64 words of a call's header (parallel/engine.py fills them)
EXIT_FAILED = 3  # the exit status of a run its ranks ended


class ParallelError(RuntimeError):
    """A rank died or a collective timed out: the run cannot go on (its ranks hold disjoint experts)."""


@dataclass
class Group:
    """This process's place among `size` ranks. size 1: no process group at all and every collective a no-op, so the
    single-GPU path runs the same code."""

    rank: int = 0
    size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    control: object | None = None  # the gloo group of the call headers (None with one rank)
    live: bool = False  # every rank has loaded its engine and none has failed (the lead then ends them with a call)
    on_failure: object = None  # called with the message when a collective of rank 0's model fails (the CLI: fatal)
    timeout_s: float = DEFAULT_TIMEOUT_S  # a collective of a call (the data group's timeout)

    @property
    def lead(self) -> bool:
        return self.rank == 0

    # ------------------------------------------------------------------ collectives (no-ops on one rank)

    def all_reduce(self, t: torch.Tensor) -> None:
        """Sum `t` over the ranks, in place (graph-capturable on NCCL)."""
        if self.size > 1:
            self._call("all-reduce", dist.all_reduce, t)

    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's `t` into every rank's `t` (same shape and dtype on every rank), on the data group."""
        if self.size > 1:
            self._call("broadcast", dist.broadcast, t, 0)
        return t

    def header(self, values: list[int] | None = None) -> list[int]:
        """Rank 0 sends up to HEADER ints, every other rank receives them (control group, host)."""
        t = torch.zeros(HEADER, dtype=torch.int64)
        if values is not None:
            t[: len(values)] = torch.tensor(values, dtype=torch.int64)
        self._control_broadcast(t, "call header")
        return t.tolist()

    def broadcast_object(self, obj=None):
        """Rank 0's picklable `obj` on every rank (control group): its length, then its pickled bytes."""
        if self.size == 1:
            return obj
        n = torch.zeros(1, dtype=torch.int64)
        if self.lead:
            data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
            n[0] = data.numel()
        self._control_broadcast(n, "broadcast")
        if not self.lead:
            data = torch.empty(int(n[0]), dtype=torch.uint8)
        self._control_broadcast(data, "broadcast")
        return obj if self.lead else pickle.loads(data.numpy().tobytes())

    def _control_broadcast(self, t: torch.Tensor, what: str) -> None:
        """On the control group. The others wait as long as rank 0 may be idle (its group timeout); rank 0's own send,
        which gloo completes only once a receiver takes it, waits no longer than a collective of a call may."""
        if self.size == 1:
            return
        if not self.lead:
            self._call(what, dist.broadcast, t, 0, group=self.control)
            return
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor, opts.timeout = 0, 0, timedelta(seconds=self.timeout_s)
        self._call(what, lambda: self.control.broadcast([t], opts).wait())

    def barrier(self, what: str) -> None:
        """Every rank reaches this point, within LOAD_TIMEOUT (a load may take long on one of them); gloo's monitored
        barrier names a rank that did not come."""
        if self.size > 1:
            self._call(what, dist.monitored_barrier, group=self.control, timeout=LOAD_TIMEOUT, wait_all_ranks=True)

    def _call(self, what: str, fn, *args, **kw):
        try:
            return fn(*args, **kw)
        except (RuntimeError, ValueError) as e:  # gloo / NCCL errors are RuntimeErrors (DistBackendError, timeouts)
            detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ParallelError(f"rank {self.rank} of {self.size}: {what} failed, another rank died or stopped "
                                f"answering ({detail[:200]})") from None

    def close(self) -> None:
        if self.size > 1 and dist.is_initialized():
            dist.destroy_process_group()


def init_group(rank: int, size: int, device, init_method: str, timeout_s: float = DEFAULT_TIMEOUT_S,
               idle_timeout: timedelta = IDLE_TIMEOUT) -> Group:
    """Join the run's process groups as `rank` of `size` (size 1: none). NCCL on a CUDA device, gloo on the CPU. The
    NCCL communicator is set up here, by a first all-reduce: a CUDA graph may capture collectives only after that.
    idle_timeout: the control group's (the tests shorten it, so a fault fails them instead of hanging)."""
    device = torch.device(device)
    if size == 1:
        return Group(0, 1, device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    try:
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                                timeout=timedelta(seconds=timeout_s))
        control = dist.new_group(backend="gloo", timeout=idle_timeout)
    except (RuntimeError, ValueError) as e:
        raise ParallelError(f"rank {rank} of {size}: cannot join the other ranks ({str(e).splitlines()[0][:200]})") \
            from None
    group = Group(rank, size, device, control, timeout_s=timeout_s)
    group.all_reduce(torch.zeros(1, device=device))
    return group


def timeout_s() -> float:
    """A collective's timeout: DIFFGEMMA_DIST_TIMEOUT seconds, else DEFAULT_TIMEOUT_S."""
    raw = os.environ.get("DIFFGEMMA_DIST_TIMEOUT")
    if raw is None:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise InputError(f"DIFFGEMMA_DIST_TIMEOUT={raw}: expected a positive number of seconds")
    return value


# ---------------------------------------------------------------------------------------------- --gpus

def parse_gpus(text) -> int:
    """`--gpus` as given: a whole number >= 1, else an InputError."""
    try:
        n = int(str(text).strip())
    except ValueError:
        n = None
    if n is None or n < 1:
        raise InputError(f"--gpus {text}: expected a whole number of GPUs >= 1")
    return n


def check_gpus(n: int, device_type: str, num_experts: int) -> None:
    """Whether `n` ranks fit this machine (CUDA: one visible GPU each; CPU: processes) and split the experts evenly."""
    if device_type == "cuda" and n > torch.cuda.device_count():
        raise InputError(f"--gpus {n}: this machine has {torch.cuda.device_count()} visible GPU(s)")
    if num_experts % n:
        raise InputError(f"--gpus {n}: the model's {num_experts} experts do not split evenly over {n} ranks")


# ---------------------------------------------------------------------------------------------- failure

def fatal(message: str) -> None:
    """End this process now with one line on stderr: for a rank whose peers died (a thread may call it)."""
    print(f"diffgemma: error: {message}", file=sys.stderr, flush=True)
    os._exit(EXIT_FAILED)


class Watchdog:
    """A daemon thread that asks `probe()` every `interval` seconds and ends the process (`fatal`) with the message
    it returns, if any. `stop()` before a normal shutdown, whose exits are not failures."""

    def __init__(self, probe, interval: float = 0.2):
        self.probe, self.interval = probe, interval
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="diffgemma-watchdog", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped.wait(self.interval):
            message = self.probe()
            if message and not self._stopped.is_set():
                fatal(message)

    def stop(self) -> None:
        self._stopped.set()


def parent_probe(rank: int):
    """A follower's probe: its parent (rank 0, which spawned it) is gone."""
    parent = os.getppid()

    def probe():
        if os.getppid() != parent:
            return f"rank {rank}: rank 0 died; this rank stops"
        return None

    return probe


def wait_for(predicate, seconds: float, step: float = 0.05) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(step)
    return predicate()
