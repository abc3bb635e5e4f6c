"""Expert parallel on the CPU (gloo): G ranks as processes of this machine, against the single-process engine.

The pytest process is rank 0 (its LeadEngine is the model object); the followers are processes it starts, on its
torch thread count (tests/cpu_ranks.py: the CPU's grouped GEMM sums in another order on another count). The ranks'
expert sums are added in another order than one process adds them, so the logits match within f32 rounding. With
top-2 routing a token's two terms add up to the same f32 whatever their order, so the logits are the same and so are
the seeded tokens, which the test asserts there; with top-3 a last-bit difference may, rarely, move a sampled token
on these random models, so only the logits are compared. One rank is the engine bit for bit.
Failure: a follower killed mid-run ends rank 0's next call with ParallelError within seconds, and `diffgemma chat
--gpus 2` with its follower killed exits with one line; a follower whose rank 0 died leaves by itself.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest
import torch

import diffgemma
from diffgemma import cli
from diffgemma.checkpoint import SafetensorsSource
from diffgemma.generation import generate
from diffgemma.model.engine_weights import DictSource
from diffgemma.ops.layouts import planes
from diffgemma.ops.moe import expert_ffn
from diffgemma.ops.packed_weight import PackedWeight
from diffgemma.ops.rmsnorm import unpermute_ref
from diffgemma import launch
from diffgemma.parallel.engine import LeadEngine
from diffgemma.parallel.expert import ExpertParallelForward, ExpertShard
from diffgemma.parallel.group import Group, ParallelError, wait_for
from cpu_ranks import load_rank
from tiny_checkpoints import CONFIGS, build_model, save

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
GEN = dict(max_new_tokens=8, max_denoising_steps=6)  # one block of a few steps: the ranks' calls, not the sampler
# followers forked from a clean server process (a plain fork of this one would inherit gloo's loop of an earlier run
# without its thread), and a fault fails a test within a minute instead of hanging it
RANKS = dict(start_method="forkserver", watch=False, timeout=60, idle_timeout=timedelta(seconds=60))


def start_ranks(G: int, path):
    """G ranks on the CPU holding `path` in float32, every follower on this process's torch thread count (as the
    single engine they are compared with runs)."""
    return launch.start(G, "cpu", load_rank, (torch.get_num_threads(), path, torch.float32), **RANKS)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {name: save(build_model(CONFIGS[name], canvas_length=8), tmp_path_factory.mktemp(name))
            for name in ("gqa2_mixed", "mha_realsplit")}


def calls(model, prompt, canvas, sc):
    """A run's kinds of calls: prefills (one with image embeddings), denoises (no SC, SC logits, SC embeds, batched), a
    rewind, a second cache and a dropped one, a KV dtype change (a setting the followers must mirror)."""
    model.kv_dtype = torch.float32
    dropped = model.new_cache(64)
    model.prefill(dropped, prompt[:3])
    del dropped
    cache = model.new_cache(128)
    model.prefill(cache, prompt)
    out = [model.denoise(cache, canvas), model.denoise(cache, canvas, sc_logits=sc)]
    model.prefill(cache, canvas[:5])
    cache.truncate(len(prompt) + 2)
    out.append(model.denoise(cache, canvas, sc_embeds=model.embed(canvas)))
    other = model.new_cache(64)
    model.prefill(other, canvas)
    out.append(model.denoise(other, prompt[:8]))
    # an image prompt's prefill (its rows' embeddings given, one image's rows attending both ways), a batched denoise
    model.prefill(other, prompt[:5], embeds=model.embed(prompt[:5]) * 0.5, image_groups=torch.tensor([-1, 0, 0, 0, -1]))
    out.extend(model.denoise_batch([cache, other], [canvas, prompt[:8]], sc_logits=[sc, None]))
    return out


def inputs(config, seed=0):
    g = torch.Generator().manual_seed(seed)
    V = config.vocab_size
    return (torch.randint(0, V, (13,), generator=g), torch.randint(0, V, (8,), generator=g),
            torch.randn(8, V, generator=g) * 4)


@pytest.mark.parametrize("name,G", [("gqa2_mixed", 2), ("gqa2_mixed", 4), ("mha_realsplit", 2)])
def test_ranks_give_the_single_engine_logits_and_tokens(checkpoints, name, G):
    path = checkpoints[name]
    single = diffgemma.load(path, engine="fast", dtype=torch.float32)
    ranks = start_ranks(G, path)
    try:
        lead = diffgemma.load(path, dtype=torch.float32, group=ranks.group)
        assert isinstance(lead, LeadEngine) and lead.forward.count == single.config.num_experts // G
        assert lead.w.layers[0].experts_gu.shape[0] == single.config.num_experts // G
        case = inputs(single.config)
        bitwise = True
        for i, (want, got) in enumerate(zip(calls(single, *case), calls(lead, *case))):
            err = (got - want).abs().max().item()
            # f32 rounding of a re-ordered sum (median 0 here); a wrong expert, route or weight is O(0.1-1)
            assert err <= 1e-4 * max(1.0, want.abs().max().item()), f"call {i}: max |Δlogits| = {err:.3g}"
            bitwise &= torch.equal(got, want)
        # a token's two expert terms add up the same in any order, so the ranks' tokens are the single engine's where
        # the expert GEMMs give the same bits on a rank's rows as on all rows; the host BLAS need not (its kernel may
        # depend on the rows it is given), and then a near tie may break the other way: the logits bound above holds
        if single.config.top_k_experts == 2 and bitwise:
            prompt = case[0]
            for seed in (1, 2):
                assert (generate(lead, prompt, seed=seed, **GEN).tokens
                        == generate(single, prompt, seed=seed, **GEN).tokens)
    finally:
        ranks.stop()
    assert [p.exitcode for p in ranks.procs] == [0] * (G - 1)  # each follower left its loop at rank 0's end


def test_ranks_on_a_q4_pack_read_their_records_and_match_the_engine(tmp_path):
    """A q4 pack (experts packed, the SC MLP q8): each rank's expert records come cut out of the pack's blob."""
    from diffgemma.quant.quantize import quantize
    from tiny_checkpoints import PACKABLE

    pack = str(quantize(save(build_model(PACKABLE, canvas_length=8), tmp_path / "ckpt"), tmp_path / "pack",
                        profile="q4", progress=False))
    single = diffgemma.load(pack, engine="fast", dtype=torch.float32)
    ranks = start_ranks(2, pack)
    try:
        lead = diffgemma.load(pack, dtype=torch.float32, group=ranks.group)
        gu = lead.w.layers[1].experts_gu
        assert isinstance(gu, PackedWeight) and gu.shape[0] == 2
        assert torch.equal(gu.dequantize(), single.w.layers[1].experts_gu.dequantize()[:2])
        case = inputs(single.config, seed=4)
        for want, got in zip(calls(single, *case), calls(lead, *case)):
            assert (got - want).abs().max().item() <= 1e-4 * max(1.0, want.abs().max().item())
        assert generate(lead, case[0], seed=1, **GEN).tokens == generate(single, case[0], seed=1, **GEN).tokens
    finally:
        ranks.stop()


def test_one_rank_is_the_engine_bit_for_bit(checkpoints):
    path = checkpoints["gqa2_mixed"]
    engine = diffgemma.load(path, engine="fast")  # bf16, the engine's default
    lead = diffgemma.load(path, group=Group())
    assert isinstance(lead, LeadEngine) and isinstance(lead.forward, ExpertParallelForward)
    case = inputs(engine.config, seed=3)
    for want, got in zip(calls(engine, *case), calls(lead, *case)):
        assert torch.equal(want, got)
    prompt = case[0]
    assert generate(lead, prompt, seed=5, **GEN).tokens == generate(engine, prompt, seed=5, **GEN).tokens


def test_a_killed_follower_ends_rank_0s_next_call(checkpoints):
    path = checkpoints["gqa2_mixed"]
    ranks = launch.start(2, "cpu", launch.load_rank, (path, torch.float32), **RANKS)
    try:
        lead = diffgemma.load(path, dtype=torch.float32, group=ranks.group)
        prompt, canvas, _ = inputs(lead.config)
        cache = lead.new_cache(64)
        lead.prefill(cache, prompt)
        lead.denoise(cache, canvas)
        os.kill(ranks.procs[0].pid, signal.SIGKILL)
        assert wait_for(lambda: not ranks.procs[0].is_alive(), 5)
        t = time.monotonic()
        with pytest.raises(ParallelError, match="rank 0 of 2: .* failed, another rank died"):
            for _ in range(3):  # the first send may still land in the dead peer's socket buffer
                lead.denoise(cache, canvas)
        assert time.monotonic() - t < 5
        with pytest.raises(ParallelError, match="stopped earlier"):  # and the model stays failed
            lead.denoise(cache, canvas)
    finally:
        ranks.stop()


def test_a_collective_that_times_out_ends_rank_0s_call(checkpoints):
    """A follower that stops answering (SIGSTOP: alive, silent) is a timeout of rank 0's next collective."""
    path = checkpoints["gqa2_mixed"]
    ranks = launch.start(2, "cpu", launch.load_rank, (path, torch.float32), **{**RANKS, "timeout": 2})
    follower = ranks.procs[0].pid
    try:
        lead = diffgemma.load(path, dtype=torch.float32, group=ranks.group)
        prompt, canvas, _ = inputs(lead.config)
        cache = lead.new_cache(64)
        lead.prefill(cache, prompt)
        os.kill(follower, signal.SIGSTOP)
        t = time.monotonic()
        with pytest.raises(ParallelError, match="rank 0 of 2: .* failed, another rank died or stopped answering"):
            lead.denoise(cache, canvas)
        assert time.monotonic() - t < 10  # the 2 s timeout, not a hang
    finally:
        os.kill(follower, signal.SIGCONT)
        ranks.stop()


