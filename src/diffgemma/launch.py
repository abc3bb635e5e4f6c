"""Starting the ranks: `diffgemma ask/chat/serve --gpus G` (this process is rank 0 and spawns the others) and
`torchrun --nproc-per-node G -m diffgemma serve ...` (torchrun started them all; rank 0 runs the command).

Rank 0 runs the command as it would on one GPU, its model loaded with the run's Group (loader.load(group=)); every
other rank loads its share of the same checkpoint and runs the follower loop until rank 0 ends the run. On the CPU
(the tests) `--gpus` counts processes and the backend is gloo; on CUDA rank r uses cuda:r (pick the GPUs with
CUDA_VISIBLE_DEVICES) and NCCL.

A run ends with one line on stderr, never a hang: a rank that dies (the watchdog of the processes started here), a
collective that fails or times out (ParallelError; with the CLI, `fatal`), rank 0 gone (each follower's watchdog).
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.multiprocessing as mp

from .config import ModelConfig
from .errors import CheckpointError, DiffgemmaError, InputError
from .loader import load, resolve_path
from .parallel.engine import STOP
from .parallel.follower import follow
from .parallel.group import (EXIT_FAILED, IDLE_TIMEOUT, Group, ParallelError, Watchdog, check_gpus, fatal, init_group,
                    parent_probe, parse_gpus, timeout_s, wait_for)

STOP_WAIT_S = 10.0  # how long rank 0 waits for the others to leave after the end of a run, before ending them


def rank_device(device_type: str, rank: int) -> torch.device:
    return torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")


@dataclass
class Ranks:
    """The run as rank 0 (this process) sees it: its Group and the processes it started (none under torchrun)."""

    group: Group
    procs: list = field(default_factory=list)
    watchdog: Watchdog | None = None
    store_dir: str | None = None

    def stop(self) -> None:
        """End the run: the followers leave their loop (or, when the run never started or failed, are ended), the
        process group is torn down."""
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.group.live:
            try:
                self.group.header([STOP, 0])
            except ParallelError:
                pass
            self.group.live = False
        for p in self.procs:
            if not wait_for(lambda: not p.is_alive(), STOP_WAIT_S if p.exitcode is None else 0):
                p.terminate()
                p.join(2)
                if p.is_alive():
                    p.kill()
            p.join(1)
        self.group.close()
        if self.store_dir is not None:
            shutil.rmtree(self.store_dir, ignore_errors=True)


def start(size: int, device_type: str, build, build_args: tuple = (), *, start_method: str = "spawn",
          watch: bool = True, timeout: float | None = None, idle_timeout: timedelta = IDLE_TIMEOUT) -> Ranks:
    """Start ranks 1..size-1 as processes of this host and join them as rank 0. Each follower builds its engine with
    `build(group, *build_args)` (a module-level function: it is pickled), then follows. watch: end this process
    (`fatal`) as soon as a follower dies, wherever rank 0 is (the CLI); off, a dead follower shows as a ParallelError
    at rank 0's next collective (the tests). start_method: "spawn" (CUDA needs it), or "forkserver" (the tests: fast,
    and unlike "fork" no child inherits a gloo loop its parent started). timeout / idle_timeout: init_group's."""
    timeout = timeout_s() if timeout is None else timeout
    if size == 1:
        return Ranks(init_group(0, 1, rank_device(device_type, 0), ""))
    store_dir = tempfile.mkdtemp(prefix="diffgemma-ranks-")
    init_method = f"file://{os.path.join(store_dir, 'store')}"
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":  # the server imports torch and the package once; each follower forks from it
        ctx.set_forkserver_preload([__name__])
    procs = []
    for rank in range(1, size):
        p = ctx.Process(target=_follower_main, name=f"diffgemma-rank-{rank}", daemon=True,
                        args=(rank, size, rank_device(device_type, rank), init_method, timeout, idle_timeout, build,
                              build_args, watch))
        p.start()
        procs.append(p)
    dog = Watchdog(_children_probe(procs)) if watch else None
    try:
        group = init_group(0, size, rank_device(device_type, 0), init_method, timeout, idle_timeout)
    except BaseException:
        Ranks(Group(0, size), procs, dog, store_dir).stop()
        raise
    return Ranks(group, procs, dog, store_dir)


