"""The flash attention kernel (ops/attention_flash.py) against the f32 twin, through TRITON_INTERPRET=1.

Tiny shapes with the real layouts: GQA folded rows, the sliding ring (unordered, with empty slots and a
wrap), the canvas scratch rows, a graph's padded bucket (nlive < key rows), head dims scaled down from
256 / 512 (the 512 stand-in uses two output halves, BD = d/2, as the real config does). Key rows that
must never be read hold NaN. Fresh random data every run (tests/conftest.py prints the seed on failure).
The kernel writes f32 here, compared with the twin at 1e-3 relative (tests/attention_cases.py); a bf16 output's
rounding (~4e-3) would hide an error of that size, so the bf16 store is checked on its own, against the f32 output.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first triton import

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

from attention_cases import assert_close_f32  # noqa: E402
from diffgemma.ops import attention as attn  # noqa: E402
from diffgemma.ops import attention_flash as fl  # noqa: E402

TILE = dict(BM=16, BN=16, num_warps=4, num_stages=1)


def qkv(H, KV, n, rows, d):
    q = torch.randn(H, n, d).half()
    k = (torch.randn(KV, rows, d) * d ** -0.5 * 3).half()  # logits of a few units: a peaked softmax
    v = torch.randn(KV, rows, d).half()
    return q, k, v


def check(got, exp):
    assert_close_f32(got, exp)  # f32 output: a 1e-3 relative bound, tight enough to see a 0.4 % scale error


@pytest.mark.parametrize("d,BD,splits", [(32, 32, 1), (32, 32, 3), (64, 32, 2), (64, 32, None)])
def test_canvas_split_kv(d, BD, splits):
    """Bidirectional canvas over a sliding layer's rows: ring slots (some empty or out of the window),
    then the canvas scratch. Split or not, the merge must give the twin's numbers."""
    H, KV, C, ring = 4, 2, 12, 37
    q, k, v = qkv(H, KV, C, ring + C + 5, d)
    n_keys = ring + C
    kpos = torch.where(torch.rand(n_keys) < 0.35, -1, 0)
    kpos[ring:] = 0  # the canvas always sees itself
    k[:, n_keys:] = float("nan")  # rows past n_keys are never read
    v[:, :n_keys][:, kpos < 0] = float("nan")  # masked V rows are never read
    got = fl.attention_flash(q, k, v, kpos, n_keys, out_dtype=torch.float32, splits=splits, BD=BD, **TILE)
    exp = attn.attention_ref(q, k, v, kpos, n_keys, out_dtype=torch.float32)
    check(got, exp)


@pytest.mark.parametrize("splits", [2, 4])
def test_canvas_nlive_bucket(splits):
    """A full layer's canvas in a graph bucket: rows [0, nlive) visible, [nlive, key_rows) padding (NaN,
    never read); the last split lies wholly past nlive and must count for nothing in the merge."""
    H, KV, C, d = 8, 2, 8, 32
    key_rows, live = 96, 41
    q, k, v = qkv(H, KV, C, key_rows, d)
    kpos = torch.where(torch.arange(key_rows) < live, 0, -1)
    k[:, live:] = v[:, live:] = float("nan")
    got = fl.attention_flash(q, k, v, kpos, key_rows, out_dtype=torch.float32, nlive=torch.tensor(live),
                             splits=splits, BD=32, **TILE)
    exp = attn.attention_ref(q, k, v, kpos, key_rows, out_dtype=torch.float32)
    check(got, exp)
    auto = fl.num_splits(key_rows, 1, 16, 132, 1)
    assert auto[0] * auto[1] >= key_rows and (auto[0] - 1) * auto[1] < key_rows


@pytest.mark.parametrize("splits", [1, 3])
def test_canvas_without_kpos_equals_kpos_below_nlive(splits):
    """kpos=None (the full layers' canvas): every row below nlive is a key. Same numbers as the explicit
    per-key mask, rows past nlive (NaN) never read, in the kernel and in the dispatch's twins."""
    H, KV, C, d = 8, 2, 8, 32
    key_rows, live = 96, 53
    q, k, v = qkv(H, KV, C, key_rows, d)
    k[:, live:] = v[:, live:] = float("nan")
    kpos = torch.where(torch.arange(key_rows) < live, 0, -1)
    nlive = torch.tensor(live)
    got = fl.attention_flash(q, k, v, None, key_rows, out_dtype=torch.float32, nlive=nlive, splits=splits, BD=32, **TILE)
    with_kpos = fl.attention_flash(q, k, v, kpos, key_rows, out_dtype=torch.float32, nlive=nlive, splits=splits,
                                   BD=32, **TILE)
    assert torch.equal(got, with_kpos)
    exp = attn.attention_ref(q, k, v, kpos, key_rows, out_dtype=torch.float32)
    check(got, exp)
    check(attn.attention(q, k, v, None, key_rows, out_dtype=torch.float32, impl="ref", nlive=nlive), exp)
    with pytest.raises(ValueError, match="kpos=None"):
        attn.attention(q, k, v, None, key_rows, qpos=torch.arange(C), causal=True, impl="ref")


