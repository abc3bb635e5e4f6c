"""Expert parallel on CUDA: the demo model on one rank (bit for bit the engine, graphs and staging included) and on
two GPUs over NCCL (the step and the padded prefills graphed with the all-reduce captured inside).

Two ranks add the experts' f32 sums in another order and round the residual to bf16 after it, so their logits are
compared within bf16 rounding; the graphs must have been captured (no fallback to eager).
"""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

import diffgemma  # noqa: E402
from diffgemma.generation import generate  # noqa: E402
from diffgemma import launch  # noqa: E402
from diffgemma.parallel.engine import LeadEngine  # noqa: E402
from diffgemma.parallel.group import Group  # noqa: E402

GEN = dict(max_new_tokens=64)


def _calls(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    V, C = model.config.vocab_size, model.config.canvas_length
    prompt = torch.randint(0, V, (300,), generator=g).cuda()
    canvas = torch.randint(0, V, (C,), generator=g).cuda()
    cache = model.new_cache(2048)
    model.prefill(cache, prompt)  # a padded prefill: its graph
    out = [model.denoise(cache, canvas).clone()]
    out.append(model.denoise(cache, canvas, sc_embeds=model.embed(canvas)).clone())
    model.prefill(cache, canvas[:40])
    out.append(model.denoise(cache, canvas, sc_logits=out[0]).clone())
    return prompt, out


def test_one_rank_on_cuda_is_the_engine_bit_for_bit():
    engine = diffgemma.load(None, device="cuda")
    lead = diffgemma.load(None, device="cuda", group=Group(device=torch.device("cuda", 0)))
    assert isinstance(lead, LeadEngine)
    prompt, want = _calls(engine)
    _, got = _calls(lead)
    for a, b in zip(want, got):
        assert torch.equal(a, b)
    assert generate(lead, prompt, seed=3, **GEN).tokens == generate(engine, prompt, seed=3, **GEN).tokens


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_graphed_with_nccl_match_the_engine():
    engine = diffgemma.load(None, device="cuda")
    prompt, want = _calls(engine)
    tokens = generate(engine, prompt, seed=3, **GEN).tokens
    del engine
    ranks = launch.start(2, "cuda", launch.load_rank, (None,), watch=False, timeout=60)
    try:
        lead = diffgemma.load(None, device="cuda", group=ranks.group)
        _, got = _calls(lead)
        assert lead.use_graphs and lead.graph_error is None, lead.graph_error
        assert any(lead._graphs.values()) and any(lead._prefill_graphs.values())
        for a, b in zip(want, got):
            rel = ((a.float() - b.float()).abs().max() / a.float().abs().max()).item()
            assert rel < 2e-2, rel
            assert (a.argmax(-1) == b.argmax(-1)).float().mean().item() > 0.95
        got_tokens = generate(lead, prompt, seed=3, **GEN).tokens
        same = next((i for i, (x, y) in enumerate(zip(tokens, got_tokens)) if x != y),
                    min(len(tokens), len(got_tokens)))
        print(f"\n[parallel gpu] seeded tokens identical for {same} of {len(tokens)}")
    finally:
        ranks.stop()
    assert [p.exitcode for p in ranks.procs] == [0]
