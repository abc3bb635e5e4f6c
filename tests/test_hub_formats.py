"""Published quantized checkpoints (docs/FORMATS.md) on the CPU: tiny ones made by the formats' own libraries
(tools/make_hub_checkpoints.py, committed under tests/data/hub/).

For each: our dequantization equals the library's own (its decompressor's output, stored beside the checkpoint);
the reference path's logits equal transformers' forward on the same dequantized weights within f32 rounding; the
fast engine's torch path, on the 4-bit records it converts the experts to, matches the reference on the weights
those records hold, and the conversion moves the weights no further than docs/FORMATS.md says.
"""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import diffgemma
from diffgemma.checkpoint import expected_tensors
from diffgemma.model.engine import build_engine
from diffgemma.model.engine_weights import DictSource
from diffgemma.ops.packed_weight import PackedWeight
from diffgemma.quant import codecs
from diffgemma.ops.fp8_weight import Fp8Weight
from diffgemma.quant.hub_source import HubSource, fp8_weight
from fp8_reference import EngineQuantInputs, FakeQuantReference

pytest.importorskip("transformers")
from transformers.cache_utils import DynamicCache  # noqa: E402

HUB = Path(__file__).parent / "data" / "hub"
NAMES = sorted(p.name for p in HUB.iterdir() if (p / "config.json").is_file()) if HUB.is_dir() else []
TOL_F32 = 1e-3  # tests/test_reference_parity.py's bound for the same math re-associated


def _load_quiet(path, **kw):
    return diffgemma.load(path, **kw)


@pytest.fixture(scope="module", params=NAMES)
def hub(request):
    path = HUB / request.param
    model = _load_quiet(path)
    return request.param, path, model


def _dequantized(model) -> dict:
    return model.source_weights if hasattr(model, "source_weights") else None


def _state_dict(path) -> dict:
    """Every tensor the text forward reads, dequantized by our HubSource, in float32."""
    src = diffgemma.loader.open_source(path)
    assert isinstance(src, HubSource)
    cfg = diffgemma.config.ModelConfig.from_file(path / "config.json")
    return {n: src.get(n, dtype=torch.float32) for n in expected_tensors(cfg)}


def _transformers_model(path, weights):
    """transformers' DiffusionGemma with the config minus its quantization block, holding `weights`."""
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("quantization_config", None)
    hf = DiffusionGemmaForBlockDiffusion(DiffusionGemmaConfig.from_dict(cfg)).eval().float()
    missing, unexpected = hf.load_state_dict(weights, strict=False)
    assert not unexpected
    assert all("vision" in m or "lm_head" in m or "encoder.language_model" in m and "layer_scalar" not in m
               for m in missing), missing
    return hf


def test_every_format_is_present():
    assert {"ct_fp8_dynamic", "ct_nvfp4", "ct_nvfp4a16", "ct_w4a16", "ct_w4a16_asym"} <= set(NAMES)


def test_dequantization_equals_the_librarys(hub):
    name, path, _ = hub
    src = diffgemma.loader.open_source(path)
    probes = load_file(str(path / "library_dequant.safetensors"))
    assert probes
    for key, lib in probes.items():
        mod = key[:-len(".weight")]
        ours = src._dequant(mod)  # the per-module decode the stacked names are built from
        assert ours.shape == lib.shape and ours.dtype == torch.float32
        # fp8 / int4 products are exact in f32; nvfp4 in the library's own f32 arithmetic (hub_codecs): all equal
        assert torch.equal(ours, lib), f"{name} {key}: {(ours != lib).sum()} values differ"


