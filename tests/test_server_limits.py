"""What a request can make the server hold or wait for (issue 55, part 3): a body over the size limit is a 413
before it is read (Content-Length or chunked), text no context can hold is a 400 before it is tokenized, requests
are prepared off the event loop (/health and other requests answer while one is prepared, or while an image URL
never answers), memory comes back after a refused request, and no error body hands a client a server path.

The server runs in uvicorn on a loopback port in a thread of this process, so its memory is this process's RSS;
the test clients stream their bodies from one small buffer, so they add nothing to it."""

import copy
import gc
import http.client
import json
import os
import re
import select
import socket
import sys
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

from fastapi.testclient import TestClient  # noqa: E402

import diffgemma  # noqa: E402
from diffgemma import cli  # noqa: E402
from diffgemma.errors import CheckpointError  # noqa: E402
from diffgemma.events import ErrorEvent  # noqa: E402
from diffgemma.loader import embedded_model_path  # noqa: E402
from diffgemma.server.app import create_app  # noqa: E402
from diffgemma.server.commands import listen  # noqa: E402
from diffgemma.server.images import ImageLimits  # noqa: E402
from diffgemma.server.limits import BODY_SLACK_BYTES, MB, default_max_body_bytes  # noqa: E402
from diffgemma.server.text_limit import max_prompt_chars  # noqa: E402
from diffgemma.server.worker import Worker  # noqa: E402
from diffgemma.settings import GenerationSettings  # noqa: E402

SUM = [{"role": "user", "content": "What is 17 + 25?"}]
CONTEXT = 512  # the test servers' context (tokens)
BIG = 50 * MB  # what a careless or hostile client sends
PIECE = bytes(64 * 1024)  # the one buffer every streamed body is sent from


@pytest.fixture(scope="module")
def model():
    return diffgemma.load()


@pytest.fixture(scope="module")
def base(model):
    return GenerationSettings.resolve(model.generation_config, env={}).replace(
        max_new_tokens=4, max_denoising_steps=4, empty_reply_retry=0)


class Live:
    """create_app over a Worker, served by uvicorn on a free loopback port in a thread."""

    def __init__(self, model, base, context: int = CONTEXT, **app_kw):
        self.worker = Worker(model, slots=1, max_tokens=context)
        app = create_app(self.worker, model.tokenizer, "diffgemma-demo", base, **app_kw)
        self.sock = listen("127.0.0.1", 0)
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="critical"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            self.thread.join(0.02)

    def connect(self, timeout: float = 10) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=timeout)

    def request(self, method: str, path: str, body: bytes | None = None, timeout: float = 30):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request(method, path, body=body, headers={"content-type": "application/json"})
            r = conn.getresponse()
            return r.status, r.read()
        finally:
            conn.close()

    def close(self):
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()
        self.worker.close()


@pytest.fixture(scope="module")
def small(model, base):
    """A server taking bodies of at most 4 MB, and fetching image URLs (2 s deadline)."""
    s = Live(model, base, max_body_bytes=4 * MB,
             image_limits=ImageLimits(max_bytes=MB, max_images=2, allow_urls=True, url_timeout_s=2.0))
    yield s
    s.close()


@pytest.fixture(scope="module")
def default(model, base):
    """A server with the default body limit (room for one image of 20 MB as base64): a 50 MB body is over it."""
    s = Live(model, base)
    yield s
    s.close()


@pytest.fixture(scope="module")
def roomy(model, base):
    """A server taking bodies of up to 64 MB (as --max-body-mb 64 does): a 50 MB body is under it."""
    s = Live(model, base, max_body_bytes=64 * MB)
    yield s
    s.close()


def rss() -> int:
    """This process's resident memory, in bytes (Linux)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    pytest.skip("no /proc/self/status: resident memory cannot be read here")


def held() -> int:
    """The resident memory this process holds, in bytes: rss() after glibc returns its free pages (malloc_trim),
    so that what a long test session's heap happens to cache is not counted as kept."""
    import ctypes

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: RSS as it is
        pass
    return rss()


