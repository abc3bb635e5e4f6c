"""Canvas frames in the chat stream (server/frames.py) and the playground's files, on the demo model: a stream that
does not ask for frames is the same bytes as before and reads no step tensor; one that asks gets every step and
every commit, consistent with the reply; the official openai client still parses it; the page and its files are
served whole, without the key, and ship in the wheel. The page in a browser: tests/test_playground_browser.py."""

import fnmatch
import json
import threading
import types
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from fastapi.testclient import TestClient  # noqa: E402

import diffgemma  # noqa: E402
from diffgemma.core import Request, steps  # noqa: E402
from diffgemma.events import StepEvent  # noqa: E402
from diffgemma.server import app as app_module, playground, protocol  # noqa: E402
from diffgemma.server.app import create_app  # noqa: E402
from diffgemma.server.commands import listen, served_name  # noqa: E402
from diffgemma.server.reply_text import final_message  # noqa: E402
from diffgemma.server.worker import Job, Worker  # noqa: E402
from diffgemma.settings import GenerationSettings  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
STORY = [{"role": "user", "content": "Tell me a story."}]
KEY = "sk-frames"


@pytest.fixture(scope="module")
def model():
    return diffgemma.load()


@pytest.fixture(scope="module")
def worker(model):
    w = Worker(model, slots=2, max_tokens=1024)
    yield w
    w.close()


@pytest.fixture(scope="module")
def client(model, worker):
    base = GenerationSettings.resolve(model.generation_config, env={})
    return TestClient(create_app(worker, model.tokenizer, served_name(model), base))


@pytest.fixture
def pinned(monkeypatch):
    """Response ids and clocks fixed, so two streams of the same reply are the same bytes."""
    monkeypatch.setattr(app_module, "new_id", lambda prefix: prefix + "pinned")
    monkeypatch.setattr(protocol, "new_id", lambda prefix: prefix + "pinned")
    monkeypatch.setattr(app_module, "time", types.SimpleNamespace(time=lambda: 1.7e9))


def raw_stream(client, **body) -> str:
    with client.stream("POST", "/v1/chat/completions", json={"messages": STORY, "stream": True, **body}) as r:
        assert r.status_code == 200, r.read()
        return b"".join(r.iter_bytes()).decode()


def chunks_of(raw: str) -> list[dict]:
    """The stream's JSON chunks, in order (every event a single `data:` line; [DONE] last)."""
    events = raw.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""], events[-2:]
    assert all(e.startswith("data: {") and "\n" not in e for e in events[:-2])
    return [json.loads(e[6:]) for e in events[:-2]]


def is_frame(chunk: dict) -> bool:
    return "frame" in chunk.get("diffgemma", {})


def frames_of(raw: str) -> list[dict]:
    return [c["diffgemma"]["frame"] for c in chunks_of(raw) if is_frame(c)]


def test_without_frames_the_stream_is_the_same_bytes(model, pinned):
    base = GenerationSettings.resolve(model.generation_config, env={})
    one = Worker(model, slots=1, max_tokens=1024)  # one slot: after the first stream, each reuses the same prefix
    client = TestClient(create_app(one, model.tokenizer, served_name(model), base))
    body = dict(seed=3, stream_options={"include_usage": True})
    raw_stream(client, **body)
    plain = raw_stream(client, **body)
    assert "event:" not in plain and plain.endswith("data: [DONE]\n\n")
    assert raw_stream(client, diffgemma={"frames": False}, **body) == plain
    framed = raw_stream(client, diffgemma={"frames": True}, **body)
    kept = "".join(e + "\n\n" for e in framed.split("\n\n") if e and not (e.startswith("data: {")
                                                                       and is_frame(json.loads(e[6:]))))
    assert kept == plain  # frames only add chunks: every other byte is the same, the reply too
    assert len(frames_of(framed)) >= 2
    one.close()


def test_frames_tell_each_step_and_each_commit(client, model):
    tok = model.tokenizer
    raw = raw_stream(client, seed=3, diffgemma={"frames": True, "entropy_bound": 0.05})
    chunks = chunks_of(raw)
    got = frames_of(raw)
    C = model.config.canvas_length
    steps = [f for f in got if f["type"] == "step"]
    commits = [f for f in got if f["type"] == "commit"]
    assert commits and len(steps) >= 2 * len(commits)
    for f in steps:
        assert len(f["tokens"]) == len(f["pieces"]) == len(f["accepted"]) == len(f["entropy_milli"]) == C
        assert f["pieces"] == [tok.decode([t], skip_special_tokens=False) for t in f["tokens"]]
        assert set(f["accepted"]) <= {0, 1} and min(f["entropy_milli"]) >= 0
        assert abs(sum(f["entropy_milli"]) / C / 1000 - f["mean_entropy"]) < 1e-3  # the entropies are this step's
        assert f["entropy_bound"] == 0.05 and f["max_steps"] == 48 and 0 < f["temperature"] <= 0.8
    reply = []
    for c in commits:  # a block's steps count 1, 2, ... up to the one that stopped it, then its commit
        own = [f for f in steps if f["block"] == c["block"] and f["attempt"] == c["attempts"] - 1]
        assert [f["step"] for f in own] == list(range(1, c["steps"] + 1))
        assert own[-1]["stop_reason"] == c["stop_reason"] and all(f["stop_reason"] is None for f in own[:-1])
        assert c["tokens"] == own[-1]["tokens"][:len(c["tokens"])]  # what the block kept of its last canvas
        reply += c["tokens"]
    for c in chunks:
        assert c["object"] == "chat.completion.chunk" and (c["choices"] == []) == is_frame(c)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == final_message(tok, reply, False)[0]["content"]  # the commits add up to the streamed reply
    first_commit = next(i for i, c in enumerate(chunks) if is_frame(c) and c["diffgemma"]["frame"]["type"] == "commit")
    first_text = next(i for i, c in enumerate(chunks) if c["choices"] and c["choices"][0]["delta"].get("content"))
    assert first_commit < first_text  # a block's commit frame comes before its text