@pytest.mark.parametrize("name", [n for n in NAMES if "nvfp4" in n])
def test_engine_nvfp4_records_decode_to_the_librarys_values(name):
    """The fast engine's NVFP4 expert stacks (nvfp4e records converted at load) hold the library's dequantized
    values bit for bit: the torch twin, the codecs' decode and the library's output agree exactly."""
    path = HUB / name
    src = diffgemma.loader.open_source(path)
    probes = load_file(str(path / "library_dequant.safetensors"))
    for key, lib in probes.items():
        m = re.fullmatch(r"(model\.decoder\.layers\.(\d+)\.experts)\.(\d+)\.(gate|up|down)_proj\.weight", key)
        stack = m and f"{m[1]}.{'down_proj' if m[4] == 'down' else 'gate_up_proj'}"
        if not m:
            continue
        assert src.kind(stack) == "nvfp4e"
        rec = src.record(stack)
        pw = PackedWeight.from_record("nvfp4e", src.shape(stack), torch.frombuffer(bytearray(rec), dtype=torch.uint8).clone())
        w = pw.dequantize()
        assert torch.equal(w, codecs.decode(pw.fmt, rec, pw.shape))
        F = w.shape[1] // 2
        part = {"gate": w[int(m[3]), :F], "up": w[int(m[3]), F:], "down": w[int(m[3])]}[m[4]]
        assert torch.equal(part, lib), f"{name} {key}: {(part != lib).sum()} values differ"


def test_experts_stack_gate_before_up(hub):
    _, path, _ = hub
    src = diffgemma.loader.open_source(path)
    gu = src.get("model.decoder.layers.1.experts.gate_up_proj")
    F = gu.shape[1] // 2
    for e in range(gu.shape[0]):
        torch.testing.assert_close(gu[e, :F], src._dequant(f"model.decoder.layers.1.experts.{e}.gate_proj"), rtol=0, atol=0)
        torch.testing.assert_close(gu[e, F:], src._dequant(f"model.decoder.layers.1.experts.{e}.up_proj"), rtol=0, atol=0)


def _two_blocks_ours(model, prompt, canvas1, sc1, block1, canvas2):
    cache = model.new_cache(128)
    model.prefill(cache, prompt)
    a = model.denoise(cache, canvas1)
    b = model.denoise(cache, canvas1, sc_logits=sc1)
    model.prefill(cache, block1)
    return a, b, model.denoise(cache, canvas2)


def _two_blocks_hf(hf, prompt, canvas1, sc1, block1, canvas2):
    cache = DynamicCache(config=hf.config.text_config)
    with torch.no_grad():
        a = hf(input_ids=prompt[None], cache=cache, decoder_input_ids=canvas1[None]).logits[0]
        b = hf(cache=cache, decoder_input_ids=canvas1[None], self_conditioning_logits=sc1[None]).logits[0]
        c = hf(input_ids=block1[None], cache=cache, decoder_input_ids=canvas2[None]).logits[0]
    return a, b, c


def _case(cfg):
    V, C = cfg.vocab_size, cfg.canvas_length
    return (torch.randint(0, V, (2 * cfg.sliding_window,)), torch.randint(0, V, (C,)), torch.randn(C, V) * 4,
            torch.randint(0, V, (C,)), torch.randint(0, V, (C,)))


def test_reference_matches_transformers_on_the_dequantized_weights(hub):
    _, path, model = hub
    hf = _transformers_model(path, _state_dict(path))
    case = _case(model.config)
    for what, e, g in zip(("prefill+denoise", "SC", "block 2"), _two_blocks_hf(hf, *case), _two_blocks_ours(model, *case)):
        err = (g - e).abs().max().item()
        assert err <= TOL_F32, f"{what}: max |Δlogits| = {err:.3g}"
        assert g.std() > 1e-3


def _record_weights(src: HubSource, cfg) -> dict:
    """The weights the fast engine holds: experts decoded from the converted records, the rest as get() gives."""
    out = {}
    for n in expected_tensors(cfg):
        kind = src.kind(n)
        packed = kind not in ("raw", "fp8")  # fp8: the FP8 engine's (tests/gpu); here get() as the engine on main
        out[n] = codecs.decode(kind, src.record(n), src.shape(n)) if packed else src.get(n, torch.float32)
    return out