class Watch:
    """Polls /health from its own thread every 20 ms while a test runs, and samples the RSS: the slowest /health
    answer and the most memory seen. An answer's wait counts from when its poll was due (20 ms after the last
    answer), so a stall that holds this thread too (the interpreter lock) is counted as a client outside would see
    it. Stops by itself after `limit_s`."""

    INTERVAL = 0.02

    def __init__(self, live: Live, limit_s: float = 20):
        self.live, self.limit_s = live, limit_s
        self.slowest, self.answers, self.peak, self.failures = 0.0, 0, rss(), []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        conn = http.client.HTTPConnection("127.0.0.1", self.live.port, timeout=5)
        end = time.monotonic() + self.limit_s
        last = time.perf_counter()
        try:
            while not self._stop.wait(self.INTERVAL) and time.monotonic() < end:
                try:
                    conn.request("GET", "/health")
                    r = conn.getresponse()
                    ok = r.status == 200 and json.loads(r.read()) == {"status": "ok"}
                except (OSError, http.client.HTTPException) as e:
                    ok, conn = False, http.client.HTTPConnection("127.0.0.1", self.live.port, timeout=5)
                    self.failures.append(repr(e))
                now = time.perf_counter()
                self.slowest = max(self.slowest, now - (last + self.INTERVAL))
                last = now
                self.answers += ok
                self.peak = max(self.peak, rss())
        finally:
            conn.close()

    def __enter__(self):
        self._thread.start()
        time.sleep(0.1)  # a few answers before the test's request
        return self

    def __exit__(self, *exc):
        time.sleep(0.1)
        self._stop.set()
        self._thread.join(10)


def head(path: str, length: int | None) -> bytes:
    framing = f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked"
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n{framing}\r\n\r\n"
            ).encode()


def send_until_answered(sock: socket.socket, total: int, chunked: bool) -> int:
    """Send `total` bytes of body (zeros: not JSON) from PIECE until the server answers (or 10 s pass) -> the bytes
    sent by then."""
    sent, deadline = 0, time.monotonic() + 10
    while sent < total and time.monotonic() < deadline:
        readable, writable, _ = select.select([sock], [sock], [], 1)
        if readable:
            break
        if not writable:
            continue
        n = min(len(PIECE), total - sent)
        data = b"%x\r\n" % n + PIECE[:n] + b"\r\n" if chunked else PIECE[:n]
        try:
            sock.sendall(data)
        except OSError:  # the server closed: its answer is waiting
            break
        sent += n
    return sent


