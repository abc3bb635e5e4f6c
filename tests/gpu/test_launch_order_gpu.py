"""Engine.launch_order on the GPU: it reorders the expert GEMMs' programs (most-loaded expert first) and must not
change a bit of what they compute. Off CUDA the plan carries no order, so both settings run the same code and
the comparison would prove nothing: this file skips without CUDA.
"""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


from tiny_checkpoints import mid_engine  # noqa: E402

DEV = "cuda"


@pytest.mark.parametrize("use_graphs", [False, True])
def test_launch_order_leaves_the_cache_and_logits_unchanged(use_graphs):
    eng = mid_engine(DEV, int(torch.randint(0, 2**31, (1,))))
    cfg = eng.config
    assert eng.launch_order  # the default
    V = cfg.vocab_size
    prompt, ids = torch.randint(0, V, (700,), device=DEV), torch.randint(0, V, (64,), device=DEV)
    sc = torch.randn(64, V, device=DEV) * 3
    out = {}
    for order in (True, False):
        eng.launch_order = order
        eng.use_graphs = use_graphs
        eng.clear_graphs()
        cache = eng.new_cache(1024)
        eng.prefill(cache, prompt)
        out[order] = (cache.keys[-1].clone(), cache.values[-1].clone(), eng.denoise(cache, ids),
                      eng.denoise(cache, ids, sc_logits=sc))
        if use_graphs:
            assert eng.graph_error is None, eng.graph_error
    for a, b in zip(out[True], out[False]):
        assert torch.equal(a, b)