def test_fast_engine_on_converted_records_matches_reference(hub):
    name, path, model = hub
    cfg = model.config
    src = diffgemma.loader.open_source(path)
    eng = build_engine(cfg, src, "cpu", torch.float32, kv_dtype=torch.float32)
    expect_kind = {"nvfp4": "nvfp4e", "w4a16": "q4", "int4": "q4"}
    kind = next((k for tag, k in expect_kind.items() if tag in name), None)
    gu = eng.w.layers[0].experts_gu
    held = _record_weights(diffgemma.loader.open_source(path), cfg)
    case = _case(cfg)
    if "fp8" in name:  # the FP8 engine: FP8 weights, each GEMM's input quantized per token (tests/fp8_reference.py)
        assert isinstance(gu, Fp8Weight)
        # the reference quantizes, by its own rule, the very rows the engine quantized (each equal to its own within
        # f32 re-association): a value on an e4m3 rounding boundary then rounds the same way on both sides
        rows = EngineQuantInputs()
        with rows.recording():
            got = _two_blocks_ours(eng, *case)
        assert rows
        fresh = diffgemma.loader.open_source(path)
        ref = FakeQuantReference(cfg, list(held), fresh, quantized=lambda n: fresh.kind(n) == "fp8", engine_rows=rows)
    else:
        assert getattr(gu, "fmt", None) == kind
        ref = diffgemma.model.reference.ReferenceModel(cfg, held, device="cpu", dtype=torch.float32)
        got = _two_blocks_ours(eng, *case)
    for e, g in zip(_two_blocks_ours(ref, *case), got):
        assert (g - e).abs().max().item() <= TOL_F32
    if "fp8" in name:  # and every row the engine quantized is one the reference quantized
        assert rows.unmet() == 0, f"{rows.unmet()} rows the engine quantized differ from the reference's"
    exact = _state_dict(path)
    for n, w in held.items():  # what the conversion changed: docs/FORMATS.md's bounds
        d = (w - exact[n]).abs().max().item()
        if "nvfp4" in name:  # per-expert tensor scales: the very values
            assert torch.equal(w, exact[n]), n
        else:  # int4: scale and min = -zero * scale in float16
            assert d <= 2.0 ** -10 * exact[n].abs().max().item() + 1e-30, n


def test_fp8_weights_for_the_fp8_engine():
    path = HUB / "ct_fp8_dynamic"
    src = diffgemma.loader.open_source(path)
    gu = fp8_weight(src, "model.decoder.layers.0.experts.gate_up_proj")
    q = fp8_weight(src, "model.decoder.layers.1.self_attn.q_proj.weight")
    assert gu.weight.dtype == torch.float8_e4m3fn and gu.scale.shape == gu.shape[:-1] and len(gu.shape) == 3
    torch.testing.assert_close(gu.dequantize(), src.get("model.decoder.layers.0.experts.gate_up_proj"), rtol=0, atol=0)
    torch.testing.assert_close(q.dequantize(), src.get("model.decoder.layers.1.self_attn.q_proj.weight"), rtol=0, atol=0)
    assert fp8_weight(src, "model.decoder.embed_tokens.weight") is None  # left unquantized by the recipe
    assert fp8_weight(DictSource({}), "x") is None  # any other source: no FP8 form
    assert src.kind("model.decoder.layers.0.experts.gate_up_proj") == "fp8"
    assert src.kind("model.decoder.layers.1.self_attn.q_proj.weight") == "fp8"
    assert src.kind("model.decoder.embed_tokens.weight") == "raw"


def test_stderr_names_the_format(capsys):
    _load_quiet(HUB / "ct_w4a16")
    err = capsys.readouterr().err
    assert "int4 (group 32, symmetric)" in err and "experts=ct-int4" in err


@pytest.mark.parametrize("name", ["ct_nvfp4", "modelopt_nvfp4"])
def test_nvfp4_converts_without_rounding_anything(name, capsys):
    """Experts with different tensor scales (the checkpoints' own) convert with no note of rounded scales."""
    src = diffgemma.loader.open_source(HUB / name)
    stack = "model.decoder.layers.0.experts.gate_up_proj"
    src.record(stack)
    src.record("model.decoder.layers.0.experts.down_proj")
    pw = PackedWeight.from_record("nvfp4e", src.shape(stack),
                                  torch.frombuffer(bytearray(src.record(stack)), dtype=torch.uint8).clone())
    assert len(set(pw.escale.flatten().tolist())) > 2  # the experts' scales differ: the case that needed re-rounding
    assert "rounded" not in capsys.readouterr().err and not any("rounded" in n for n in src.notes)


