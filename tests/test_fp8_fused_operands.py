"""The FP8 engine takes its qkv, dense and expert GEMM inputs quantized per token by the norms that make them
(ops/rmsnorm.py's FP8 epilogues, model/forward.py): the same logits, bit for bit, as quantizing each input in its own
step; and the fused forms are the ones used. CPU torch path (the GPU twin: tests/gpu/test_fp8_fused_gpu.py)."""

import pytest
import torch

import diffgemma
import diffgemma.model.forward as forward_module
from diffgemma.model.engine import build_engine
from diffgemma.model.engine_weights import DictSource, Fp8QuantizedSource
from diffgemma.ops.fp8_quant import Fp8Rows
from tiny_checkpoints import CONFIGS, build_model, save

pytest.importorskip("transformers")


def unfused(monkeypatch):
    """forward.py's norms without their FP8 epilogues: every FP8 GEMM quantizes its input itself."""
    finish, finish_moe = forward_module.attn_finish, forward_module.layer_finish_moe
    monkeypatch.setattr(forward_module, "attn_finish", lambda *a, dense_fp8=False, moe_fp8=False, **k: finish(*a, **k))
    monkeypatch.setattr(forward_module, "layer_finish_moe", lambda *a, next_fp8=False, **k: finish_moe(*a, **k))


def fp8_engine(tmp_path, device="cpu", dtype=torch.float32):
    hf = build_model(CONFIGS[sorted(CONFIGS)[0]], canvas_length=8)
    ref = diffgemma.load(save(hf, tmp_path / "m"))
    return build_engine(ref.config, Fp8QuantizedSource(DictSource(ref.w)), device, dtype, kv_dtype=dtype)


def run(eng, gen_seed=5):
    cfg, dev = eng.config, eng.device
    gen = torch.Generator().manual_seed(gen_seed)
    prompt = torch.randint(0, cfg.vocab_size, (2 * cfg.sliding_window + 3,), generator=gen).to(dev)
    canvas = torch.randint(0, cfg.vocab_size, (cfg.canvas_length,), generator=gen).to(dev)
    sc = (torch.randn(cfg.canvas_length, cfg.vocab_size, generator=gen) * 4).to(dev)
    cache = eng.new_cache(128)
    eng.prefill(cache, prompt)
    return eng.denoise(cache, canvas), eng.denoise(cache, canvas, sc_logits=sc)


def test_fused_fp8_operands_equal_quantizing_each_input(tmp_path, monkeypatch):
    eng = fp8_engine(tmp_path)
    seen, nexts = [], []
    finish, finish_moe = forward_module.attn_finish, forward_module.layer_finish_moe

    def spy(*a, **k):
        out = finish(*a, **k)
        seen.append((isinstance(out[1], Fp8Rows), isinstance(out[2], Fp8Rows)))
        return out

    def spy_moe(*a, **k):
        out = finish_moe(*a, **k)
        nexts.append(isinstance(out[1], Fp8Rows))
        return out

    with monkeypatch.context() as m:
        m.setattr(forward_module, "attn_finish", spy)
        m.setattr(forward_module, "layer_finish_moe", spy_moe)
        fused = run(eng)
    assert seen and all(s == (True, True) for s in seen)
    # every layer's finish hands on FP8 but each denoise's last (the final norm: lm_head's input); prefill's last
    # layer has no finish
    assert nexts.count(False) == 2 and nexts[-1] is False and len(nexts) > 2
    with monkeypatch.context() as m:
        unfused(m)
        plain = run(eng)
    for f, p in zip(fused, plain):
        assert torch.equal(f, p)
