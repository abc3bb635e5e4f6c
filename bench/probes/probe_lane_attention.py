"""Probe: a batched denoise's attention lane by lane (as model/lane_attention.lanes_attend runs it) against one
launch over all lanes.

    PYTHONPATH=src:. python -m bench.probes.probe_lane_attention --json $OUT/lanes.json
    PYTHONPATH=src:. TRITON_INTERPRET=1 python -m bench.probes.probe_lane_attention --tiny     # CPU dry run

At the denoise shape (B lanes of a 256-row canvas over a cache of --context tokens), per layer kind, the canvas
attention the engine runs (sliding: the flash kernel over the ring's live window; full: the tile kernels):
  serial    the B lanes' calls one after another on one stream
  streams   each lane on a stream of its own, forked and joined (options.lane_streams, the engine's default)
  folded    one call over all lanes: the lanes' KV heads stacked as more heads of one cache tensor (what a single
            launch over all lanes would cost; the sliding kernel keeps the solo call's key splits, so each lane's
            rows get the solo bits, which the probe checks)
Times: GPU µs for all B lanes, the calls captured in one CUDA graph, the median of --reps replays
(bench/bench_engine.time_graph). The forward's saving if every layer ran folded: 25 sliding + 5 full layers.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from diffgemma.ops.attention import attention
from diffgemma.ops.attention_flash import attention_flash, device_sms, flash_config, live_keys, num_splits
from diffgemma.ops.attention_tiles import attention_tiles

FULL = dict(B=8, H=16, kv={"sliding": 8, "full": 2}, hd={"sliding": 256, "full": 512}, window=1024, C=256,
            layers={"sliding": 25, "full": 5})
TINY = dict(B=3, H=4, kv={"sliding": 2, "full": 1}, hd={"sliding": 32, "full": 64}, window=16, C=8,
            layers={"sliding": 25, "full": 5})


def solo_splits(q, kv_heads, n_keys, n_ring, window) -> int:
    """The key splits the flash kernel gives one lane's sliding canvas call (attention_flash's rule)."""
    H, n, d = q.shape
    c = flash_config(d, False, n_keys, live=True)
    row_blocks = -(-(H // kv_heads) * n // c["BM"])
    programs = row_blocks * kv_heads * (d // c["BD"])
    return num_splits(live_keys(n_keys, n_ring, window), programs, c["BN"], device_sms(q), c["waves"])[0]


def lane_calls(kind, p, L, dev, gen):
    """-> (per-lane call, folded call, check) for B lanes of layer kind at cache length L."""
    B, H, C, W = p["B"], p["H"], p["C"], p["window"]
    KV, d = p["kv"][kind], p["hd"][kind]
    f16 = torch.float16
    if kind == "sliding":
        R = W - 1 + C
        rows, n_keys = R + C, R + C
    else:
        R = 0
        rows = L + 2 * C
        n_keys = -(-(L + C) // C) * C  # the key-row bucket
    q = torch.randn(B, H, C, d, generator=gen, device="cpu").to(dev, f16)
    K = torch.randn(B * KV, rows, d, generator=gen, device="cpu").to(dev, f16)
    V = torch.randn(B * KV, rows, d, generator=gen, device="cpu").to(dev, f16)
    length = torch.full((), L, dtype=torch.int64, device=dev)
    nlive = length + C
    qf = q.reshape(B * H, C, d)

    if kind == "sliding":
        def one(b):
            return attention(q[b], K[b * KV:(b + 1) * KV], V[b * KV:(b + 1) * KV], None, n_keys,
                             out_dtype=torch.bfloat16, window=W, n_ring=R, ring_length=length, impl="triton")
        S = solo_splits(q[0], KV, n_keys, R, W)

        def folded():
            return attention_flash(qf, K, V, None, n_keys, out_dtype=torch.bfloat16, window=W, n_ring=R,
                                   ring_length=length, splits=S)
    else:
        def one(b):
            return attention_tiles(q[b], K[b * KV:(b + 1) * KV], V[b * KV:(b + 1) * KV], n_keys, nlive=nlive,
                                   out_dtype=torch.bfloat16, kernels=True)

        def folded():
            return attention_tiles(qf, K, V, n_keys, nlive=nlive, out_dtype=torch.bfloat16, kernels=True)

    def check():
        f = folded().view(C, B, H * d)
        return sum(int(torch.equal(f[:, b], one(b))) for b in range(B))

    return one, folded, check


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    p = TINY if a.tiny else FULL
    cuda = torch.cuda.is_available() and not a.tiny
    dev = torch.device("cuda" if cuda else "cpu")
    L = 24 if a.tiny else a.context
    gen = torch.Generator().manual_seed(0)
    res = {"B": p["B"], "context": L, "canvas": p["C"], "kinds": {}}
    saving = 0.0
    for kind in ("sliding", "full"):
        one, folded, check = lane_calls(kind, p, L, dev, gen)
        B = p["B"]
        r = {"lanes_bit_equal_folded": check()}
        if cuda:
            from bench.bench_engine import time_graph
            streams = [torch.cuda.Stream() for _ in range(B)]

            def serial():
                for b in range(B):
                    one(b)

            def forked():
                main_s = torch.cuda.current_stream()
                for b, s in enumerate(streams):
                    s.wait_stream(main_s)
                    with torch.cuda.stream(s):
                        one(b)
                for s in streams:
                    main_s.wait_stream(s)

            for name, fn in (("serial", serial), ("streams", forked), ("folded", folded)):
                r[f"{name}_us"] = round(statistics.median(time_graph(fn, 1, a.reps)), 2)
            saving += p["layers"][kind] * (r["streams_us"] - r["folded_us"])
        else:
            folded()
        res["kinds"][kind] = r
        print(kind, json.dumps(r), flush=True)
    if cuda:
        res["forward_saving_ms"] = round(saving / 1e3, 3)
        print("forward saving if every layer ran folded (ms):", res["forward_saving_ms"])
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