def ring_slot_positions(ring: int, L: int) -> torch.Tensor:
    """Slot -> position of a ring after L tokens (slot p % ring holds p; -1 where nothing was written)."""
    sp = torch.full((ring,), -1, dtype=torch.int64)
    p = torch.arange(max(0, L - ring), L)
    sp[p % ring] = p
    return sp


@pytest.mark.parametrize("L", [0, 5, 8, 11, 12, 30, 97])
@pytest.mark.parametrize("splits", [None, 1, 3])
def test_canvas_live_window(L, splits):
    """A sliding canvas with ring_length (the engine's call): only the ring's last window-1 positions and the
    canvas are keys, visited in position order and split as such. Same numbers as the per-key mask made from
    the slot positions, with every other ring slot NaN (never read): an empty ring, a partly written one,
    exactly full, and wrapped at several phases."""
    H, KV, C, d, W, ring = 4, 2, 8, 32, 9, 12  # ring = window - 1 + a rewind slack of 4
    n_keys = ring + C
    q, k, v = qkv(H, KV, C, n_keys + 3, d)
    sp = ring_slot_positions(ring, L)
    kpos = torch.cat([torch.where((sp >= 0) & (sp > L - W), 0, -1), torch.zeros(C, dtype=torch.int64)])
    k[:, n_keys:] = float("nan")
    k[:, :n_keys][:, kpos < 0] = v[:, :n_keys][:, kpos < 0] = float("nan")
    length = torch.tensor(L)
    assert torch.equal(attn.ring_window_kpos(ring, n_keys, length, W), kpos)
    got = fl.attention_flash(q, k, v, None, n_keys, window=W, n_ring=ring, ring_length=length, out_dtype=torch.float32,
                             splits=splits, BD=32, **TILE)
    exp = attn.attention_ref(q, k, v, kpos, n_keys, out_dtype=torch.float32)
    check(got, exp)
    # the dispatcher: the kernel, and the twins through the mask ring_length stands for
    assert torch.equal(attn.attention(q, k, v, None, n_keys, window=W, n_ring=ring, ring_length=length, impl="triton",
                                      out_dtype=torch.float32), fl.attention_flash(
        q, k, v, None, n_keys, window=W, n_ring=ring, ring_length=length, out_dtype=torch.float32))
    check(attn.attention(q, k, v, None, n_keys, window=W, n_ring=ring, ring_length=length, impl="ref",
                         out_dtype=torch.float32), exp)


