"""The path of a generation setting from the command line or a request to the sampler: `--set entropy_bound=...`
(ask, and serve with a request's `diffgemma` overrides) reaches the accept rule with that value, and the
GenerationSettings the command line resolves is what the loop receives, with only the canvas length filled in where
it was the model's (the engine core's one resolution: core/engine.EngineCore.add_request; nothing else re-resolves
or re-spells it on the way)."""

import sys
import types

import pytest

import diffgemma
from diffgemma import cli, options
from diffgemma.core import turn
from diffgemma.sampling import accept
from diffgemma.settings import GenerationSettings

BOUND = 0.123


def filled(settings, model):
    """`settings` as the loop gets them: the canvas length filled in where it was the model's."""
    return settings if settings.canvas_length is not None else settings.replace(
        canvas_length=model.config.canvas_length)


@pytest.fixture(scope="module")
def demo():
    return diffgemma.load()


@pytest.fixture
def seen(monkeypatch, demo):
    """Spies on the walk's ends -> {"built": settings options.generation_settings returned, "loop": the settings each
    generate_steps call got, "bounds": the bound of each accept-rule call}."""
    seen = {"built": [], "loop": [], "bounds": []}
    real_accept, real_stream, real_build = accept.accept_mask, turn.generate_steps, options.generation_settings

    def accept_spy(entropy, bound, **kw):
        seen["bounds"].append(bound)
        return real_accept(entropy, bound, **kw)

    for name, module in list(sys.modules.items()):  # wherever the loop looks the accept rule up
        if name.startswith("diffgemma") and getattr(module, "accept_mask", None) is real_accept:
            monkeypatch.setattr(module, "accept_mask", accept_spy)

    def stream_spy(model, cache, settings, **kw):
        seen["loop"].append(settings)
        return real_stream(model, cache, settings, **kw)

    def build_spy(model, args):
        seen["built"].append(real_build(model, args))
        return seen["built"][-1]

    monkeypatch.setattr(turn, "generate_steps", stream_spy)
    monkeypatch.setattr(options, "generation_settings", build_spy)
    monkeypatch.setattr(options, "load_model", lambda args: demo)
    return seen


def test_ask_set_reaches_the_sampler(seen, capsys, demo):
    assert cli.main(["ask", "What is 17 + 25?", "--set", f"entropy_bound={BOUND}", "--max-new-tokens", "8",
                     "--seed", "7"]) == 0
    (built,) = seen["built"]
    assert (built.entropy_bound, built.max_new_tokens, built.seed) == (BOUND, 8, 7)
    assert seen["loop"] and all(s == filled(built, demo) for s in seen["loop"])  # handed on as it is
    assert seen["bounds"] and set(seen["bounds"]) == {BOUND}


def test_serve_set_and_request_overrides_reach_the_sampler(seen, monkeypatch, demo):
    pytest.importorskip("fastapi")
    pytest.importorskip("httpx")
    from fastapi.testclient import TestClient

    from diffgemma.server import commands
    from diffgemma.server.app import create_app
    from diffgemma.server.worker import Worker

    served = {}
    monkeypatch.setitem(sys.modules, "uvicorn", types.ModuleType("uvicorn"))  # serve checks that it imports
    monkeypatch.setattr(commands, "serve", lambda model, settings, **kw: served.update(settings=settings) or 0)
    assert cli.main(["serve", "--set", "entropy_bound=0.3", "--set", "max_new_tokens=8"]) == 0
    (base,) = seen["built"]
    assert served["settings"] is base and (base.entropy_bound, base.max_new_tokens) == (0.3, 8)

    worker = Worker(demo, slots=1, max_tokens=512)
    try:
        client = TestClient(create_app(worker, demo.tokenizer, "m", base))
        ask = {"messages": [{"role": "user", "content": "What is 17 + 25?"}]}
        r = client.post("/v1/chat/completions", json={**ask, "diffgemma": {"entropy_bound": BOUND}})
        assert r.status_code == 200, r.text
        assert [s.entropy_bound for s in seen["loop"]] == [BOUND]
        assert seen["bounds"] and set(seen["bounds"]) == {BOUND}
        seen["bounds"].clear()
        assert client.post("/v1/chat/completions", json=ask).status_code == 200
        assert seen["loop"][-1] == filled(base, demo)  # no overrides: the server's own settings, as they are
        assert seen["bounds"] and set(seen["bounds"]) == {0.3}
    finally:
        worker.close()


def test_session_hands_explicit_settings_on_unchanged(seen, demo):
    settings = GenerationSettings.resolve(demo.generation_config, env={}, overrides=[f"entropy_bound={BOUND}"])
    diffgemma.Session(demo).ask("What is 17 + 25?", settings=settings, max_new_tokens=8)
    ((got,),) = [seen["loop"]]
    assert got == filled(settings.replace(max_new_tokens=8), demo)  # the call's override on top, nothing else
    seen["loop"].clear()
    diffgemma.Session(demo).ask("What is 17 + 25?", settings=settings)
    assert seen["loop"] == [filled(settings, demo)]
    assert set(seen["bounds"]) == {BOUND}