def _copy(name, tmp_path) -> Path:
    dst = tmp_path / name
    shutil.copytree(HUB / name, dst)
    return dst


def _one_line(e) -> str:
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_truncated_shard_is_one_line_naming_the_file(tmp_path):
    path = _copy("ct_nvfp4", tmp_path)
    shard = path / "model.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[:len(data) - 100])
    with pytest.raises(diffgemma.errors.CheckpointError) as e:
        _load_quiet(path)
    assert str(shard) in _one_line(e) and "truncated" in str(e.value)


def test_corrupted_shard_header_is_one_line_naming_the_file(tmp_path):
    path = _copy("autoround_int4", tmp_path)
    shard = path / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[8:40] = b"\x00" * 32  # the JSON header
    shard.write_bytes(bytes(data))
    with pytest.raises(diffgemma.errors.CheckpointError) as e:
        _load_quiet(path)
    assert str(shard) in _one_line(e)


def _with_config(tmp_path, name, edit, file="config.json"):
    path = _copy(name, tmp_path)
    cfg = json.loads((path / file).read_text())
    edit(cfg)
    (path / file).write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize("name,edit,named", [
    ("ct_fp8_dynamic", lambda c: c["quantization_config"].update(quant_method="bitsandbytes"), "bitsandbytes"),
    ("ct_w4a16", lambda c: c["quantization_config"]["config_groups"]["group_0"]["weights"].update(num_bits=8),
     "int 8-bit"),
    ("ct_fp8_dynamic", lambda c: c["quantization_config"]["config_groups"]["group_0"]["input_activations"].update(
        dynamic=False, strategy="tensor"), "static"),
    ("ct_fp8_dynamic", lambda c: c["quantization_config"]["config_groups"]["group_0"]["weights"].update(
        strategy="block"), "block"),
    ("autoround_int4", lambda c: c["quantization_config"].update(bits=2), "2-bit"),
    ("modelopt_nvfp4", lambda c: c["quantization_config"].update(quant_algo="FP8"), "FP8"),
])
def test_unsupported_scheme_is_refused_naming_it(tmp_path, name, edit, named):
    path = _with_config(tmp_path, name, edit)
    with pytest.raises(diffgemma.errors.CheckpointError) as e:
        _load_quiet(path)
    msg = _one_line(e)
    assert named in msg and "unsupported quantization" in msg and "diffgemma loads" in msg
    assert "ModelOpt NVFP4" in msg  # the list of what is supported


def test_gguf_is_refused_naming_it(tmp_path):
    f = tmp_path / "model-Q4_K_M.gguf"
    f.write_bytes(b"GGUF" + b"\x00" * 60)
    for target in (f, tmp_path):
        with pytest.raises(diffgemma.errors.CheckpointError) as e:
            _load_quiet(target)
        assert "GGUF" in _one_line(e) and "model-Q4_K_M.gguf" in str(e.value)


