"""Canvas frames on CUDA (server/frames.py): a step's snapshot reads the same values as a plain .tolist() of its
tensors, and, reading on a stream of its own, it returns while work queued on the main stream after the step (a
forward launched ahead) still runs. Then a served stream on the demo model's CUDA engine with frames on: the same
reply as with frames off, each step's frame consistent with its commit.

Skips without CUDA.
"""

import json

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from diffgemma.events import StepEvent  # noqa: E402
from diffgemma.server import frames  # noqa: E402

C, V = 256, 262144


def step_tensors(gen):
    logits = torch.randn(C, V, device="cuda", generator=gen)
    probs = torch.softmax(logits, dim=-1)
    entropy = -(probs * torch.log(probs)).sum(-1)
    return logits.argmax(-1), entropy < entropy.median(), entropy


def test_snapshot_reads_the_step_and_does_not_wait_for_later_work():
    gen = torch.Generator(device="cuda").manual_seed(0)
    draft, accepted, entropy = step_tensors(gen)
    event = StepEvent(block=0, attempt=0, step=1, temperature=0.8, draft=draft, accepted=accepted, mean_entropy=0.5,
                      stop_reason=None, entropy=entropy)
    frames.snapshot(event)  # its stream made and its kernels loaded once: a module's first load may wait for the GPU
    torch.cuda.synchronize()  # the step's status read: everything the step computed is done
    a = torch.randn(8192, 8192, device="cuda", generator=gen)
    for _ in range(40):  # work queued after the status (a forward launched ahead), hundreds of ms
        a = torch.tanh(a @ a * 1e-4)
    later = torch.cuda.Event()
    later.record()
    frame = frames.snapshot(event)
    still_running = not later.query()
    assert frame.tokens == draft.tolist() and frame.accepted == accepted.int().tolist()
    assert frame.entropy == torch.round(entropy.double() * frames.MILLI).long().tolist()
    assert still_running, "the snapshot waited for work queued after the step"


def test_a_served_stream_with_frames_on_the_cuda_engine():
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    import diffgemma
    from diffgemma.server.app import create_app
    from diffgemma.server.worker import Worker
    from diffgemma.settings import GenerationSettings

    model = diffgemma.load(device="cuda")
    base = GenerationSettings.resolve(model.generation_config, env={})
    for max_batch in (1, 2):  # alone, the engine runs the next forward ahead; batched it does not
        worker = Worker(model, slots=2, max_tokens=1024, max_batch=max_batch)
        try:
            client = TestClient(create_app(worker, model.tokenizer, "demo", base))
            replies = []
            for on in (False, True):
                body = {"messages": [{"role": "user", "content": "Count from 1 to 40."}], "stream": True, "seed": 3,
                        "diffgemma": {"frames": on, "entropy_bound": 0.01}}
                with client.stream("POST", "/v1/chat/completions", json=body) as r:
                    chunks = [json.loads(e[6:]) for e in b"".join(r.iter_bytes()).decode().split("\n\n")
                              if e.startswith("data: {")]
                replies.append("".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]))
                got = [c["diffgemma"]["frame"] for c in chunks if "frame" in c.get("diffgemma", {})]
                if on:
                    steps = [f for f in got if f["type"] == "step"]
                    commits = [f for f in got if f["type"] == "commit"]
                    assert len(commits) >= 2 and len(steps) >= 2 * len(commits)
                    for c in commits:
                        last = [f for f in steps if f["block"] == c["block"]][-1]
                        assert last["stop_reason"] == c["stop_reason"]
                        assert c["tokens"] == last["tokens"][:len(c["tokens"])]
            assert replies[0] == replies[1] and replies[0]
        finally:
            worker.close()
