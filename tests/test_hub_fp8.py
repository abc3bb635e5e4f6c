"""`quantize --profile fp8` (the compressed-tensors FP8 checkpoint the hub publishes), `verify` on published
checkpoints, and `ask` on one, on the CPU."""

import argparse
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import diffgemma
from diffgemma.cli import main
from diffgemma.errors import CheckpointError, SettingsError
from diffgemma.loader import embedded_model_path
from diffgemma.quant import codecs
from diffgemma.quant.commands import add_subcommands
from diffgemma.quant.hub_fp8 import fp8_channel, quantize_fp8
from tiny_checkpoints import PACKABLE, build_model, save

HUB = Path(__file__).parent / "data" / "hub"


@pytest.fixture(scope="module")
def bf16(tmp_path_factory):
    pytest.importorskip("transformers")
    return save(build_model(PACKABLE, canvas_length=8).to(torch.bfloat16), tmp_path_factory.mktemp("bf16") / "m")


def _cli(argv):
    parser = argparse.ArgumentParser(prog="diffgemma")
    add_subcommands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_fp8_channel_rounds_each_row_to_e4m3_with_max_over_448():
    w = torch.randn(5, 40) * torch.tensor([1e-3, 0.1, 1.0, 30.0, 0.0])[:, None]
    q, s = fp8_channel(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (5, 1) and s.dtype == torch.bfloat16
    assert s[4, 0] == 1 and (q[4].float() == 0).all()
    exact = w[:4].abs().amax(-1) / 448
    sf = s[:4, 0].float()
    assert (sf >= exact).all() and (sf <= exact * (1 + 2.0 ** -7)).all()  # rounded up to bf16
    y = (w[:4] / sf[:, None]).double().numpy()
    expect = np.sign(y) * codecs.ref_e4m3_round(np.abs(y))  # the float64 twin: nearest e4m3, ties to even
    assert np.array_equal(q[:4].double().numpy(), expect)


def test_quantize_fp8_writes_the_published_layout_and_loads_back(bf16, tmp_path):
    out = tmp_path / "fp8"
    assert _cli(["quantize", str(bf16), "-o", str(out), "--profile", "fp8", "--no-progress"]) == 0
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    pub = json.loads((HUB / "ct_fp8_dynamic" / "config.json").read_text())["quantization_config"]
    for key in ("quant_method", "format"):
        assert qc[key] == pub[key]
    for part in ("weights", "input_activations"):
        for field in ("num_bits", "type", "strategy", "dynamic", "symmetric"):
            assert qc["config_groups"]["group_0"][part][field] == pub["config_groups"]["group_0"][part][field]
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        ours = {k: (f.get_slice(k).get_dtype(), len(f.get_slice(k).get_shape())) for k in f.keys()}
    with safe_open(str(HUB / "ct_fp8_dynamic" / "model.safetensors"), "pt") as f:
        theirs = {k: (f.get_slice(k).get_dtype(), len(f.get_slice(k).get_shape())) for k in f.keys()
                  if k.startswith("model.decoder.")}
    assert {k: d for k, (d, _) in ours.items() if k.startswith("model.decoder.") and "scale" not in k} == \
        {k: d for k, (d, _) in theirs.items() if "scale" not in k}
    assert "model.decoder.layers.0.experts.3.down_proj.weight_scale" in ours

    ref = diffgemma.load(bf16)
    back = diffgemma.load(out)
    # the weights: each row's e4m3 values times max|row| / 448, computed here independently
    for name in ("model.decoder.layers.1.experts.gate_up_proj", "model.decoder.layers.0.self_attn.q_proj.weight"):
        w = diffgemma.checkpoint.SafetensorsSource(bf16).get(name, torch.float64)
        exact = (w.abs().amax(-1, keepdim=True) / 448).float()
        scale = exact.to(torch.bfloat16)
        scale = torch.where(scale.float() < exact, torch.nextafter(scale, scale + 1), scale).double()
        ratio = (w / scale).float().double().numpy()  # the f32 division the spec names
        expect = torch.from_numpy(np.sign(ratio) * codecs.ref_e4m3_round(np.abs(ratio))) * scale  # f64 twin
        got = diffgemma.loader.open_source(out).get(name, torch.float64)
        assert torch.equal(got, expect), name
        assert ((got - w).abs() <= w.abs().amax(-1, keepdim=True) * 2.0 ** -4).all()
    # the logits: random tiny models are chaotic (tests/test_quant_pack.py); the median row cosine over 32 rows
    V, C = ref.config.vocab_size, ref.config.canvas_length
    inputs = [(torch.randint(0, V, (10,)), torch.randint(0, V, (C,))) for _ in range(4)]
    logits = []
    for m in (ref, back):
        rows = []
        for prompt, canvas in inputs:
            cache = m.new_cache(64)
            m.prefill(cache, prompt)
            rows.append(m.denoise(cache, canvas))
        logits.append(torch.cat(rows))
    cos = torch.nn.functional.cosine_similarity(logits[0], logits[1], dim=-1)
    assert cos.median() > 0.95, cos
    assert not torch.equal(logits[0], logits[1])  # it did quantize


def test_quantize_fp8_refusals(bf16, tmp_path):
    with pytest.raises(SettingsError, match="no --set"):
        _cli(["quantize", str(bf16), "-o", str(tmp_path / "a"), "--profile", "fp8", "--set", "attn=q8"])
    with pytest.raises(CheckpointError, match="already quantized"):
        quantize_fp8(HUB / "ct_w4a16", tmp_path / "b", progress=False)
    assert not (tmp_path / "b").exists()


def test_verify_on_published_checkpoints(capsys, tmp_path):
    for name in ("ct_fp8_dynamic", "modelopt_nvfp4", "autoround_int4"):
        assert _cli(["verify", str(HUB / name), "--no-progress"]) == 0
        out = capsys.readouterr().out
        assert "tensors read and dequantized to finite values" in out and "not a Hugging Face cache snapshot" in out
    # an HF cache snapshot: shards are links to blobs named by their sha256, which verify checks
    snap = tmp_path / "models--x--y" / "snapshots" / "rev"
    blobs = tmp_path / "models--x--y" / "blobs"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    import hashlib

    for p in (HUB / "ct_nvfp4").iterdir():
        data = p.read_bytes()
        blob = blobs / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snap / p.name).symlink_to(blob)
    assert _cli(["verify", str(snap), "--no-progress"]) == 0
    assert "1 of 1 shards match the hub's sha256" in capsys.readouterr().out
    shard = (snap / "model.safetensors").resolve()
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x10  # one bit of tensor data: only the hash can tell
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="sha256 differs") as e:
        _cli(["verify", str(snap), "--no-progress"])
    assert "model.safetensors" in str(e.value) and "\n" not in str(e.value)