@pytest.mark.parametrize("scale_form", ["rows", "pair"])
def test_fused_fp8_experts_load_like_the_split_ones(tmp_path, scale_form):
    """The fused-expert FP8 form (experts.gate_up_proj in e4m3 + experts.gate_up_proj_scale), made here from the
    split checkpoint, gives the same weights; the scale as [E, 2F, 1] rows or llmcompressor's [E, F, 2] pair."""
    from safetensors.torch import save_file

    path = _copy("ct_fp8_dynamic", tmp_path)
    t = load_file(str(path / "model.safetensors"))
    for layer in range(2):
        p = f"model.decoder.layers.{layer}.experts"
        E = 1 + max(int(k.split(".")[5]) for k in t if k.startswith(p + "."))
        pop = lambda e, proj, s="": t.pop(f"{p}.{e}.{proj}.weight{s}")  # noqa: E731
        gate = [(pop(e, "gate_proj"), pop(e, "gate_proj", "_scale")) for e in range(E)]
        up = [(pop(e, "up_proj"), pop(e, "up_proj", "_scale")) for e in range(E)]
        down = [(pop(e, "down_proj"), pop(e, "down_proj", "_scale")) for e in range(E)]
        t[p + ".gate_up_proj"] = torch.stack([torch.cat([g[0], u[0]]) for g, u in zip(gate, up)])
        if scale_form == "rows":
            t[p + ".gate_up_proj_scale"] = torch.stack([torch.cat([g[1], u[1]]) for g, u in zip(gate, up)])
        else:
            t[p + ".gate_up_proj_scale"] = torch.stack([torch.cat([g[1], u[1]], -1) for g, u in zip(gate, up)])
        t[p + ".down_proj"] = torch.stack([d[0] for d in down])
        t[p + ".down_proj_scale"] = torch.stack([d[1] for d in down])
    save_file(t, str(path / "model.safetensors"), metadata={"format": "pt"})
    fused, split = diffgemma.loader.open_source(path), diffgemma.loader.open_source(HUB / "ct_fp8_dynamic")
    for name in ("model.decoder.layers.1.experts.gate_up_proj", "model.decoder.layers.0.experts.down_proj"):
        assert torch.equal(fused.get(name), split.get(name))
        assert torch.equal(fp8_weight(fused, name).scale, fp8_weight(split, name).scale)


def pack_words(vals):
    """Independent twin of the int32 nibble packing: a list of 8 values 0..15 -> one signed int32 word."""
    w = sum(int(v) << (4 * i) for i, v in enumerate(vals))
    return w - (1 << 32) if w >= 1 << 31 else w