def test_live_window_splits_divide_only_the_visited_keys():
    """The split count and length come from the keys a live-window call visits (window-1 + canvas), not the
    ring's rows: at the real shape (16 heads on 8 KV heads, 256 canvas rows, the sliding config) 1279 keys."""
    assert fl.live_keys(1535, 1279, 1024) == 1279
    c = fl.flash_config(256, False, live=True)
    base = -(-2 * 256 // c["BM"]) * 8 * (256 // c["BD"])
    S, per = fl.num_splits(fl.live_keys(1535, 1279, 1024), base, c["BN"], 132, c["waves"])
    assert per % c["BN"] == 0 and S * per >= 1279 and (S - 1) * per < 1279
    assert per < fl.num_splits(1535, base, c["BN"], 132, c["waves"])[1]  # shorter slices than over every ring row
    q, k, v = qkv(4, 2, 8, 24, 32)
    for bad in (dict(kpos=torch.zeros(20, dtype=torch.int64)), dict(causal=True, qpos=torch.arange(8)),
                dict(nlive=torch.tensor(3)), dict(n_ring=0), dict(window=fl.NO_WINDOW)):
        kw = dict(kpos=None, window=9, n_ring=12, ring_length=torch.tensor(5))
        kw.update(bad)
        with pytest.raises(ValueError, match="ring_length|not causal"):
            fl.attention_flash(q, k, v, kw.pop("kpos"), 20, **kw)
        kw = dict(kpos=None, window=9, n_ring=12, ring_length=torch.tensor(5))
        kw.update(bad)
        with pytest.raises(ValueError, match="ring_length|not causal"):  # the dispatcher refuses it, not a fallback
            attn.attention(q, k, v, kw.pop("kpos"), 20, impl="triton", **kw)


def test_num_splits_is_static_and_covers():
    for n_keys in (1, 100, 1280, 1535, 8448, 33024):
        for base, BN in ((32, 64), (8, 32), (128, 64)):
            S, per = fl.num_splits(n_keys, base, BN, 132, 1)
            assert S >= 1 and per % BN == 0 or S == 1
            assert S * per >= n_keys and (S - 1) * per < n_keys  # every key in exactly one slice, none empty
    assert fl.num_splits(33024, 32, 32, 132, 1)[0] == 4  # one wave of 128 programs on the 132 SMs
    assert fl.num_splits(200, 32, 64, 132, 1)[0] == 1  # too few keys to split


@pytest.mark.parametrize("d,BD,window", [(32, 32, 9), (64, 32, 9), (64, 32, attn.NO_WINDOW)])
def test_causal_ring_then_chunk(d, BD, window):
    """Sliding prefill layout: the ring as it was (wrapped: slot order != position order, some empty),
    then the chunk's own keys in position order; window-restricted causal mask."""
    H, KV, n, ring, P = 4, 2, 40, 13, 57
    q, k, v = qkv(H, KV, n, ring + n + 3, d)
    ring_pos = torch.arange(P - ring, P)
    ring_pos = torch.roll(ring_pos, int(torch.randint(1, ring, ())))  # the wrap
    ring_pos[torch.rand(ring) < 0.2] = -1  # empty slots
    kpos = torch.cat([ring_pos, torch.arange(P, P + n)])
    n_keys = ring + n
    k[:, n_keys:] = float("nan")
    v[:, :n_keys][:, kpos < 0] = float("nan")
    qpos = torch.arange(P, P + n)
    got = fl.attention_flash(q, k, v, kpos, n_keys, qpos=qpos, window=window, causal=True, out_dtype=torch.float32,
                             n_ring=ring, base_pos=P, BD=BD, **TILE)
    exp = attn.attention_ref(q, k, v, kpos, n_keys, qpos=qpos, window=window, causal=True, out_dtype=torch.float32)
    check(got, exp)


@pytest.mark.parametrize("d,BD,BM", [(64, 32, 16), (32, 32, 32)])
def test_causal_full_layer(d, BD, BM):
    """Full-layer prefill: key i holds position i, the chunk's queries are the last n positions; n not a
    multiple of BM, so a row block straddles two heads of the folded group."""
    H, KV, n, P = 8, 2, 27, 50
    q, k, v = qkv(H, KV, n, P + n + 4, d)
    n_keys = P + n
    k[:, n_keys:] = v[:, n_keys:] = float("nan")
    kpos, qpos = torch.arange(n_keys), torch.arange(P, P + n)
    got = fl.attention_flash(q, k, v, kpos, n_keys, qpos=qpos, causal=True, out_dtype=torch.float32, BD=BD,
                             **dict(TILE, BM=BM))
    exp = attn.attention_ref(q, k, v, kpos, n_keys, qpos=qpos, causal=True, out_dtype=torch.float32)
    check(got, exp)


def ring_case(d, ring, P, n, shift, empty=0.0):
    """A sliding prefill's keys: ring slot p % ring holds position p for the last `ring` positions before P (some
    emptied), then the chunk's n keys. shift: kernel positions are real ones + shift (prefill_padded's)."""
    q, k, v = qkv(4, 2, n, ring + n, d)
    slot_pos = torch.full((ring,), -1)
    p = torch.arange(max(0, P - ring), P)
    slot_pos[p % ring] = p
    slot_pos[torch.rand(ring) < empty] = -1
    kpos = torch.cat([torch.where(slot_pos >= 0, slot_pos + shift, -1), torch.arange(P, P + n) + shift])
    return q, k, v, kpos, torch.arange(P, P + n) + shift


@pytest.mark.parametrize("ring,P,n,window,shift", [(37, 100, 8, 20, 0), (37, 75, 8, 20, 0), (37, 41, 5, 30, 0),
                                                   (37, 10, 8, 20, 0), (37, 95, 8, 20, 37 - 95), (53, 130, 16, 17, 0),
                                                   (37, 100, 8, 38, 0), (37, 0, 8, 20, 0)])
def test_causal_ring_skip_keeps_the_full_scans_bits(ring, P, n, window, shift):
    """ring_end: the ring blocks no row sees are skipped (in one run, or two when the live slots wrap), and the
    output is the full scan's, bit for bit: a masked block changes nothing. Kernel positions plain (the eager
    prefill) or shifted (the padded one: base_pos = ring, real positions + ring - P)."""
    d = 32
    q, k, v, kpos, qpos = ring_case(d, ring, P, n, shift, empty=0.15)
    kw = dict(qpos=qpos, window=window, causal=True, out_dtype=torch.float32, n_ring=ring, base_pos=P + shift,
              **dict(TILE, BN=8))
    full = fl.attention_flash(q, k, v, kpos, ring + n, **kw)
    skip = fl.attention_flash(q, k, v, kpos, ring + n, ring_end=torch.tensor(P), **kw)
    assert torch.equal(skip, full)
    check(skip, attn.attention_ref(q, k, v, kpos, ring + n, qpos=qpos, window=window, causal=True,
                                   out_dtype=torch.float32))


def test_causal_ring_skip_reads_only_the_live_slots():
    """The skip trusts the ring's layout (slot p % ring holds p): a key planted in a slot outside the live window's
    blocks is not visited with ring_end, and is without it (so the skip is real)."""
    d, ring, P, n, window = 32, 64, 200, 8, 12
    q, k, v, kpos, qpos = ring_case(d, ring, P, n, 0)
    live = {int(p) % ring for p in range(P - window + 1, P)}
    far = next(s for s in range(ring) if all(abs(s - x) >= 16 for x in live))  # two blocks of 8 from any live slot
    kpos[far] = P - 1  # claims a visible position
    kw = dict(qpos=qpos, window=window, causal=True, out_dtype=torch.float32, n_ring=ring, base_pos=P,
              **dict(TILE, BN=8))
    kpos_ok = kpos.clone()
    kpos_ok[far] = -1
    exp = fl.attention_flash(q, k, v, kpos_ok, ring + n, **kw)
    assert torch.equal(fl.attention_flash(q, k, v, kpos, ring + n, ring_end=torch.tensor(P), **kw), exp)
    assert not torch.equal(fl.attention_flash(q, k, v, kpos, ring + n, **kw), exp)


def test_short_causal_calls_take_4_warps_only_at_head_dim_512():
    full, slide = fl.flash_config(512, True), fl.flash_config(256, True)
    assert fl.short_causal(full, 8 * 256, 2, 512, 132) == dict(BD=256, num_warps=4)  # a commit's full layer
    assert fl.short_causal(full, 8 * 8192, 2, 512, 132) == dict(BD=512)  # a long chunk keeps its config
    assert fl.short_causal(slide, 2 * 256, 8, 256, 132) == dict(BD=128)


def test_long_causal_chunks_at_head_dim_512_take_the_tile_table():
    """A long prompt's chunk at head dim 512 takes the tiles of the last LONG_CAUSAL_TILES row it reaches (rows and
    keys at least the row's); anything shorter, or another head dim, keeps flash_config and the short-call rule."""
    table = fl.LONG_CAUSAL_TILES
    assert [k for _, k, _ in table] == sorted(k for _, k, _ in table)
    for rows, keys, tiles in table:
        assert fl.long_causal_tiles(512, rows, keys) is tiles and 512 % tiles["BD"] == 0
        assert fl.long_causal_tiles(512, 1 << 20, keys) is tiles or keys < table[-1][1]
        assert fl.long_causal_tiles(256, rows, keys) is None
    rows, keys, _ = table[0]
    assert fl.long_causal_tiles(512, rows - 1, keys) is None and fl.long_causal_tiles(512, rows, keys - 1) is None
    with_more = (*table, (table[0][0], 2 * table[-1][1], dict(BM=64, BN=64, BD=512, num_warps=8, num_stages=1)))
    orig, fl.LONG_CAUSAL_TILES = fl.LONG_CAUSAL_TILES, with_more
    try:  # a longer row wins from its keys on, the earlier rows below them
        assert fl.long_causal_tiles(512, rows, 2 * table[-1][1]) is with_more[-1][2]
        assert fl.long_causal_tiles(512, rows, 2 * table[-1][1] - 1) is table[-1][2]
    finally:
        fl.LONG_CAUSAL_TILES = orig


def test_causal_column_halves_give_the_whole_rows_bits():
    """The causal call's output columns split over more programs (causal_columns): each half recomputes QK^T and
    visits the same key blocks in the same order, so the result is the whole-row program's. On the GPU the bits are
    equal (tests/gpu/test_attention_gpu.py); the interpreter's dots run on the host BLAS, whose summation order may
    depend on the output width, so here the halves must agree to f32 rounding."""
    H, KV, n, ring, P, d = 4, 2, 24, 13, 40, 64
    q, k, v = qkv(H, KV, n, ring + n, d)
    ring_pos = torch.roll(torch.arange(P - ring, P), 5)
    kpos = torch.cat([ring_pos, torch.arange(P, P + n)])
    qpos = torch.arange(P, P + n)
    kw = dict(qpos=qpos, window=20, causal=True, out_dtype=torch.float32, n_ring=ring, base_pos=P, **TILE)
    whole = fl.attention_flash(q, k, v, kpos, ring + n, BD=d, **kw)
    for bd in (d // 2, d // 4):
        got = fl.attention_flash(q, k, v, kpos, ring + n, BD=bd, **kw)
        assert (got - whole).abs().max() <= 4e-6 * whole.abs().max(), bd


def test_causal_columns_split_only_short_calls():
    """At the real shapes on 132 SMs: a block's commit (256 rows) takes column halves on both layer kinds; an
    8192-row prompt chunk keeps whole rows (its programs fill the GPU already); so does a BD under 128."""
    slide, full = fl.flash_config(256, True), fl.flash_config(512, True)
    assert fl.causal_columns(slide, 2 * 256, 8, 256, 132) == 128  # 64 programs -> 128
    assert fl.causal_columns(full, 8 * 256, 2, 512, 132) == 256
    assert fl.causal_columns(slide, 2 * 8192, 8, 256, 132) == 256
    assert fl.causal_columns(full, 8 * 8192, 2, 512, 132) == 512
    assert fl.causal_columns(dict(slide, BD=64), 2 * 16, 1, 64, 132) == 64


@pytest.mark.parametrize("splits", [1, 3])
def test_bf16_output_is_the_f32_output_rounded(splits):
    """out_dtype=bf16 (the engine's) rounds the same f32 numbers once, in the kernel's last store or the merge's."""
    H, KV, C, d = 4, 2, 12, 32
    q, k, v = qkv(H, KV, C, 64, d)
    kpos = torch.where(torch.rand(64) < 0.3, -1, 0)
    kpos[-C:] = 0
    got = fl.attention_flash(q, k, v, kpos, 64, out_dtype=torch.bfloat16, splits=splits, BD=32, **TILE)
    f32 = fl.attention_flash(q, k, v, kpos, 64, out_dtype=torch.float32, splits=splits, BD=32, **TILE)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), f32.to(torch.bfloat16).float(), atol=0, rtol=2 ** -7)  # <= 1 bf16 ulp (the interpreter may truncate)