def _with_tokenizer(name, tmp_path_factory):
    """A published-format tiny checkpoint grown to the demo tokenizer's vocabulary (its embedding is one of the
    tensors the recipes leave unquantized; the quantized tensors are untouched)."""
    demo = embedded_model_path()
    vocab = json.loads((demo / "config.json").read_text())["text_config"]["vocab_size"]
    path = tmp_path_factory.mktemp(name) / "m"
    shutil.copytree(HUB / name, path)
    tensors = load_file(str(path / "model.safetensors"))
    for k in [k for k in tensors if k.endswith("embed_tokens.weight")]:
        tensors[k] = (torch.randn(vocab, tensors[k].shape[1]) * 0.2).to(tensors[k].dtype)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["text_config"]["vocab_size"] = vocab
    (path / "config.json").write_text(json.dumps(cfg))
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copy(demo / f, path)
    return path


@pytest.fixture(scope="module")
def fp8_with_tokenizer(tmp_path_factory):
    return _with_tokenizer("ct_fp8_dynamic", tmp_path_factory)


@pytest.mark.parametrize("name,stored", [("ct_fp8_dynamic", "fp8"), ("ct_nvfp4", "ct-nvfp4")])
def test_ask_answers_on_a_published_checkpoint(name, stored, tmp_path_factory, capsys):
    path = _with_tokenizer(name, tmp_path_factory)
    code = main(["ask", "Hello there", "--model", str(path), "--max-new-tokens", "12",
                 "--set", "max_denoising_steps=3", "--stats", "--device", "cpu"])
    out, err = capsys.readouterr()
    assert code == 0 and out.endswith("\n")
    weights = [ln for ln in err.splitlines() if ln.startswith("[weights: ")]
    assert weights and f"experts={stored}->float32" in weights[0] and f"attn={stored}->float32" in weights[0]
    assert err.strip().splitlines()[-1].startswith("[blocks=")


def test_serve_answers_on_a_published_fp8_checkpoint(fp8_with_tokenizer):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from diffgemma.server.app import create_app
    from diffgemma.server.commands import served_name
    from diffgemma.server.worker import Worker
    from diffgemma.settings import GenerationSettings

    model = diffgemma.load(fp8_with_tokenizer)
    worker = Worker(model, slots=1, max_tokens=512)
    try:
        base = GenerationSettings.resolve(model.generation_config, env={})
        client = TestClient(create_app(worker, model.tokenizer, served_name(model), base))
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                      "max_tokens": 8})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["role"] == "assistant"
    finally:
        worker.close()
