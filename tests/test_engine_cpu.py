"""The fast engine's torch path on the CPU against the reference model, on tiny random checkpoints.

f32 activations with an f32 KV cache must match the reference to f32 rounding (the engine is the
same math, re-associated); with the contract's f16 KV cache the logits move by f16 rounding only.
Prefill chunk sizes are chosen to straddle the sliding-window ring (wrap within and across chunks).
"""

import pytest
import torch

import diffgemma
from diffgemma.errors import InputError
from diffgemma.model.engine import Engine
from diffgemma.model.engine_graph import DenoiseGraph
from tiny_checkpoints import CONFIGS, build_model, save

pytest.importorskip("transformers")




@pytest.fixture(scope="module", params=sorted(CONFIGS))
def ref(request, tmp_path_factory):
    hf = build_model(CONFIGS[request.param], canvas_length=8)
    return diffgemma.load(save(hf, tmp_path_factory.mktemp(request.param)))


def two_blocks(model, prompt, canvas1, sc1, block1, canvas2, sc2, cache_tokens=256):
    cache = model.new_cache(cache_tokens)
    model.prefill(cache, prompt)
    a = model.denoise(cache, canvas1)
    b = model.denoise(cache, canvas1, sc_logits=sc1)
    model.prefill(cache, block1)
    c = model.denoise(cache, canvas2, sc_logits=sc2)
    sce = model.soft_embed(torch.softmax(sc2, -1).to(model.embedding.dtype))
    d = model.denoise(cache, canvas2, sc_embeds=sce)
    return a, b, c, d


def random_case(cfg, window_multiple):
    V, C = cfg.vocab_size, cfg.canvas_length
    T = max(1, int(cfg.sliding_window * window_multiple))
    return (torch.randint(0, V, (T,)), torch.randint(0, V, (C,)), torch.randn(C, V) * 4,
            torch.randint(0, V, (C,)), torch.randint(0, V, (C,)), torch.randn(C, V) * 4)


@pytest.mark.parametrize("window_multiple,chunk", [(0.5, 4096), (3, 4096), (3, 5), (4, 13)])
def test_engine_f32_matches_reference(ref, window_multiple, chunk):
    eng = Engine.from_reference(ref, dtype=torch.float32, kv_dtype=torch.float32, prefill_chunk=chunk)
    case = random_case(ref.config, window_multiple)
    for name, e, g in zip(("no SC", "SC logits", "block 2", "SC embeds"), two_blocks(ref, *case), two_blocks(eng, *case)):
        assert g.dtype == torch.float32 and g.shape == e.shape
        err = (g - e).abs().max().item()
        # f32 rounding, which these random models amplify with a heavy tail: over 5600 fresh cases (4 outputs each)
        # max |Δlogits| median 7e-6, 0.1 % of outputs over 7e-5, worst 2.0e-4 (3 cases over the old 1e-4 bound: with
        # 12 cases here about one suite run in 150 failed). A wiring fault (positions, ring slots, chunk edges) is
        # O(0.1-1); f16 KV rounding alone (the test below) is 0.005-0.01 in the median.
        assert err <= 1e-3, f"{name}: max |Δlogits| = {err:.3g}"


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def ref_all_experts(request, tmp_path_factory):
    # top_k = num_experts: routing has no discrete choice left, so KV rounding cannot flip an expert
    # (with real top-k, a near-tie flip on these tiny random models moves a row's logits by O(1)).
    tc = dict(CONFIGS[request.param])
    tc["top_k_experts"] = tc["num_experts"]
    return diffgemma.load(save(build_model(tc, canvas_length=8), tmp_path_factory.mktemp(request.param + "_all")))


