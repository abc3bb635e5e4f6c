"""bench_serve's client processes (bench/clients.py) against a stub streaming server in this process: each prompt goes
from its own process, none before the common start, the records carry the usage chunk's tokens in prompt order, and
a client's failure is raised naming that client."""

import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from bench.clients import ClientProcesses


class Stub(BaseHTTPRequestHandler):
    """Streams two text chunks, then a usage chunk counting the prompt's ids (the prompt [0] gets a 500), and notes
    when each request came."""
    seen: list = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompt = body["prompt"]
        if prompt == [0]:
            self.send_response(500)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        Stub.seen.append(time.perf_counter())
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for chunk in ({"choices": [{"text": "a"}]}, {"choices": [{"text": "b"}]},
                      {"choices": [], "usage": {"completion_tokens": len(prompt)}}):
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")
        self.close_connection = True

    def log_message(self, *a):
        pass


@pytest.fixture(scope="module")
def url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Stub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1/completions"
    server.shutdown()


def test_each_prompt_streams_from_its_own_process_after_the_common_start(url):
    prompts = [[1] * 3, [2] * 5, [3] * 2]
    with ClientProcesses(3) as procs:
        assert len({p.pid for p in procs.procs} | {os.getpid()}) == 4
        for _ in range(2):  # the processes and their clients serve pass after pass
            Stub.seen.clear()
            wall, start, outs = procs.run(url, prompts, 4)
            assert [o["tokens"] for o in outs] == [3, 5, 2]
            assert all(start <= o["t_start"] <= o["t_text"] <= o["t_end"] <= start + wall for o in outs)
            assert len(Stub.seen) == 3 and min(Stub.seen) >= start  # one clock: perf_counter's
        with pytest.raises(ValueError, match="4 prompts for 3 client processes"):
            procs.run(url, prompts + [[1]], 4)


def test_a_failing_client_is_named(url):
    with ClientProcesses(2) as procs:
        with pytest.raises(RuntimeError, match=r"client 1: RuntimeError: HTTP 500"):
            procs.run(url, [[1, 1], [0]], 4)
        _, _, outs = procs.run(url, [[1, 1], [2]], 4)  # the processes go on after a failure
        assert [o["tokens"] for o in outs] == [2, 1]