RANK0 = """
import sys, time, torch, diffgemma
from diffgemma import launch
ranks = launch.start(2, "cpu", launch.load_rank, (sys.argv[1], torch.float32), start_method="fork")
model = diffgemma.load(sys.argv[1], dtype=torch.float32, group=ranks.group)
print(ranks.procs[0].pid, flush=True)
time.sleep(120)
"""


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def test_a_follower_leaves_when_rank_0_dies(checkpoints):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    lead = subprocess.Popen([sys.executable, "-c", RANK0, checkpoints["gqa2_mixed"]], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        follower = int(lead.stdout.readline())
        assert not _gone(follower)
        lead.kill()
        lead.wait(10)
        assert wait_for(lambda: _gone(follower), 5), "the follower outlived rank 0"
    finally:
        lead.kill()
        lead.wait(10)


def _spawned_children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            if "spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes().decode(errors="replace"):
                out.append(int(child))
    return out


@pytest.mark.slow
def test_cli_chat_with_a_dead_follower_exits_with_one_line():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    chat = subprocess.Popen([sys.executable, "-m", "diffgemma", "chat", "--gpus", "2", "--device", "cpu",
                             "--max-new-tokens", "4", "--set", "max_denoising_steps=4"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        chat.stdin.write("Hello\n")
        chat.stdin.flush()
        chat.stdout.readline()  # the reply: both ranks served a turn
        followers = _spawned_children(chat.pid)
        assert len(followers) == 1
        os.kill(followers[0], signal.SIGKILL)
        t = time.monotonic()
        chat.wait(10)  # stdin stays open: the chat waits for its next turn, and the watchdog ends it
        assert time.monotonic() - t < 5
        err = chat.stderr.read()
        assert chat.returncode == launch.EXIT_FAILED
        lines = err.strip().splitlines()
        assert len(lines) == 1 and "rank 1 of 2" in lines[0] and "died" in lines[0], err
    finally:
        chat.kill()
        chat.wait(10)


@pytest.mark.parametrize("gpus,needle", [("0", "expected a whole number of GPUs >= 1"),
                                         ("-2", "expected a whole number of GPUs >= 1"),
                                         ("two", "expected a whole number of GPUs >= 1"),
                                         ("3", "4 experts do not split evenly over 3 ranks")])
def test_bad_gpus_is_one_line_and_exit_2(gpus, needle, capsys):
    assert cli.main(["ask", "hi", "--device", "cpu", f"--gpus={gpus}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0] and f"--gpus {gpus}" in err[0]


def test_a_bad_model_with_gpus_fails_before_any_rank_starts(tmp_path, capsys):
    assert cli.main(["ask", "hi", "--device", "cpu", "--gpus", "2", "--model", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no such checkpoint directory" in err[0]


def test_more_gpus_than_visible_is_refused(monkeypatch):
    from diffgemma.errors import InputError
    from diffgemma.parallel.group import check_gpus

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(InputError, match="--gpus 2: this machine has 1 visible GPU"):
        check_gpus(2, "cuda", 128)
    check_gpus(2, "cpu", 128)  # processes on the CPU


# ---------------------------------------------------------------------------------------------- the shard source

def test_shard_hands_out_its_experts_from_a_dict_and_safetensors(checkpoints):
    path = checkpoints["mha_realsplit"]
    st = SafetensorsSource(path)
    name = next(n for n in st.keys() if n.endswith("experts.gate_up_proj"))
    full = st.get(name)
    dense = next(n for n in st.keys() if n.endswith("mlp.down_proj.weight"))
    for source in (st, DictSource({name: full, dense: st.get(dense)})):
        share = ExpertShard(source, 2, 2)
        assert share.shape(name) == (2,) + tuple(full.shape[1:])
        assert torch.equal(share.get(name, dtype=torch.float32), full[2:4].float())
        assert torch.equal(share.get(dense), st.get(dense))  # any other tensor whole


class _RecordSource:
    def __init__(self, fmt, shape, record):
        self.fmt, self.shapes, self.rec = fmt, {"l.experts.down_proj": shape}, record

    def kind(self, name):
        return self.fmt

    def shape(self, name):
        return self.shapes[name]

    def record(self, name):
        return memoryview(self.rec.numpy().tobytes())


@pytest.mark.parametrize("fmt", ["q4", "q6", "nvfp4"])
def test_shard_cuts_every_plane_of_a_packed_record(fmt):
    E, N, K = 4, 8, 64
    shape = (E, N, K)
    last = planes(fmt, shape)[-1]
    record = torch.randint(0, 256, (last.offset + last.nbytes,), dtype=torch.uint8)
    if fmt == "nvfp4":  # a finite tensor scale (read as a float at load)
        record[last.offset:last.offset + 4] = torch.tensor([0.5], dtype=torch.float32).view(torch.uint8)
    full = PackedWeight.from_record(fmt, shape, record)
    share = ExpertShard(_RecordSource(fmt, shape, record), 1, 2)
    record = torch.frombuffer(bytearray(share.record("l.experts.down_proj")), dtype=torch.uint8).clone()
    got = PackedWeight.from_record(fmt, share.shape("l.experts.down_proj"), record)
    for p in planes(fmt, shape):
        want = full.planes[p.name] if p.name == "tscale" else full.planes[p.name][N:3 * N]
        assert torch.equal(got.planes[p.name], want), p.name
    # random bytes: some scales are NaN, which decode to NaN on both sides
    torch.testing.assert_close(got.dequantize(), full.dequantize()[1:3], rtol=0, atol=0, equal_nan=True)


def test_local_sums_of_all_ranks_add_up_to_the_engines_moe(checkpoints):
    """The partial sums alone (no process group): each rank's forward sums its experts' routes; the G sums add up to
    the f32 sum one forward un-permutes."""
    engine = diffgemma.load(checkpoints["mha_realsplit"], engine="fast", dtype=torch.float32)
    cfg, lw = engine.config, engine.w.layers[0]
    T, H, G = 11, cfg.hidden_size, 3
    x = torch.randn(T, H)
    weights, src, inv, offs, order = engine.forward._route(lw, x)
    want = unpermute_ref(expert_ffn(x, lw.experts_gu, lw.experts_down, offs, src=src, order=order), inv, weights)
    stacks = DictSource({"e.experts.gate_up_proj": lw.experts_gu, "e.experts.down_proj": lw.experts_down})
    total = torch.zeros(T, H)
    for r in range(G):
        share = ExpertShard(stacks, r * 2, 2)
        mine = replace(lw, experts_gu=share.get("e.experts.gate_up_proj"),
                       experts_down=share.get("e.experts.down_proj"))
        f = ExpertParallelForward(cfg, engine.w, group=Group(r, G), device="cpu", dtype=torch.float32)
        part = f.local_expert_sum(mine, x, weights, src, inv, offs, order, x.dtype)
        assert part.abs().sum() > 0  # every rank has routes here (11 tokens x top-3 over 6 experts)
        total += part
    assert (total - want).abs().max().item() <= 1e-5 * max(1.0, want.abs().max().item())