@pytest.mark.parametrize("k,group", [(96, 64), (64, 32), (704 // 8, 16)])
def test_gptq_and_ct_int4_decode_with_a_partial_last_group(k, group):
    """Both int4 layouts against a per-element loop, K not a multiple of the group (the real down_proj: K = 704 in
    groups of 128), asymmetric zeros, then the q4 record holding the same values."""
    from diffgemma.quant import hub_codecs as hc

    n, G = 16, -(-k // group)
    q = torch.randint(0, 16, (n, k))
    z = torch.randint(0, 16, (n, G))
    s = (torch.rand(n, G) + 0.5).half()
    expect = torch.tensor([[(q[r, c] - z[r, c // group]).item() * s[r, c // group].float().item() for c in range(k)]
                           for r in range(n)])
    # GPTQ: qweight [K/8, N] packs along K, qzeros [G, N/8] along N, stored zero - 1 (offset 1)
    qweight = torch.tensor([[pack_words(q[r, 8 * j:8 * j + 8]) for r in range(n)] for j in range(k // 8)],
                           dtype=torch.int32)
    qzeros = torch.tensor([[pack_words(z[8 * j:8 * j + 8, g] - 1 & 0xF) for j in range(n // 8)] for g in range(G)],
                          dtype=torch.int32)
    has_zero_one = (z == 0).any()  # stored zero - 1 wraps for a zero of 0: the original GPTQ format cannot hold it
    codes, scale, zero = hc.gptq_int4_codes(qweight, qzeros, s.t().contiguous(), group, zero_offset=1)
    got = hc.dequant_int4(codes, scale, zero, group)
    if not has_zero_one:
        assert torch.equal(got, expect)
    # compressed-tensors: weight_packed [N, K/8] along K and weight_zero_point [N/8, G] along N hold the nibbles of
    # q_signed + 8 and zp_signed + 8: their difference is the same q - z
    packed = torch.tensor([[pack_words(q[r, 8 * j:8 * j + 8]) for j in range(k // 8)] for r in range(n)],
                          dtype=torch.int32)
    zp = torch.tensor([[pack_words(z[8 * j:8 * j + 8, g]) for g in range(G)] for j in range(n // 8)],
                      dtype=torch.int32)
    codes, scale, zero = hc.ct_int4_codes(packed, s.float(), zp, (n, k), group)
    assert torch.equal(hc.dequant_int4(codes, scale, zero, group), expect)
    if group % 32 == 0 and k % 32 == 0:
        note = hc.Inexact()
        rec = hc.q4_record([(codes, scale, zero)], (n, k), group, note)
        dec = codecs.decode("q4", rec.numpy(), (n, k))
        # scale exact (float16 given), min = -z * s rounded once to float16 (note.worst), f32 arithmetic
        assert (dec - expect).abs().max() <= note.worst + 2.0 ** -20 * expect.abs().max()


def test_reference_equals_the_librarys_own_forward_on_the_fp8_checkpoint():
    """llmcompressor's own quantized model (its QDQ linears, on the checkpoint's weights, float32), run by the
    builder: with activation quantization off it is the dequantized-weight model, which our reference path is
    (f32 rounding, tests/test_reference_parity.py's bound). With FP8 activations per token (`logits_fakequant`, what
    the FP8 engine's GPU test compares with) the logits move far more than that."""
    ref = load_file(str(HUB / "ct_fp8_dynamic" / "library_fakequant.safetensors"))
    model = _load_quiet(HUB / "ct_fp8_dynamic")
    cache = model.new_cache(64)
    model.prefill(cache, ref["prompt"])
    ours = model.denoise(cache, ref["canvas"])
    assert (ours - ref["logits_weights_only"]).abs().max().item() <= TOL_F32
    assert (ours - ref["logits_fakequant"]).abs().max().item() > 10 * TOL_F32


@pytest.mark.parametrize("name", ["ct_fp8_dynamic", "ct_nvfp4", "autoround_int4"])
def test_expert_parallel_share_of_a_hub_checkpoint(name):
    """An expert-parallel rank's share (parallel/expert.ExpertShard) of a split-expert checkpoint: the experts it
    owns, as dequantized tensors and as the engine's records."""
    from diffgemma.parallel.expert import ExpertShard

    src = diffgemma.loader.open_source(HUB / name)
    share = ExpertShard(diffgemma.loader.open_source(HUB / name), 2, 2)
    for n in ("model.decoder.layers.0.experts.gate_up_proj", "model.decoder.layers.1.experts.down_proj"):
        assert torch.equal(share.get(n), src.get(n)[2:4])
        if src.kind(n) not in ("raw", "fp8"):
            dec = codecs.decode(src.kind(n), share.record(n), share.shape(n))
            assert torch.equal(dec, codecs.decode(src.kind(n), src.record(n), src.shape(n))[2:4])


def test_weight_formats_say_what_the_loaded_model_holds():
    fast = diffgemma.load(HUB / "ct_nvfp4", engine="fast", dtype=torch.float32)
    assert "experts=ct-nvfp4->nvfp4e" in fast.weight_formats and "attn=ct-nvfp4->float32" in fast.weight_formats
    assert "sc=bfloat16->float32" in fast.weight_formats
    int4 = diffgemma.load(HUB / "autoround_int4", engine="fast", dtype=torch.float32)
    assert "experts=gptq->q4" in int4.weight_formats
    ref = diffgemma.load(HUB / "modelopt_nvfp4")
    assert "experts=mo-nvfp4->float32" in ref.weight_formats and "attn=bfloat16->float32" in ref.weight_formats


def test_modelopt_checkpoint_described_by_hf_quant_config_alone(tmp_path):
    """ModelOpt's exports carry hf_quant_config.json; a config.json without quantization_config still loads."""
    path = _with_config(tmp_path, "modelopt_nvfp4", lambda c: c.pop("quantization_config"))
    src = diffgemma.loader.open_source(path)
    assert src.scheme.format == "modelopt-nvfp4"
    assert torch.equal(src.get("model.decoder.layers.0.experts.down_proj"),
                       diffgemma.loader.open_source(HUB / "modelopt_nvfp4").get("model.decoder.layers.0.experts.down_proj"))
    (path / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "W4A8_AWQ"}}))
    with pytest.raises(diffgemma.errors.CheckpointError, match="ModelOpt quant_algo 'W4A8_AWQ'"):
        _load_quiet(path)
