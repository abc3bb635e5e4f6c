"""The tool repair's KV gate on the CUDA engine (f16 ring-buffer KV, graphs, padded prefill): after a repaired turn
the session's live KV is byte-identical to a cache that never saw the bad exchange (the same prompt, then the same
final reply, each prefilled in one call), and a seeded next turn is identical on both (tests/test_tool_repair.py is
the CPU twin, on the reference model)."""

import copy

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

import diffgemma  # noqa: E402
from diffgemma.session import Session  # noqa: E402
from diffgemma.tool_repair import ToolRepair  # noqa: E402
from test_tool_repair import FAST, WEATHER, live_equal, strict_tools  # noqa: E402


@pytest.fixture(scope="module")
def engine():
    return diffgemma.load(None, device="cuda")


def test_repaired_cache_is_byte_identical_on_the_engine(engine):
    s = Session(engine, tools=strict_tools(), tool_repair=True, max_tokens=1024)
    reply = s.ask(WEATHER, **FAST)
    r = reply.result
    print(f"\n[tool repair cuda] rounds {r.tool_repairs}, failed {r.tool_repair_failed}, {len(r.tokens)} tokens")
    assert r.tool_repairs >= 1  # the engine's demo writes the invalid call too
    assert ToolRepair(engine.tokenizer, strict_tools()).problems(r.tokens) == [] or r.tool_repair_failed
    fresh = Session(engine, tools=strict_tools(), tool_repair=True, max_tokens=1024)
    fresh.messages = copy.deepcopy(s.messages[:-1])
    prompt = fresh.render()
    assert s.cached_ids == prompt + r.tokens
    device = engine.embedding.device
    engine.prefill(fresh.cache, torch.tensor(prompt, device=device))
    engine.prefill(fresh.cache, torch.tensor(r.tokens, device=device))
    fresh.slot.ids = prompt + list(r.tokens)
    fresh.messages = copy.deepcopy(s.messages)
    assert live_equal(s.cache, fresh.cache)
    a = s.ask("And in Tokyo?", seed=5, **FAST)
    b = fresh.ask("And in Tokyo?", seed=5, **FAST)
    assert a.result.tokens == b.result.tokens
    assert live_equal(s.cache, fresh.cache)
