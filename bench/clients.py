"""Streaming completion clients for bench_serve: one request (stream), and ClientProcesses, the clients of a pass in
processes of their own.

A server's real clients run in other processes. Clients run as threads of the server's process take its GIL for
their own work (encoding, HTTP, parsing the stream) and leave their garbage to its collector, which spreads their
arrivals and pauses the server. ClientProcesses starts one process a client once (spawned, each with one
httpx.Client kept across passes) and hands every pass's requests out with one start time; each process waits for it,
then streams. Times are time.perf_counter(), which on Linux reads the system-wide monotonic clock, so the clients'
records and the server's trace share one clock.
"""

from __future__ import annotations

import json
import multiprocessing
import time

import httpx


def stream(url: str, prompt: list[int], max_tokens: int, seed: int, out: dict, client=None) -> None:
    """One streaming completion, on `client` (an httpx.Client; a new one if None); out gets its completion token
    count, the seconds it took, and the perf_counter times of its start, its first text and its end."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "seed": seed, "stream": True,
            "stream_options": {"include_usage": True}}
    if client is None:
        with httpx.Client(timeout=None) as client:
            return stream(url, prompt, max_tokens, seed, out, client)
    t = out["t_start"] = time.perf_counter()
    with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(f"stream error: {chunk['error']}")
                if "t_text" not in out and any(c.get("text") for c in chunk.get("choices") or []):
                    out["t_text"] = time.perf_counter()
                if chunk.get("usage"):
                    out["tokens"] = chunk["usage"]["completion_tokens"]
    out["t_end"] = time.perf_counter()
    out["s"] = out["t_end"] - t


def _client(conn) -> None:
    """A client process: one httpx.Client; for each (start, url, prompt, max_tokens, seed) received, wait until
    `start`, stream, and send back the record (or {"error": ...}); None ends it."""
    with httpx.Client(timeout=None) as client:
        conn.send("ready")
        while (job := conn.recv()) is not None:
            start, *call = job
            out: dict = {}
            time.sleep(max(0.0, start - time.perf_counter()))
            try:
                stream(*call, out, client)
            except Exception as e:  # the parent raises it, naming the client
                out = {"error": f"{type(e).__name__}: {e}"}
            conn.send(out)


class ClientProcesses:
    """n client processes, started once: run(url, prompts, max_tokens) streams prompt i from process i, every one
    starting at the same moment. Use as a context manager (close() ends the processes)."""

    LEAD_S = 0.05  # from handing out the requests to their common start: each process has its job by then

    def __init__(self, n: int):
        ctx = multiprocessing.get_context("spawn")  # no fork of a process that holds a CUDA context
        self.conns, self.procs = [], []
        for _ in range(n):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=_client, args=(theirs,), daemon=True)
            proc.start()
            theirs.close()
            self.conns.append(mine)
            self.procs.append(proc)
        for i, conn in enumerate(self.conns):
            if not conn.poll(120) or conn.recv() != "ready":
                self.close()
                raise RuntimeError(f"client process {i} did not start within 120 s")

    def run(self, url: str, prompts: list[list[int]], max_tokens: int) -> tuple[float, float, list[dict]]:
        """-> (wall seconds from the common start to the last client's end, the start's perf_counter time, each
        client's record: see stream)."""
        if len(prompts) > len(self.conns):
            raise ValueError(f"{len(prompts)} prompts for {len(self.conns)} client processes")
        start = time.perf_counter() + self.LEAD_S
        for i, (conn, prompt) in enumerate(zip(self.conns, prompts)):
            conn.send((start, url, prompt, max_tokens, i))
        outs = [conn.recv() for conn in self.conns[:len(prompts)]]
        failed = [f"client {i}: {o['error']}" for i, o in enumerate(outs) if "error" in o]
        if failed:
            raise RuntimeError("; ".join(failed))
        return max(o["t_end"] for o in outs) - start, start, outs

    def close(self) -> None:
        for conn, proc in zip(self.conns, self.procs):
            try:
                conn.send(None)
            except OSError:  # it has gone already
                pass
            proc.join(5)
            if proc.is_alive():
                proc.kill()
            conn.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