def _children_probe(procs):
    def probe():
        for rank, p in enumerate(procs, 1):
            if p.exitcode is not None:
                return f"rank {rank} of {len(procs) + 1} (pid {p.pid}) died (exit status {p.exitcode}); the run stops"
        return None
    return probe


def _follower_main(rank, size, device, init_method, timeout, idle_timeout, build, build_args, watch) -> None:
    """A spawned follower: join, build the engine, follow rank 0 until it ends the run. Ctrl-C reaches the terminal's
    whole process group; rank 0 alone answers it (by ending the run), so a follower ignores it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if watch:
        Watchdog(parent_probe(rank))
    _follow_or_die(rank, lambda: init_group(rank, size, device, init_method, timeout, idle_timeout), build,
                   build_args)


def _follow_or_die(rank: int, join, build, build_args) -> None:
    """join() the run, build this rank's engine, follow; any failure ends this process with one line naming the rank
    (a follower has no caller to hand an error to)."""
    try:
        group = join()
        follow(build(group, *build_args), group)
        group.close()
    except ParallelError as e:
        fatal(str(e))
    except DiffgemmaError as e:
        fatal(f"rank {rank}: {e}")
    except BaseException as e:  # noqa: BLE001
        fatal(f"rank {rank}: {type(e).__name__}: {e}")


def load_rank(group: Group, path, dtype=None):
    """A follower's engine: its share of the checkpoint at `path` (loader.load with the group)."""
    return load(path, device=group.device, dtype=dtype, progress=False, group=group)


# ---------------------------------------------------------------------------------------------- the CLI

def torchrun_world() -> int | None:
    """The world size torchrun (or any env:// launcher) gave this process, or None outside one."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    return int(os.environ["WORLD_SIZE"])


def run(args, handler) -> int:
    """Run a command (`handler(args)`, cli.py's ask / chat or server/commands.py's serve) over several ranks:
    `args.gpus` of them started here, or torchrun's. Rank 0 runs the command with `args.parallel_group` set (its
    model loads through it); any other rank follows."""
    asked = None if args.gpus is None else parse_gpus(args.gpus)
    device_type = _device_type(args.device)
    world = torchrun_world()
    gpus = asked if world is None else world
    if world is not None and asked is not None and asked != world:
        raise InputError(f"--gpus {asked}: torchrun started {world} ranks; leave --gpus out under torchrun")
    check_gpus(gpus, device_type, _num_experts(args.model))
    if world is None:
        ranks = start(gpus, device_type, load_rank, (args.model,))
    else:
        rank = int(os.environ["RANK"])
        local = int(os.environ.get("LOCAL_RANK", rank))
        join = lambda: init_group(rank, world, rank_device(device_type, local), "env://", timeout_s())  # noqa: E731
        if rank != 0:
            _follow_or_die(rank, join, load_rank, (args.model,))
            return 0
        ranks = Ranks(join())
    ranks.group.on_failure = fatal
    args.parallel_group = ranks.group
    try:
        return handler(args)
    except ParallelError as e:
        print(f"diffgemma: error: {e}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        ranks.stop()


def _device_type(device: str) -> str:
    kind, _, index = str(device).partition(":")
    if kind not in ("auto", "cpu", "cuda") or (index and (kind != "cuda" or not index.isdigit())):
        raise InputError(f"--device {device}: expected cpu, cuda, cuda:N or auto")  # options.check_device's words
    if index:
        raise InputError(f"--device {device}: with several ranks rank r uses cuda:r; choose the GPUs with "
                         "CUDA_VISIBLE_DEVICES and pass --device cuda")
    if kind == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda" and not torch.cuda.is_available():
        raise InputError("--device cuda: CUDA is not available on this machine")
    return kind


def _num_experts(path) -> int:
    """The checkpoint's expert count, read before any rank starts (a bad path fails here, as the load would)."""
    directory = resolve_path(path)
    if not directory.is_dir():
        what = "expected a checkpoint directory, got a file" if directory.exists() else "no such checkpoint directory"
        raise CheckpointError(f"{directory}: {what}")
    return ModelConfig.from_file(directory / "config.json").num_experts