def answer(sock: socket.socket):
    r = http.client.HTTPResponse(sock)
    r.begin()
    return r.status, json.loads(r.read())


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_body_over_the_limit_is_a_413_before_it_is_read(small, chunked):
    gc.collect()
    before = rss()
    with Watch(small) as watch:
        t = time.perf_counter()
        with small.connect() as sock:
            sock.sendall(head("/v1/chat/completions", None if chunked else BIG))
            sent = send_until_answered(sock, BIG, chunked)
            status, body = answer(sock)
        took = time.perf_counter() - t
    assert status == 413, body
    err = body["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == "request_too_large"
    assert f"limit of {4 * MB} bytes" in err["message"]
    assert took < 1.0, f"the 413 took {took:.2f} s"
    if not chunked:  # refused on its Content-Length: not a byte of the body was needed
        assert sent < BIG
    else:  # cut off near the limit (the sockets' buffers hold a few MB more in flight)
        assert sent < 4 * MB + 16 * MB
    assert watch.peak - before < 100 * MB, f"the server's RSS grew by {(watch.peak - before) / MB:.0f} MB"
    assert watch.answers >= 5 and not watch.failures and watch.slowest < 0.1, (watch.slowest, watch.failures)
    # the connection's rest is not the server's problem: the next request is served normally
    status, body = small.request("GET", "/v1/models")
    assert status == 200 and json.loads(body)["data"][0]["id"] == "diffgemma-demo"


def test_a_body_exactly_at_the_limit_is_read(small):
    """The limit is on bytes: a body of exactly max_body_bytes is parsed (here: not JSON, a 400), one more is a 413."""
    for extra, want in [(0, 400), (1, 413)]:
        with small.connect() as sock:
            sock.sendall(head("/v1/completions", None))
            total = 4 * MB + extra
            send_until_answered(sock, total, chunked=True)
            sock.sendall(b"0\r\n\r\n")
            status, body = answer(sock)
        assert status == want, (extra, body)


def test_the_limit_holds_behind_an_api_key_and_before_it(model, base):
    """With --api-key: a chunked body over the limit from a client holding the key is a 413 (cut off as it
    arrives), one declared too long is a 413 whoever sends it, and a client without the key gets its 401 before
    its body is read."""
    worker = Worker(model, slots=1, max_tokens=CONTEXT)
    try:
        client = TestClient(create_app(worker, model.tokenizer, "diffgemma-demo", base, api_key="sk-k",
                                       max_body_bytes=1000))

        def pieces():
            for _ in range(10):
                yield b"x" * 300

        key = {"authorization": "Bearer sk-k"}
        for body, headers, want in [(pieces(), key, 413), (b"x" * 2000, {}, 413), (pieces(), {}, 401),
                                    (b"x" * 999, key, 400)]:
            r = client.post("/v1/chat/completions", content=body, headers=headers)
            assert r.status_code == want, r.text
        ok = client.post("/v1/chat/completions", json={"messages": SUM, "max_tokens": 2}, headers=key)
        assert ok.status_code == 200, ok.text
    finally:
        worker.close()


def huge_text_body(chars: int) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": "forty two " * (chars // 10)}]}).encode()


def test_text_no_context_can_hold_is_a_400_before_it_is_tokenized(small, model):
    """A body under the limit (3 MB of text in a 4 MB limit) whose text no context of the server can hold: refused
    by its length within a second, without tokenizing it, /health answering within 100 ms throughout."""
    body = huge_text_body(3 * MB)
    limit = max_prompt_chars(model.tokenizer, CONTEXT)
    with Watch(small) as watch:
        t = time.perf_counter()
        status, reply = small.request("POST", "/v1/chat/completions", body)
        took = time.perf_counter() - t
    assert status == 400, reply
    err = json.loads(reply)["error"]
    assert err["param"] == "messages" and err["message"] == (
        f"messages[0].content: {3 * MB // 10 * 10} characters of text, more than this server's context of {CONTEXT} tokens "
        f"can hold (at most {limit} characters)")
    assert took < 1.0, f"the 400 took {took:.2f} s"
    assert watch.answers >= 5 and not watch.failures and watch.slowest < 0.1, (watch.slowest, watch.failures)


def test_health_answers_while_a_long_prompt_is_tokenized(model, base):
    """Text just under the bound reaches the tokenizer (here 60,000 characters of words it has not seen, which the
    demo tokenizer takes a good fraction of a second over); /health keeps answering within 100 ms meanwhile."""
    import random

    rng = random.Random(0)
    words = (("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randrange(3, 9))))
             for _ in range(20000))
    text = " ".join(words)[:60000]
    live = Live(model, base, context=4096)
    try:
        assert max_prompt_chars(model.tokenizer, 4096) > len(text)
        with Watch(live) as watch:
            status, reply = live.request("POST", "/v1/completions", json.dumps({"prompt": text}).encode())
        assert status == 400 and "over this server's context of 4096" in json.loads(reply)["error"]["message"]
        assert watch.answers >= 5 and not watch.failures and watch.slowest < 0.1, (watch.slowest, watch.failures)
    finally:
        live.close()


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_50_mb_body_gets_a_413_from_the_default_limit(default, chunked):
    with default.connect() as sock:
        t = time.perf_counter()
        sock.sendall(head("/v1/chat/completions", None if chunked else BIG))
        send_until_answered(sock, BIG, chunked)
        status, body = answer(sock)
        took = time.perf_counter() - t
    assert status == 413 and body["error"]["code"] == "request_too_large", body
    assert f"limit of {default_max_body_bytes(20 * MB)} bytes" in body["error"]["message"]
    assert took < 1.0, f"the 413 took {took:.2f} s"


def test_a_50_mb_text_under_the_limit_is_refused_and_its_memory_given_back(roomy):
    """50 MB of text under a 64 MB body limit: received, parsed, refused by its
    length without tokenizing (which took a minute), and the memory it took given back. Parsing holds the
    interpreter while the JSON library runs (about as long as copying the body a few times), so /health may wait
    that long, no more. (The bounds leave room for a loaded machine: here the upload itself is 50 MB.)"""
    body = huge_text_body(BIG)
    assert len(body) < 64 * MB
    before = held()
    for _ in range(2):  # a second one must not keep more than the first
        with Watch(roomy) as watch:
            t = time.perf_counter()
            status, reply = roomy.request("POST", "/v1/chat/completions", body)
            took = time.perf_counter() - t
        assert status == 400 and f"{BIG // 10 * 10} characters of text" in json.loads(reply)["error"]["message"]
        assert took < 3.0, f"the 400 took {took:.2f} s"
        assert watch.answers >= 5 and not watch.failures and watch.slowest < 0.5, (watch.slowest, watch.failures)
    del body
    after = held()
    assert after - before < 30 * MB, f"{(after - before) / MB:.0f} MB kept after the refusals"


def test_health_and_other_requests_go_on_while_an_image_url_never_answers(small):
    """An image URL whose server accepts the connection and never replies holds its own request until the fetch
    deadline (2 s here), and nothing else: /health and a whole chat completion answer meanwhile."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    url = f"http://127.0.0.1:{silent.getsockname()[1]}/cat.png"
    body = json.dumps({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is it?"}, {"type": "image_url", "image_url": {"url": url}}]}]}).encode()
    stalled = {}

    def ask_with_the_url():
        t = time.perf_counter()
        stalled["answer"] = small.request("POST", "/v1/chat/completions", body)
        stalled["took"] = time.perf_counter() - t

    try:
        with Watch(small) as watch:
            asker = threading.Thread(target=ask_with_the_url, daemon=True)
            asker.start()
            time.sleep(0.3)  # the fetch is waiting now
            t = time.perf_counter()
            status, reply = small.request("POST", "/v1/chat/completions",
                                          json.dumps({"messages": SUM, "max_tokens": 2}).encode())
            other = time.perf_counter() - t
            assert status == 200, reply
            assert "answer" not in stalled, "the stalled request ended before the other one was answered"
            asker.join(10)
        assert not asker.is_alive()
    finally:
        silent.close()
    assert other < 1.5, f"a plain chat waited {other:.2f} s behind the stalled image URL"
    assert watch.answers >= 10 and not watch.failures and watch.slowest < 0.1, (watch.slowest, watch.failures)
    status, err = stalled["answer"]
    assert status == 400 and "took over 2 s" in json.loads(err)["error"]["message"], err
    assert 1.9 < stalled["took"] < 5


# ------------------------------------------------------------------------------------- error bodies

# an absolute path of two or more parts (not a URL's: no '/', ':' or word character right before it); the server's
# own routes (/v1/...) are named in its 404s
PATH = re.compile(r"(?<![\w:/.])/(?:[\w.@+-]+/)+[\w.@+-]*")


def server_paths(text: str) -> list[str]:
    roots = {str(embedded_model_path()), os.path.dirname(diffgemma.__file__), sys.prefix, os.getcwd(),
             os.path.expanduser("~")}
    return [r for r in roots if len(r) > 1 and r in text] + [p for p in PATH.findall(text) if not p.startswith("/v1/")]


class FailingWorker:
    """A worker whose every generation fails with an error naming a server file."""

    max_tokens = CONTEXT

    def __init__(self, model):
        self.model = model

    def submit(self, ids, settings, tool_retries=0, images=None):
        return FailedJob()


class FailedJob:
    """A job whose one event is a failure naming a server file."""

    async def aget(self):
        return ErrorEvent(CheckpointError(f"{embedded_model_path()}/model.safetensors: truncated at byte 12"))

    def cancel(self):
        pass


def bad_requests() -> list[tuple[str, str, object]]:
    tiny_png = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGA"
                "hKmMIQAAAABJRU5ErkJggg==")
    image = [{"role": "user", "content": [{"type": "text", "text": "hi"},
                                          {"type": "image_url", "image_url": {"url": tiny_png}}]}]
    chat = "/v1/chat/completions"
    return [
        ("POST", chat, b"{not json"), ("POST", chat, b"\xff\xfe"), ("POST", chat, b"[" * 100000),
        ("POST", chat, {"messages": image}),  # the demo model has no vision tower
        ("POST", chat, {"messages": SUM, "temperatur": 1}), ("POST", chat, {"messages": SUM, "model": "gpt-x"}),
        ("POST", chat, {"messages": SUM, "max_tokens": 10**6}), ("POST", chat, {"messages": [{"role": "tool"}]}),
        ("POST", chat, {"messages": [{"role": "user", "content": "x" * 10**6}]}),
        ("POST", chat, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {
            "url": "file:///etc/passwd"}}]}]}),
        ("POST", chat, {"messages": SUM, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"$ref": "file:///etc/passwd"}}}}),
        ("POST", chat, {"messages": SUM, "diffgemma": {"canvas_length": 10**9}}),
        ("POST", "/v1/completions", {"prompt": [10**9]}), ("POST", "/v1/completions", {"prompt": "x" * 10**6}),
        ("GET", "/v1/models/nope", None), ("GET", "/nowhere", None), ("DELETE", "/v1/models", None),
        ("POST", chat, b"x" * (2 * MB)),
    ]


def post_all(client, requests):
    for method, path, body in requests:
        if isinstance(body, bytes):
            yield client.request(method, path, content=body, headers={"content-type": "application/json"})
        else:
            yield client.request(method, path, json=body)


def test_no_error_body_names_a_server_path(model, base):
    worker = Worker(model, slots=1, max_tokens=CONTEXT)
    bare = copy.copy(model.tokenizer)
    bare.chat_template = None  # the server's own problem: a 500 saying so, its files in the log only
    try:
        client = TestClient(create_app(worker, model.tokenizer, "diffgemma-demo", base, max_body_bytes=MB,
                                       image_limits=ImageLimits(allow_urls=True, url_timeout_s=1)),
                            raise_server_exceptions=False)
        answers = list(post_all(client, bad_requests()))
        failing = TestClient(create_app(FailingWorker(model), model.tokenizer, "diffgemma-demo", base),
                             raise_server_exceptions=False)
        answers += list(post_all(failing, [("POST", "/v1/chat/completions", {"messages": SUM}),
                                           ("POST", "/v1/chat/completions", {"messages": SUM, "stream": True})]))
        templateless = TestClient(create_app(worker, bare, "diffgemma-demo", base), raise_server_exceptions=False)
        answers += list(post_all(templateless, [("POST", "/v1/chat/completions", {"messages": SUM})]))
    finally:
        worker.close()
    statuses = [r.status_code for r in answers]
    assert all(s >= 400 for s in statuses[:-3]) and statuses[-3] == 500 and statuses[-1] == 500, statuses
    assert 413 in statuses and 404 in statuses and 405 in statuses
    for r in answers:
        text = r.text
        assert not server_paths(text), (r.status_code, text)
        assert "Traceback" not in text and "config.json" not in text and "token_id" not in text, text
        if r.headers["content-type"].startswith("application/json"):
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    vision = answers[3].json()["error"]["message"]
    assert vision == "messages: this model cannot take images; send text only", vision
    assert "generation failed (CheckpointError)" in answers[-3].text and "generation failed" in answers[-2].text
    assert answers[-1].json()["error"]["message"] == "the server cannot render chats (its log says why)"


# ------------------------------------------------------------------------------------- the flag

def test_serve_takes_a_body_limit_and_defaults_to_room_for_its_images(monkeypatch, capsys):
    import types

    from diffgemma.server import commands

    seen = {}
    monkeypatch.setitem(sys.modules, "uvicorn", types.ModuleType("uvicorn"))
    monkeypatch.setattr(commands, "serve", lambda model, settings, **kw: seen.update(kw) or 0)
    assert cli.main(["serve"]) == 0
    assert seen["max_body_bytes"] == 4 * -(-20 * MB // 3) + BODY_SLACK_BYTES
    assert cli.main(["serve", "--max-images", "2", "--max-image-mb", "3"]) == 0
    assert seen["max_body_bytes"] == default_max_body_bytes(3 * MB) == 4 * MB + BODY_SLACK_BYTES
    assert cli.main(["serve", "--max-body-mb", "0.5"]) == 0 and seen["max_body_bytes"] == MB // 2
    capsys.readouterr()
    for bad in ["0", "-1", "nan", "inf", "1e-9"]:
        assert cli.main(["serve", "--max-body-mb", bad]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"--max-body-mb {float(bad)}: expected a positive number" in err[0], err
    assert cli.main(["serve", "--max-image-mb", "inf"]) == 2
    assert "--max-image-mb inf: expected a positive number" in capsys.readouterr().err
