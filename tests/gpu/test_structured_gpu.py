"""Constrained output on the CUDA engine (the demo model, graphs, the batched step): through the server, every
schema of tests/structured_cases.py and a named call of each demo tool are valid in one attempt, alone and with
the requests running together in one continuous batch."""

import json
import threading

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
pytest.importorskip("llguidance")
pytest.importorskip("fastapi")
jsonschema = pytest.importorskip("jsonschema")

from fastapi.testclient import TestClient  # noqa: E402

import diffgemma  # noqa: E402
from diffgemma.loader import embedded_model_path  # noqa: E402
from diffgemma.server.app import create_app  # noqa: E402
from diffgemma.server.worker import Worker  # noqa: E402
from diffgemma.settings import GenerationSettings  # noqa: E402

from structured_cases import PROMPTS, SCHEMAS  # noqa: E402

TOOLS = json.loads((embedded_model_path() / "tools.json").read_text())


def bodies():
    out = [(PROMPTS[i % 3], {"response_format": {"type": "json_schema", "json_schema": {"name": f"s{i}",
                                                                                         "schema": s}},
                             "max_tokens": 96}, s) for i, s in enumerate(SCHEMAS)]
    for t in TOOLS:
        fn = t["function"]
        out.append((PROMPTS[0], {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": fn["name"]}},
                                 "max_tokens": 48}, fn))
    return out


def valid(body, want):
    assert body["diffgemma"]["structured"] == "grammar" and body["diffgemma"]["attempts"] == 1, body
    message = body["choices"][0]["message"]
    if "parameters" in want:
        (call,) = message["tool_calls"]
        assert call["function"]["name"] == want["name"]
        jsonschema.validate(json.loads(call["function"]["arguments"]), want["parameters"])
    else:
        jsonschema.validate(json.loads(message["content"]), want)


@pytest.mark.parametrize("together", [False, True])
def test_constrained_replies_on_the_cuda_engine(together):
    model = diffgemma.load(None, device="cuda")
    worker = Worker(model, slots=8 if together else 1, max_tokens=2048)
    app = create_app(worker, model.tokenizer, "m", GenerationSettings.resolve(model.generation_config, env={}))
    cases = bodies()
    replies = [None] * len(cases)
    try:
        with TestClient(app) as client:
            def one(k):
                prompt, body, _ = cases[k]
                r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": prompt}],
                                                              "seed": k, **body})
                assert r.status_code == 200, r.text
                replies[k] = r.json()

            if together:
                threads = [threading.Thread(target=one, args=(k,)) for k in range(len(cases))]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(300)
            else:
                for k in range(len(cases)):
                    one(k)
    finally:
        worker.close()
    for k, (_, _, want) in enumerate(cases):
        assert replies[k] is not None, k
        valid(replies[k], want)