def test_engine_f16_kv_close_to_reference(ref_all_experts):
    ref = ref_all_experts
    eng = Engine.from_reference(ref, dtype=torch.float32)  # contract KV dtype: f16
    assert eng.new_cache(64).keys[0].dtype == torch.float16
    e32 = Engine.from_reference(ref, dtype=torch.float32, kv_dtype=torch.float32)
    case = random_case(ref.config, 3)
    for e, g, r in zip(two_blocks(e32, *case), two_blocks(eng, *case), two_blocks(ref, *case)):
        rel = ((g - e).norm() / e.norm()).item()
        # against the same engine with an f32 cache: the difference is f16 KV rounding alone. Over 60 fresh models
        # (20 per config) the worst ||Δ||/||logits|| was 4.7e-3; a bf16 cache lands at 0.5-3e-2 (its rounding
        # unit is 8x f16's), a wiring fault (positions, ring slots) at O(1). The cache test below separates f16
        # from bf16 exactly; this bound keeps the logits honest.
        assert rel < 1e-2, f"||Δlogits|| / ||logits|| = {rel:.3g} against the f32-KV engine"
        cos = torch.nn.functional.cosine_similarity(r.flatten(), g.flatten(), dim=0).item()
        assert cos > 0.9995, f"cosine {cos:.7f} against the reference"


def test_f16_kv_cache_holds_the_f32_values_rounded_once(ref_all_experts):
    """Layer 0's K and V (the prompt's rows and the canvas scratch) come from the embeddings alone, computed the same
    way whatever the cache dtype: the f16 cache holds the f32 cache's numbers rounded to f16, bit for bit (a bf16
    cache, or values rounded through bf16 on the way in, differ in most elements). Deeper layers differ by the
    rounding's effect on the layers above, bounded by the logits test above."""
    ref = ref_all_experts
    cfg = ref.config
    prompt, canvas = torch.randint(0, cfg.vocab_size, (3 * cfg.sliding_window,)), torch.randint(0, cfg.vocab_size, (8,))
    caches = []
    for kv_dtype in (torch.float16, torch.float32):
        eng = Engine.from_reference(ref, dtype=torch.float32, kv_dtype=kv_dtype)
        cache = eng.new_cache(64)
        eng.prefill(cache, prompt)
        eng.denoise(cache, canvas)  # writes layer 0's canvas rows
        caches.append(cache)
    c16, c32 = caches
    assert c16.keys[0].dtype == c16.values[0].dtype == torch.float16
    assert torch.equal(c16.keys[0], c32.keys[0].to(torch.float16))
    assert torch.equal(c16.values[0], c32.values[0].to(torch.float16))


def test_truncate_then_reprefill_matches_straight_prefill(ref):
    cfg = ref.config
    eng = Engine.from_reference(ref, dtype=torch.float32, kv_dtype=torch.float32, prefill_chunk=7)
    V, C = cfg.vocab_size, cfg.canvas_length
    prompt, block, other = (torch.randint(0, V, (n,)) for n in (3 * cfg.sliding_window, C, C))
    canvas = torch.randint(0, V, (C,))
    # same prefill calls on both sides (chunking changes GEMM shapes, hence f32 rounding)
    straight = eng.new_cache(128)
    eng.prefill(straight, prompt)
    eng.prefill(straight, block)
    rewound = eng.new_cache(128)
    eng.prefill(rewound, prompt)
    eng.prefill(rewound, other)
    eng.denoise(rewound, canvas)
    rewound.truncate(len(prompt))
    eng.prefill(rewound, block)
    assert rewound.fingerprint() == straight.fingerprint()
    assert torch.equal(eng.denoise(rewound, canvas), eng.denoise(straight, canvas))


def test_a_commit_is_the_prefill_of_its_ids(ref):
    """Engine.commit (a block's kept ids) writes what prefill writes; off CUDA it checks their range as prefill does
    (tests/gpu/test_commit_graph_gpu.py: on CUDA it skips that host read)."""
    cfg = ref.config
    eng = Engine.from_reference(ref, dtype=torch.float32, kv_dtype=torch.float32)
    prompt, block = torch.randint(0, cfg.vocab_size, (2 * cfg.sliding_window,)), torch.randint(0, cfg.vocab_size, (5,))
    a, b = eng.new_cache(128), eng.new_cache(128)
    for cache in (a, b):
        eng.prefill(cache, prompt)
    eng.prefill(a, block)
    eng.commit(b, block)
    assert b.fingerprint() == a.fingerprint()
    with pytest.raises(InputError, match=r"commit ids: ids must be in \[0, "):
        eng.commit(b, torch.tensor([cfg.vocab_size]))


