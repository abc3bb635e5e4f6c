"""The engine core's batched sampler on CUDA (core/lanes.py: lane_masks, lane_plans, lane_embeds; skips without CUDA):
on the demo model's engine, a batch of requests with mixed settings takes one accept-mask launch for its unfrozen
lanes and one sparse-SC pass shared by its lanes, and each request keeps the tokens it gets alone."""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

import diffgemma  # noqa: E402
from diffgemma import generate, generate_batch  # noqa: E402
from diffgemma.core import lanes as lanes_mod  # noqa: E402
from diffgemma.sampling import accept  # noqa: E402
from diffgemma.settings import GenerationSettings  # noqa: E402

MIXED = [{}, {"entropy_bound": 0.5}, {"t_min": 0.3, "t_max": 1.0, "sc_sparse_log_ratio": 6.0}, {"seed": 11},
         {"sc_mode": "exact"}, {"commit": "sample"}]


def test_mixed_lanes_share_the_sampler_launches_and_keep_their_tokens(monkeypatch):
    eng = diffgemma.load(None, device="cuda")
    tok = eng.tokenizer
    prompts = [tok.encode(p) for p in ("Name a colour.", "What is 2+2?", "Say hi.", "Count to five.",
                                       "What is 3 + 4?", "List two fruits.")]
    base = GenerationSettings.resolve(eng.generation_config, env={}, overrides={"max_new_tokens": 48,
                                                                                "max_denoising_steps": 8})
    settings = [base.replace(**{"seed": 5 + k, **m}) for k, m in enumerate(MIXED)]  # MIXED may set its own seed
    seen = {"accept": 0, "shared_plans": 0}
    kernel, plans = accept.sorted_prefix_lanes_triton, lanes_mod.SparsePlan.batch

    def lanes_kernel(*a):
        seen["accept"] += 1
        return kernel(*a)

    def batch(stats, *a, **kw):
        out = plans(stats, *a, **kw)
        seen["shared_plans"] = max(seen["shared_plans"], sum(p.shared is not None for p in out))
        return out

    monkeypatch.setattr(accept, "sorted_prefix_lanes_triton", lanes_kernel)
    monkeypatch.setattr(lanes_mod.SparsePlan, "batch", staticmethod(batch))
    batched = generate_batch(eng, prompts, settings=settings, max_batch=len(prompts))
    assert seen["accept"] > 0 and seen["shared_plans"] >= 2, seen
    for k, (p, s) in enumerate(zip(prompts, settings)):
        solo = generate(eng, p, settings=s)
        assert batched[k].tokens == solo.tokens, (k, MIXED[k])