def test_dispatcher_routes_to_flash():
    """attention(impl='triton') is the flash kernel; its numbers equal a direct call bit for bit."""
    H, KV, C, d = 4, 2, 16, 32
    q, k, v = qkv(H, KV, C, 64, d)
    kpos = torch.where(torch.rand(64) < 0.3, -1, 0)
    kpos[-C:] = 0
    v[:, kpos < 0] = 0.0
    a = attn.attention(q, k, v, kpos, 64, impl="triton", out_dtype=torch.float32)
    b = fl.attention_flash(q, k, v, kpos, 64, out_dtype=torch.float32)
    assert torch.equal(a, b)
    check(a, attn.attention_ref(q, k, v, kpos, 64, out_dtype=torch.float32))


@pytest.mark.parametrize("window,n_ring", [(attn.NO_WINDOW, 0), (24, 0), (24, 13)])
def test_causal_interior_blocks_keep_the_bits(window, n_ring):
    """Causal blocks every row of a program sees whole run unmasked (interior) with the masked scan's bits."""
    H, KV, n, P, d = 4, 2, 21, 70, 32
    q, k, v = qkv(H, KV, n, n_ring + P + n, d)
    if n_ring:  # a ring before the position-ordered keys, as a sliding layer's prefill has it
        kpos = torch.cat([torch.arange(P - n_ring, P), torch.arange(P, P + n)])
        kpos, n_keys, base = kpos, n_ring + n, P
        k, v = k[:, :n_keys + 3].contiguous(), v[:, :n_keys + 3].contiguous()
    else:
        kpos, n_keys, base = torch.arange(P + n), P + n, 0
    qpos = torch.arange(P, P + n)
    kw = dict(qpos=qpos, window=window, causal=True, out_dtype=torch.float32, n_ring=n_ring, base_pos=base,
              BM=16, BN=8, num_warps=4, num_stages=1)
    on = fl.attention_flash(q, k, v, kpos, n_keys, **kw)
    off = fl.attention_flash(q, k, v, kpos, n_keys, interior=False, **kw)
    assert torch.equal(on, off)
    check(on, attn.attention_ref(q, k, v, kpos, n_keys, qpos=qpos, window=window, causal=True,
                                 out_dtype=torch.float32))