def test_live_window_mask_is_the_slot_positions_mask(ref):
    """The sliding canvas's live window (attention's ring_length: slot arithmetic on the cache length) names the
    same keys as the mask made from the cache's slot positions, through prefills that wrap the ring in and across
    chunks, rewinds within the slack and re-prefills; and the two engine forms give the same logits."""
    from diffgemma.ops.attention import ring_window_kpos

    cfg = ref.config
    eng = Engine.from_reference(ref, dtype=torch.float32, kv_dtype=torch.float32, prefill_chunk=5)
    V, C, W = cfg.vocab_size, cfg.canvas_length, cfg.sliding_window
    cache = eng.new_cache(256)
    canvas = torch.randint(0, V, (C,))
    checked = 0
    for step in (["prefill", 1], ["prefill", W - 2], ["prefill", 3], ["rewind", 2], ["prefill", 2 * W + 1],
                 ["rewind", cache.slack], ["prefill", W], ["rewind", cache.length]):
        op, n = step
        if op == "prefill":
            eng.prefill(cache, torch.randint(0, V, (n,)))
        else:
            cache.truncate(cache.length - n)
        expect = ring_window_kpos(cache.ring, cache.ring + C, cache.length_t, W)
        assert torch.equal(expect, eng.forward._slide_kpos(cache, C))
        if cache.length:
            eng.sliding_live_window = False
            masked = eng.denoise(cache, canvas)
            eng.sliding_live_window = True
            assert torch.equal(eng.denoise(cache, canvas), masked)
        checked += 1
    assert checked == 8


def test_truncate_deeper_than_ring_is_an_error(ref):
    cfg = ref.config
    eng = Engine.from_reference(ref, dtype=torch.float32)
    cache = eng.new_cache(256, rewind_slack=2)
    eng.prefill(cache, torch.randint(0, cfg.vocab_size, (cache.ring + 6,)))
    with pytest.raises(InputError, match="ring"):
        cache.truncate(cache.length - 5)
    cache.truncate(cache.length - 2)  # within the slack: fine
    cache.truncate(0)  # rewinding everything is always possible
    assert cache.length == 0 and (cache.slot_pos < 0).all()


def test_rewind_falls_back_to_an_empty_cache(ref):
    """slots.rewind (the Session's and the server's KV reuse): a rewind the ring cannot undo empties the cache
    (the caller prefills the whole prompt again) instead of failing the turn."""
    from diffgemma.slots import reuse_prefix, rewind

    eng = Engine.from_reference(ref, dtype=torch.float32)
    cache = eng.new_cache(256, rewind_slack=2)
    ids = torch.randint(0, ref.config.vocab_size, (cache.ring + 6,)).tolist()
    eng.prefill(cache, torch.tensor(ids))
    assert rewind(cache, cache.length - 2) == len(ids) - 2 and cache.length == len(ids) - 2
    assert rewind(cache, cache.length - 5) == 0 and cache.length == 0
    eng.prefill(cache, torch.tensor(ids))
    assert reuse_prefix(cache, ids, ids) == len(ids) - 1  # one token is always left to condition on
    assert reuse_prefix(cache, ids, ids[:3] + [ids[3] + 1]) == 0  # shares 3, but the ring cannot go back that far