class Watched(torch.Tensor):
    """A tensor that counts the torch calls made on it (a read: .tolist(), .cpu(), .to(), torch.stack ...)."""

    reads = 0

    @classmethod
    def __torch_function__(cls, func, types_, args=(), kwargs=None):
        Watched.reads += 1
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


def test_a_stream_without_frames_reads_no_step_tensor(client, monkeypatch):
    def watched_step(**kw):
        for name in ("draft", "accepted", "entropy"):
            kw[name] = kw[name].as_subclass(Watched)
        return StepEvent(**kw)

    monkeypatch.setattr(steps, "StepEvent", watched_step)
    Watched.reads = 0
    raw_stream(client, seed=3)
    assert Watched.reads == 0
    raw_stream(client, seed=3, diffgemma={"frames": True})
    assert Watched.reads > 0  # the same watch sees the reads frames make


def test_a_job_that_did_not_ask_drops_its_steps_unread():
    class Untouchable:
        def __getattr__(self, name):
            raise AssertionError(f"a step tensor was read ({name})")

    job = Job(Request(GenerationSettings()))
    job.put(StepEvent(block=0, attempt=0, step=1, temperature=0.8, draft=Untouchable(), accepted=Untouchable(),
                      mean_entropy=0.0, stop_reason=None))
    assert job.events.empty()


@pytest.mark.parametrize("body,needle", [
    ({"stream": True, "diffgemma": {"frames": "yes"}}, "diffgemma.frames: expected true or false, got 'yes'"),
    ({"diffgemma": {"frames": True}}, "diffgemma.frames: frames are chunks of a stream"),
    ({"stream": True, "diffgemma": {"frames": True, "entropy_bond": 1}}, "entropy_bond"),
])
def test_bad_frames_requests_are_refused_by_name(client, body, needle):
    r = client.post("/v1/chat/completions", json={"messages": STORY, **body})
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == "diffgemma"


class Live:
    """create_app over `worker`, served by uvicorn on a free loopback port in a thread."""

    def __init__(self, worker, model, **app_kw):
        import uvicorn

        base = GenerationSettings.resolve(model.generation_config, env={})
        app = create_app(worker, model.tokenizer, served_name(model), base, **app_kw)
        self.sock = listen("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        while not self.server.started:
            self.thread.join(0.02)
            assert self.thread.is_alive(), "the server did not start"

    def close(self):
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


def test_the_openai_client_parses_a_stream_with_frames(model, worker):
    openai = pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    from openai.types.chat import ChatCompletionChunk

    live = Live(worker, model)
    try:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0, timeout=60)

        def joined(**extra):
            chunks = list(client.chat.completions.create(model=served_name(model), messages=STORY, stream=True,
                                                         seed=3, **extra))
            for c in chunks:
                ChatCompletionChunk.model_validate(c.model_dump())
            return chunks, "".join(ch.delta.content or "" for c in chunks for ch in c.choices)

        plain, text = joined()
        framed, framed_text = joined(extra_body={"diffgemma": {"frames": True}})
        assert framed_text == text and text
        extra = [c for c in framed if not c.choices]
        assert len(extra) >= 2 and all((c.model_extra or {}).get("diffgemma", {}).get("frame") for c in extra)
        assert len(framed) == len(plain) + len(extra)
    finally:
        live.close()


def test_the_page_is_public_and_the_api_is_not(model, worker):
    base = GenerationSettings.resolve(model.generation_config, env={})
    keyed = TestClient(create_app(worker, model.tokenizer, served_name(model), base, api_key=KEY))
    for path in ("/", "/playground/app.js", "/playground/canvas.js", "/playground/style.css", "/playground/info"):
        r = keyed.get(path)
        assert r.status_code == 200, (path, r.text)
        if path != "/playground/info":
            assert r.headers["content-security-policy"] == playground.POLICY
    info = keyed.get("/playground/info").json()
    assert info["key_required"] is True and info["vision"] is False and info["canvas_length"] == 64
    assert [t["function"]["name"] for t in info["tools"]][:2] == ["get_weather", "get_time"]
    assert info["settings"]["entropy_bound"] == 0.1 and info["metrics"] is True
    for path in ("/v1/models", "/metrics"):
        assert keyed.get(path).status_code == 401
    assert keyed.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def test_the_page_asks_nothing_of_other_hosts_and_ships_in_the_wheel():
    import re
    import tomllib

    here = Path(playground.__file__).parent
    names = sorted(p.name for p in here.iterdir() if p.suffix in (".html", ".js", ".css"))
    assert names == ["app.js", "canvas.js", "index.html", "style.css"]
    for name in names:
        text = (here / name).read_text()
        assert not re.search(r"https?:|//[a-z0-9.-]+\.[a-z]{2,}/|@import|url\(", text), name
    html = (here / "index.html").read_text()
    assert all(u.startswith(("/", "data:")) for u in re.findall(r'(?:src|href)="([^"]*)"', html))
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["diffgemma"]
    for name in names:
        assert any(fnmatch.fnmatch(f"server/playground/{name}", g) for g in globs), name