def test_engine_rejects_bad_inputs(ref):
    eng = Engine.from_reference(ref, dtype=torch.float32)
    cache = eng.new_cache(32)
    with pytest.raises(InputError, match="max_tokens"):
        eng.prefill(cache, torch.zeros(40, dtype=torch.long))
    with pytest.raises(InputError, match=r"\[0, "):
        eng.prefill(cache, torch.tensor([ref.config.vocab_size]))
    eng.prefill(cache, torch.tensor([1, 2, 3]))
    C, V = ref.config.canvas_length, ref.config.vocab_size
    with pytest.raises(InputError, match="sc_logits"):
        eng.denoise(cache, torch.zeros(C, dtype=torch.long), sc_logits=torch.zeros(C, V + 1))
    with pytest.raises(InputError, match="not both"):
        eng.denoise(cache, torch.zeros(C, dtype=torch.long), sc_logits=torch.zeros(C, V),
                    sc_embeds=torch.zeros(C, ref.config.hidden_size))



def test_graphs_die_with_their_cache(ref, monkeypatch):
    # A captured graph reads its cache's buffers: it must never be replayed for another cache, even one
    # that Python allocates at the address of a freed one (the id-keyed table did exactly that).
    import gc

    eng = Engine.from_reference(ref, dtype=torch.float32)
    V = ref.config.vocab_size
    captures = []

    class FakeGraph:
        def replay(self):
            pass

    def fake_capture(cache, C, key_rows, mode, sc):
        captures.append(C)
        return DenoiseGraph(FakeGraph(), torch.zeros(C, dtype=torch.long), None, torch.randn(C, V))

    monkeypatch.setattr(eng, "_capture", fake_capture)
    ids = torch.randint(0, V, (4,))
    c1 = eng.new_cache(64)
    eng._denoise_graphed(c1, ids, "none", None)
    eng._denoise_graphed(c1, ids, "none", None)
    assert len(captures) == 1 and len(eng._graphs) == 1  # replayed, not re-captured
    del c1
    gc.collect()
    assert len(eng._graphs) == 0
    for _ in range(3):  # fresh caches (often at a recycled address) always capture their own graph
        c = eng.new_cache(64)
        eng._denoise_graphed(c, ids, "none", None)
        del c
        gc.collect()
    assert len(captures) == 4


def test_fast_engine_generates_the_golden_tokens():
    # The demo model's golden cases through the fast engine's code path (torch twins on the CPU, f32
    # compute, the contract's f16 KV cache): every token equal to the reference-pinned fixture.
    from diffgemma import golden

    ref = diffgemma.load(None, device="cpu")
    eng = Engine.from_reference(ref, dtype=torch.float32)
    fixture = golden.load_fixture(golden.fixture_path(ref))
    expected = fixture.get("cases", fixture)
    for case in golden.CASES:
        assert golden.run_case(eng, case)["tokens"] == expected[case.name]["tokens"], case.name


def test_staging_is_a_no_op_without_graphs(ref):
    """stage_denoise (generate's early copy of a graphed call's inputs) stages nothing off CUDA, and the call that
    follows computes as it would have (tests/gpu/test_engine_gpu.py checks the staged replay itself)."""
    eng = Engine.from_reference(ref, dtype=torch.float32)
    V, H = ref.config.vocab_size, ref.config.hidden_size
    cache = eng.new_cache(64)
    eng.prefill(cache, torch.randint(0, V, (5,)))
    ids, sc = torch.randint(0, V, (4,)), torch.randn(4, H)
    want = eng.denoise_raw(cache, ids, sc_embeds=sc)
    assert eng.stage_denoise(cache, ids, sc_embeds=sc) is False and eng._staged is None
    assert torch.equal(eng.denoise_raw(cache, ids, sc_embeds=sc), want)
    go = torch.tensor(True)
    assert eng.stage_denoise(cache, ids, sc_embeds=sc, go=go) is False and eng._ahead is None
    assert torch.equal(eng.denoise_raw(cache, ids, sc_embeds=sc), want)


def test_guarded_graphs_say_why_not_off_cuda():
    from diffgemma.model.graph_guard import guard_support

    assert guard_support(torch.device("cpu")) == "not a CUDA device"
