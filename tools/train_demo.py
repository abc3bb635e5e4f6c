"""Train the embedded demo DiffusionGemma with the DiffusionGemma objective. Plain torch, batched.

Three steps (the middle one runs on the GPU machine and needs nothing but torch):

  python tools/train_demo.py prepare --out build/demo          # tokenizer + tokenized train/held-out data (CPU)
  python tools/train_demo.py train --data build/demo --out OUT --seconds 420   # train + eval, writes the state dict
  python tools/train_demo.py export --ckpt OUT --out src/diffgemma/assets/demo # HF checkpoint via transformers (CPU)

The training forward is ONE pass over [prefix | canvas] per example: prefix rows are the encoder (causal,
sliding layers see [q-(W-1), q], encoder layer_scalar), canvas rows the decoder (bidirectional inside the
canvas; sliding layers see the last W-1 prefix positions, full layers all of the prefix; decoder
layer_scalar; self-conditioning injected before layer 0). Prefix rows never attend to canvas rows, so this
equals transformers' prefill-then-denoise (tests/test_train_forward.py pins it at 1e-4).

Objective: uniform-noise renoising diffusion of one answer block. Per example a noise level t ~ U(0,1)
replaces each canvas token by a uniform random id with probability t; the loss is cross-entropy on the clean
block (answer tokens, then the stop token, then pad, exactly what generation must produce). Multi-block
answers train on (prefix = prompt + the first k*C answer tokens, canvas = block k). Self-conditioning is
trained two-pass: a no-grad first pass produces logits whose tempered softmax is fed as SC to the graded
pass for half of the examples; the other half get a zero SC signal (transformers' step 1) or the engine's
first-step seed (the embedding of the noisy canvas itself).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
SLIDING, FULL = "sliding_attention", "full_attention"

# The shipped demo architecture, in transformers' DiffusionGemmaTextConfig schema. Full layers have a bigger
# head_dim and fewer KV heads than sliding ones (like the real 512/2 vs 256/8), the last layer is full.
DEMO_TEXT_CONFIG = {
    "vocab_size": 2048, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 6,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
    "global_head_dim": 128, "num_global_key_value_heads": 1,
    "sliding_window": 128,
    "layer_types": [SLIDING, SLIDING, FULL, SLIDING, SLIDING, FULL],
    "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 128,
    "final_logit_softcapping": 30.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 4096,
    "hidden_activation": "gelu_pytorch_tanh",
    "pad_token_id": 0, "bos_token_id": 2, "eos_token_id": [1, 106, 50],
}
DEMO_CANVAS = 64
STOP_IDS = (1, 106, 50)
PAD_ID = 0


# ----------------------------------------------------------------------------------------------
# architecture


@dataclass
class Arch:
    vocab: int
    hidden: int
    inter: int
    n_layers: int
    n_heads: int
    layer_types: list
    head_dims: list
    kv_heads: list
    window: int
    n_experts: int
    top_k: int
    moe_inter: int
    softcap: float
    eps: float
    rope: dict  # layer_type -> dict(rope_type, rope_theta, partial_rotary_factor)

    @staticmethod
    def from_dict(tc: dict) -> "Arch":
        n = tc["num_hidden_layers"]
        types = list(tc.get("layer_types") or [SLIDING if (i + 1) % 6 else FULL for i in range(n)])
        types[-1] = FULL
        head_dims = [tc["head_dim"]] * n
        kv = [tc["num_key_value_heads"]] * n
        per_layer = tc.get("per_layer_config")
        if per_layer is not None:
            for k, v in per_layer.items():
                i = int(k)
                head_dims[i] = v.get("head_dim", head_dims[i])
                kv[i] = v.get("num_key_value_heads", kv[i])
        else:
            for i, t in enumerate(types):
                if t == FULL:
                    head_dims[i] = tc.get("global_head_dim", 512)
                    if tc.get("num_global_key_value_heads") is not None:
                        kv[i] = tc["num_global_key_value_heads"]
        rope = tc.get("rope_parameters") or {
            SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
            FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
        }
        return Arch(tc["vocab_size"], tc["hidden_size"], tc["intermediate_size"], n, tc["num_attention_heads"],
                    types, head_dims, kv, tc["sliding_window"], tc["num_experts"], tc["top_k_experts"],
                    tc["moe_intermediate_size"], float(tc.get("final_logit_softcapping", 30.0)),
                    float(tc.get("rms_norm_eps", 1e-6)), rope)


def inv_freq(rope: dict, head_dim: int) -> torch.Tensor:
    """Inverse RoPE frequencies, length head_dim/2 (split-half rotation over the full head)."""
    theta = rope["rope_theta"]
    if rope["rope_type"] == "default":
        dim = int(head_dim * rope.get("partial_rotary_factor", 1.0))
        f = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        return torch.cat([f, torch.zeros(head_dim // 2 - f.numel())])
    if rope["rope_type"] == "proportional":
        # the exponent's denominator is the FULL head_dim; the unrotated tail gets frequency 0
        angles = int(rope.get("partial_rotary_factor", 1.0) * head_dim // 2)
        f = 1.0 / (theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.float) / head_dim))
        return torch.cat([f, torch.zeros(head_dim // 2 - angles)])
    raise ValueError(f"rope_type {rope['rope_type']!r} not supported")


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    y = x.float() * torch.pow(x.float().pow(2).mean(-1, keepdim=True) + eps, -0.5)
    if weight is not None:
        y = y * weight.float()
    return y.type_as(x)


def rope_apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [B, L, heads, D]; cos/sin [B, L, D]
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, :, None] + rot * sin[:, :, None]


def gelu(x):
    return F.gelu(x, approximate="tanh")


# ----------------------------------------------------------------------------------------------
# the model: parameter names and shapes exactly as transformers' checkpoint


class Norm(nn.Module):
    def __init__(self, dim: int, init: float = 1.0):
        super().__init__()
        self.weight = nn.Parameter(torch.full((dim,), float(init)))


def _linear(i: int, o: int) -> nn.Linear:
    return nn.Linear(i, o, bias=False)


class Attention(nn.Module):
    def __init__(self, a: Arch, i: int):
        super().__init__()
        hd, kv = a.head_dims[i], a.kv_heads[i]
        self.q_proj = _linear(a.hidden, a.n_heads * hd)
        self.k_proj = _linear(a.hidden, kv * hd)
        if a.layer_types[i] == SLIDING:  # full layers have no v_proj: V = raw k_proj output
            self.v_proj = _linear(a.hidden, kv * hd)
        self.o_proj = _linear(a.n_heads * hd, a.hidden)
        # q/k norm weights start at hd^-1/4 so q.k starts at the usual 1/sqrt(d) scale (attention has no scale)
        self.q_norm = Norm(hd, hd ** -0.25)
        self.k_norm = Norm(hd, hd ** -0.25)


class Router(nn.Module):
    def __init__(self, a: Arch):
        super().__init__()
        self.proj = _linear(a.hidden, a.n_experts)
        self.scale = nn.Parameter(torch.ones(a.hidden))
        self.per_expert_scale = nn.Parameter(torch.ones(a.n_experts))


class Experts(nn.Module):
    def __init__(self, a: Arch):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(a.n_experts, 2 * a.moe_inter, a.hidden) * 0.02)
        self.down_proj = nn.Parameter(torch.randn(a.n_experts, a.hidden, a.moe_inter) * 0.02)


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = _linear(hidden, inter)
        self.up_proj = _linear(hidden, inter)
        self.down_proj = _linear(inter, hidden)

    def forward(self, x):
        return self.down_proj(gelu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm",
             "post_feedforward_layernorm_1", "post_feedforward_layernorm_2", "pre_feedforward_layernorm_2")

    def __init__(self, a: Arch, i: int):
        super().__init__()
        self.self_attn = Attention(a, i)
        self.mlp = MLP(a.hidden, a.inter)
        for n in self.NORMS:
            setattr(self, n, Norm(a.hidden))
        self.router = Router(a)
        self.experts = Experts(a)
        self.register_buffer("layer_scalar", torch.ones(1))


class SelfConditioning(nn.Module):
    def __init__(self, a: Arch):
        super().__init__()
        self.pre_norm = Norm(a.hidden)
        self.gate_proj = _linear(a.hidden, a.inter)
        self.up_proj = _linear(a.hidden, a.inter)
        self.down_proj = _linear(a.inter, a.hidden)


class EncoderScalars(nn.Module):
    """model.encoder.language_model.layers.N.layer_scalar: the prefill pass's own per-layer scalars."""

    def __init__(self, n: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Module() for _ in range(n))
        for m in self.layers:
            m.register_buffer("layer_scalar", torch.ones(1))


class DemoModel(nn.Module):
    def __init__(self, a: Arch):
        super().__init__()
        self.arch = a
        self.model = nn.Module()
        self.model.decoder = nn.Module()
        dec = self.model.decoder
        dec.embed_tokens = nn.Embedding(a.vocab, a.hidden)
        nn.init.normal_(dec.embed_tokens.weight, std=0.02)
        dec.layers = nn.ModuleList(Layer(a, i) for i in range(a.n_layers))
        dec.norm = Norm(a.hidden)
        dec.self_conditioning = SelfConditioning(a)
        self.model.encoder = nn.Module()
        self.model.encoder.language_model = EncoderScalars(a.n_layers)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)
        for t in set(a.layer_types):
            hd = a.head_dims[a.layer_types.index(t)]
            self.register_buffer(f"inv_freq_{t}", inv_freq(a.rope[t], hd), persistent=False)

    # -- pieces ---------------------------------------------------------------------------------

    @property
    def embedding(self) -> torch.Tensor:
        return self.model.decoder.embed_tokens.weight

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.decoder.embed_tokens(ids) * math.sqrt(self.arch.hidden)

    def soft_embed(self, logits: torch.Tensor) -> torch.Tensor:
        """SC soft embedding from (already temperature-divided) logits: softmax @ E * sqrt(H)."""
        probs = logits.float().softmax(-1).to(self.embedding.dtype)
        return (probs @ self.embedding) * math.sqrt(self.arch.hidden)

    def _sc_inject(self, canvas_emb: torch.Tensor, sc: torch.Tensor | None) -> torch.Tensor:
        a, scm = self.arch, self.model.decoder.self_conditioning
        if sc is None:
            sc = torch.zeros_like(canvas_emb)
        x = rms_norm(sc, scm.pre_norm.weight, a.eps)
        return rms_norm(canvas_emb + scm.down_proj(gelu(scm.gate_proj(x)) * scm.up_proj(x)), None, a.eps)

    def _attention(self, layer: Layer, i: int, h, cos, sin, mask):
        a, at = self.arch, layer.self_attn
        B, L, _ = h.shape
        hd, kv = a.head_dims[i], a.kv_heads[i]
        q = rope_apply(rms_norm(at.q_proj(h).view(B, L, a.n_heads, hd), at.q_norm.weight, a.eps), cos, sin)
        k_raw = at.k_proj(h).view(B, L, kv, hd)
        v = at.v_proj(h).view(B, L, kv, hd) if a.layer_types[i] == SLIDING else k_raw
        k = rope_apply(rms_norm(k_raw, at.k_norm.weight, a.eps), cos, sin)
        v = rms_norm(v, None, a.eps)
        rep = a.n_heads // kv
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0)
        return at.o_proj(o.transpose(1, 2).reshape(B, L, a.n_heads * hd))

    def _moe(self, layer: Layer, x):
        a = self.arch
        r = layer.router
        n = rms_norm(x, None, a.eps) * r.scale * (a.hidden ** -0.5)
        probs = F.linear(n, r.proj.weight).float().softmax(-1)
        w, idx = torch.topk(probs, a.top_k, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        w = w * r.per_expert_scale[idx]
        # Every expert runs on every row (4 small experts: cheaper than gathering); rows not routed to an
        # expert get weight 0, so the sum equals top-k routing exactly.
        dense_w = torch.zeros(*probs.shape, dtype=w.dtype, device=w.device).scatter(-1, idx, w)
        xe = rms_norm(x, layer.pre_feedforward_layernorm_2.weight, a.eps)
        gu = torch.einsum("bld,efd->blef", xe, layer.experts.gate_up_proj)
        g, u = gu.chunk(2, dim=-1)
        y = torch.einsum("blef,edf->bled", gelu(g) * u, layer.experts.down_proj)
        return (y * dense_w.to(y.dtype)[..., None]).sum(-2)

    # -- the training forward -------------------------------------------------------------------

    def forward(self, prefix: torch.Tensor, n_pad: torch.Tensor, canvas: torch.Tensor,
                sc: torch.Tensor | None = None) -> torch.Tensor:
        """prefix [B, Lp] right-aligned (the first n_pad[b] slots are padding), canvas [B, C],
        sc [B, C, H] soft embedding or None (zero SC). Returns softcapped float32 logits [B, C, V]."""
        a = self.arch
        B, Lp = prefix.shape
        C = canvas.shape[1]
        L = Lp + C
        dev = prefix.device
        x = torch.cat([self.embed(prefix), self._sc_inject(self.embed(canvas), sc)], dim=1)
        pos = (torch.arange(L, device=dev)[None] - n_pad[:, None]).clamp(min=0)
        masks = build_masks(n_pad, Lp, C, a.window, dev)
        trig = {}
        for t in set(a.layer_types):
            f = pos[..., None].float() * getattr(self, f"inv_freq_{t}")
            f = torch.cat([f, f], dim=-1)
            trig[t] = (f.cos().to(x.dtype), f.sin().to(x.dtype))
        is_prefix = (torch.arange(L, device=dev) < Lp)[None, :, None]
        enc = self.model.encoder.language_model.layers
        for i, layer in enumerate(self.model.decoder.layers):
            t = a.layer_types[i]
            res = x
            h = rms_norm(x, layer.input_layernorm.weight, a.eps)
            h = self._attention(layer, i, h, *trig[t], masks[t])
            x = res + rms_norm(h, layer.post_attention_layernorm.weight, a.eps)
            res = x
            h1 = rms_norm(layer.mlp(rms_norm(x, layer.pre_feedforward_layernorm.weight, a.eps)),
                          layer.post_feedforward_layernorm_1.weight, a.eps)
            h2 = rms_norm(self._moe(layer, x), layer.post_feedforward_layernorm_2.weight, a.eps)
            x = res + rms_norm(h1 + h2, layer.post_feedforward_layernorm.weight, a.eps)
            scalar = torch.where(is_prefix, enc[i].layer_scalar.to(x.dtype), layer.layer_scalar.to(x.dtype))
            x = x * scalar
        h = rms_norm(x[:, Lp:], self.model.decoder.norm.weight, a.eps)
        logits = F.linear(h, self.embedding).float()
        return a.softcap * torch.tanh(logits / a.softcap)


def build_masks(n_pad: torch.Tensor, Lp: int, C: int, window: int, device) -> dict:
    """Boolean attention masks [B, 1, L, L] (True = attend) for [prefix | canvas] rows, per layer type."""
    L = Lp + C
    q = torch.arange(L, device=device)[:, None]
    k = torch.arange(L, device=device)[None, :]
    key_ok = k[None] >= n_pad[:, None, None]  # [B, 1, L]: padding slots are never keys
    q_pre, k_pre = q < Lp, k < Lp
    causal = q_pre & k_pre & (k <= q)
    canvas_rows = ~q_pre
    full = (causal | canvas_rows) & key_ok  # canvas rows see all prefix + all canvas
    slide = ((causal & (q - k <= window - 1)) | (canvas_rows & (~k_pre | (k >= Lp - (window - 1))))) & key_ok
    # padding query rows: let them see themselves so softmax is defined (their outputs are never used)
    diag = (q == k)[None] & ~key_ok.transpose(1, 2)
    return {FULL: (full | diag)[:, None], SLIDING: (slide | diag)[:, None]}


# ----------------------------------------------------------------------------------------------
# data


def prepare(out: Path, n_train: int, n_heldout_per_family: int, vocab: int, tokenizer: Path | None = None,
            history_prob: float = 0.1, isolate_spaces: bool = False):
    """Tokenizer + tokenized data as torch tensors (the GPU side needs only torch).

    tokenizer: reuse this directory's tokenizer instead of training one (continued training must keep the
    ids of the checkpoint it starts from)."""
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(HERE.parent / "src"))
    import build_tokenizer
    import demo_data
    from diffgemma.tokenizer import Tokenizer

    out.mkdir(parents=True, exist_ok=True)
    tok_dir = out / "tokenizer"
    tok_dir.mkdir(exist_ok=True)
    t0 = time.time()
    if tokenizer is not None:
        for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            shutil.copy(tokenizer / f, tok_dir / f)
    else:
        build_tokenizer.main([str(tok_dir), "--vocab", str(vocab)] + (["--isolate-spaces"] if isolate_spaces else []))
        (tok_dir / "chat_template.jinja").write_text(build_tokenizer.TEMPLATE_PATH.read_text())
    tok = Tokenizer.from_dir(tok_dir)
    # city-name and echo word pools from the tokenizer this data is for, not whichever one is shipped
    demo_data.use_vocab(demo_data.vocab_of(tok_dir / "tokenizer.json"))
    print(f"tokenizer {time.time() - t0:.0f}s", flush=True)
    fams = list(demo_data.FAMILIES)

    def encode(examples):
        prompts = [tok.apply_chat_template(e.messages, tools=e.tools, enable_thinking=e.enable_thinking,
                                           tokenize=False) for e in examples]
        p_ids = tok.encode_batch(prompts)
        t_ids = tok.encode_batch([e.target for e in examples])
        flat, plen, tlen = [], [], []
        for p, t in zip(p_ids, t_ids):
            flat.append(p + t)
            plen.append(len(p))
            tlen.append(len(t))
        lens = torch.tensor([len(s) for s in flat])
        off = torch.cumsum(lens, 0) - lens
        return {
            "tokens": torch.tensor([i for s in flat for i in s], dtype=torch.int16),
            "offset": off, "prompt_len": torch.tensor(plen), "target_len": torch.tensor(tlen),
            "family": torch.tensor([fams.index(e.family) for e in examples]),
        }

    t0 = time.time()
    train = demo_data.generate("train", n_train, seed=20261130, history_prob=history_prob)
    held = demo_data.heldout_set(n_heldout_per_family)
    data = {"train": encode(train), "heldout": encode(held), "families": fams,
            "heldout_answers": [e.answer for e in held], "heldout_keys": [e.key for e in held]}
    torch.save(data, out / "data.pt")
    n_tok = data["train"]["tokens"].numel()
    print(f"data: {n_train} train ({n_tok} tokens), {len(held)} held-out, {time.time() - t0:.0f}s", flush=True)


class Batcher:
    """Draws training blocks on the device: (prefix right-aligned, canvas clean block) per example."""

    def __init__(self, d: dict, canvas: int, device):
        self.C = canvas
        self.dev = device
        self.tokens = d["tokens"].to(device=device, dtype=torch.long)
        self.off = d["offset"].to(device)
        self.plen = d["prompt_len"].to(device)
        self.tlen = d["target_len"].to(device)
        self.n_blocks = (self.tlen + canvas - 1) // canvas
        self.N = self.off.numel()

    def block(self, ex: torch.Tensor, start: torch.Tensor):
        """Examples ex [B], canvas starting `start` [B] answer tokens in -> prefix [B, Lp], n_pad [B],
        clean canvas [B, C]. The prefix is the prompt plus the answer's first `start` tokens."""
        C = self.C
        pe = self.plen[ex] + start
        Lp = int(pe.max())
        j = torch.arange(Lp, device=self.dev)[None]
        n_pad = Lp - pe
        src = j - n_pad[:, None]
        prefix = torch.where(src >= 0, self.tokens[(self.off[ex][:, None] + src.clamp(min=0))], PAD_ID)
        c = torch.arange(C, device=self.dev)[None] + pe[:, None]  # positions inside prompt+target
        end = (self.plen[ex] + self.tlen[ex])[:, None]
        idx = (self.off[ex][:, None] + c).clamp(max=self.tokens.numel() - 1)
        canvas = torch.where(c < end, self.tokens[idx], PAD_ID)
        return prefix, n_pad, canvas

    def draw(self, B: int, gen: torch.Generator, cut_prob: float = 0.0):
        """B random (example, canvas start) pairs. A canvas starts at a block boundary k*C (every block of
        an answer equally likely), or with probability cut_prob at any answer token: the engine's commit
        trim hands the next canvas an answer cut mid-block, which block-aligned training never shows."""
        ex = torch.randint(0, self.N, (B,), device=self.dev, generator=gen)
        k = (torch.rand(B, device=self.dev, generator=gen) * self.n_blocks[ex]).long()
        start = k * self.C
        if cut_prob > 0:
            any_tok = (torch.rand(B, device=self.dev, generator=gen) * self.tlen[ex]).long()
            start = torch.where(torch.rand(B, device=self.dev, generator=gen) < cut_prob, any_tok, start)
        return ex, start


# ----------------------------------------------------------------------------------------------
# training


def train_step(model: DemoModel, prefix, n_pad, clean, gen, vocab: int, pad_weight: float = 0.25):
    B, C = clean.shape
    dev = clean.device
    t = torch.rand(B, 1, device=dev, generator=gen)
    noise = torch.randint(0, vocab, (B, C), device=dev, generator=gen)
    noisy = torch.where(torch.rand(B, C, device=dev, generator=gen) < t, noise, clean)
    # SC mode per example: 0 = zero signal, 1 = engine first-step seed (embed of the noisy canvas), 2 = two-pass
    mode = torch.randint(0, 4, (B,), device=dev, generator=gen).clamp(max=2)  # 25% / 25% / 50%
    seed = model.embed(noisy).detach()
    first_sc = torch.where((mode == 1)[:, None, None], seed, torch.zeros_like(seed))
    with torch.no_grad():
        first = model(prefix, n_pad, noisy, first_sc)
        temp = 0.4 + 0.4 * torch.rand(B, 1, 1, device=dev, generator=gen)  # the schedule's temperature range
        two_pass = model.soft_embed(first / temp)
    sc = torch.where((mode == 2)[:, None, None], two_pass.to(seed.dtype), first_sc)
    logits = model(prefix, n_pad, noisy, sc)
    ce = F.cross_entropy(logits.reshape(-1, vocab), clean.reshape(-1), reduction="none").view(B, C)
    # positions after the stop token are pad: still trained (the canvas must settle there) but lighter
    w = torch.where(clean == PAD_ID, pad_weight, 1.0)
    return (ce * w).sum() / w.sum(), ce


@torch.no_grad()
def generate_batch(model: DemoModel, prompts: list, canvas: int, max_blocks: int, gen: torch.Generator,
                   max_steps: int = 48, t_min: float = 0.4, t_max: float = 0.8, entropy_bound: float = 0.1,
                   min_steps_entropy_stop: int = 12, mean_entropy_stop: float = 0.05, confident: float = 0.005):
    """Batched entropy-bound denoising, block by block (ARCHITECTURE §6/§7 defaults, without the plateau
    rule, the empty-reply retry and the commit trim). The whole [prefix | canvas] is recomputed every
    step (equal to prefill + denoise). Returns per prompt: tokens (through the stop token), steps per block."""
    dev = model.embedding.device
    V = model.arch.vocab
    n = len(prompts)
    seqs = [list(p) for p in prompts]
    out = [[] for _ in range(n)]
    steps = [[] for _ in range(n)]
    active = list(range(n))
    for _ in range(max_blocks):
        if not active:
            break
        lens = torch.tensor([len(seqs[i]) for i in active], device=dev)
        Lp = int(lens.max())
        prefix = torch.full((len(active), Lp), PAD_ID, dtype=torch.long, device=dev)
        for r, i in enumerate(active):
            prefix[r, Lp - len(seqs[i]):] = torch.tensor(seqs[i], device=dev)
        n_pad = Lp - lens
        B = len(active)
        cv = torch.randint(0, V, (B, canvas), device=dev, generator=gen)
        sc = model.embed(cv)  # the engine's first-step SC seed
        prev = None
        done = torch.zeros(B, dtype=torch.bool, device=dev)
        final = torch.zeros(B, canvas, dtype=torch.long, device=dev)
        n_steps = torch.zeros(B, dtype=torch.long, device=dev)
        for s in range(max_steps):
            T = t_min + (t_max - t_min) * (max_steps - s) / max_steps
            logits = model(prefix, n_pad, cv, sc) / T
            lp = logits.log_softmax(-1)
            H = -(lp.exp() * lp).sum(-1)  # [B, C] nats
            am = logits.argmax(-1)
            order = H.argsort(-1)
            csum = H.gather(-1, order).cumsum(-1)
            acc_sorted = csum <= entropy_bound
            acc_sorted[:, 0] = True
            acc = torch.zeros_like(acc_sorted).scatter(-1, order, acc_sorted)
            if s == max_steps - 1:
                acc[:] = False
            live = ~done
            final = torch.where(live[:, None], am, final)
            n_steps = n_steps + live.long()
            mH = H.mean(-1)
            all_pad = (am == PAD_ID).all(-1)
            stop_now = (mH < mean_entropy_stop) & (s + 1 >= min_steps_entropy_stop)
            if prev is not None:
                stop_now |= (am == prev).all(-1) & (mH < confident)
            stop_now &= ~all_pad
            done |= stop_now & live
            if bool(done.all()):
                break
            renoise = torch.randint(0, V, (B, canvas), device=dev, generator=gen)
            cv = torch.where(acc, am, renoise)
            sc = model.soft_embed(logits)
            prev = am
        still = []
        for r, i in enumerate(active):
            blk = final[r].tolist()
            steps[i].append(int(n_steps[r]))
            hit = [j for j, t in enumerate(blk) if t in STOP_IDS]
            if hit:
                out[i].extend(blk[: hit[0] + 1])
            else:
                out[i].extend(blk)
                seqs[i].extend(blk)
                still.append(i)
        active = still
    return out, steps


def evaluate(model: DemoModel, d: dict, canvas: int, seed: int = 0, batch: int = 512,
             limit_per_family: int | None = None) -> dict:
    h = d["heldout"]
    fams = d["families"]
    toks = h["tokens"].long()
    prompts, targets, fam = [], [], []
    for o, p, t, f in zip(h["offset"].tolist(), h["prompt_len"].tolist(), h["target_len"].tolist(),
                          h["family"].tolist()):
        if limit_per_family is not None and fam.count(fams[f]) >= limit_per_family:
            continue
        prompts.append(toks[o : o + p].tolist())
        targets.append(toks[o + p : o + p + t].tolist())
        fam.append(fams[f])
    gen = torch.Generator(device=model.embedding.device).manual_seed(seed)
    outs, steps = [], []
    for i in range(0, len(prompts), batch):
        max_blocks = 2 + max(len(t) for t in targets[i : i + batch]) // canvas
        o, s = generate_batch(model, prompts[i : i + batch], canvas, max_blocks, gen)
        outs += o
        steps += s
    res = {}
    for f in fams:
        idx = [i for i, x in enumerate(fam) if x == f]
        if not idx:
            continue
        em = sum(outs[i] == targets[i] for i in idx) / len(idx)
        n_tok = sum(len(outs[i]) for i in idx)
        n_fwd = sum(sum(steps[i]) for i in idx)
        res[f] = {"n": len(idx), "exact_match": em, "tokens_per_forward": n_tok / max(n_fwd, 1),
                  "mean_steps_per_block": n_fwd / max(sum(len(steps[i]) for i in idx), 1)}
    all_tok = sum(len(o) for o in outs)
    all_fwd = sum(sum(s) for s in steps)
    res["_all"] = {"n": len(outs), "exact_match": sum(o == t for o, t in zip(outs, targets)) / len(outs),
                   "tokens_per_forward": all_tok / max(all_fwd, 1)}
    res["_samples"] = [{"family": fam[i], "target": targets[i], "output": outs[i], "steps": steps[i]}
                       for i in range(0, len(outs), max(1, len(outs) // 40))]
    return res


def train(data_dir: Path, out: Path, seconds: float, batch: int, lr: float, device: str, seed: int,
          chunks: int = 4, cut_prob: float = 0.0, eval_per_family: int | None = None, log_every: int = 25,
          init: Path | None = None, warm: int = 200):
    torch.manual_seed(seed)
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    d = torch.load(data_dir / "data.pt")
    a = Arch.from_dict(DEMO_TEXT_CONFIG)
    model = DemoModel(a)
    if init is not None:
        # Continue from an exported checkpoint (checkpoint names == this module's parameter names).
        from safetensors.torch import load_file

        own = model.state_dict()
        found = {k: v.float() for k, v in load_file(str(init)).items() if k in own}
        missing = sorted(set(own) - set(found))
        assert not missing, f"--init {init} lacks {missing[:3]}"
        model.load_state_dict(found)
        print(f"initialised from {init} ({len(found)} tensors)", flush=True)
    model = model.to(dev)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"params {n_params / 1e6:.2f}M  device {dev}  torch {torch.__version__}", flush=True)
    batcher = Batcher(d["train"], DEMO_CANVAS, dev)
    gen = torch.Generator(device=dev).manual_seed(seed)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95), eps=1e-8)
    log = []
    t0 = time.time()
    step = 0
    autocast = torch.autocast(device_type=dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda")
    while True:
        el = time.time() - t0
        frac = el / seconds
        if frac >= 1.0:
            break
        cur_lr = lr * min(1.0, (step + 1) / warm) * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = cur_lr
        opt.zero_grad(set_to_none=True)
        loss_sum = 0.0
        # Prefix lengths vary 10x (arithmetic vs tool declarations / later blocks of long answers): sort the
        # batch by length and run it as chunks, so short prefixes are not padded to the longest one.
        ex, start = batcher.draw(batch, gen, cut_prob)
        order = (batcher.plen[ex] + start).argsort()
        for chunk in order.chunk(chunks):
            prefix, n_pad, clean = batcher.block(ex[chunk], start[chunk])
            with autocast:
                loss, _ = train_step(model, prefix, n_pad, clean, gen, a.vocab)
            (loss * (chunk.numel() / batch)).backward()
            loss_sum += loss.detach() * (chunk.numel() / batch)
        loss = loss_sum
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % log_every == 0 or step == 1:
            rec = {"step": step, "time_s": round(time.time() - t0, 1), "loss": float(loss), "lr": cur_lr,
                   "grad_norm": float(gn)}
            log.append(rec)
            print(json.dumps(rec), flush=True)
    train_s = time.time() - t0
    print(f"trained {step} steps in {train_s:.0f}s", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().float().cpu().contiguous() for k, v in model.state_dict().items()}
    save_state(sd, out)
    (out / "loss_log.json").write_text(json.dumps({"steps": step, "train_seconds": train_s, "batch": batch,
                                                   "lr": lr, "log": log}))
    # evaluate the weights as they will ship: rounded to bf16, computed in f32
    model.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in sd.items()})
    model.eval()
    t1 = time.time()
    res = evaluate(model, d, DEMO_CANVAS, limit_per_family=eval_per_family)
    res["_eval_seconds"] = time.time() - t1
    (out / "eval.json").write_text(json.dumps(res, indent=1))
    for f, r in res.items():
        if not f.startswith("_samples") and isinstance(r, dict):
            print(f, json.dumps(r), flush=True)
    return model, res


def save_state(sd: dict, out: Path, max_bytes: int = 15_000_000):
    """f32 state dict in <= max_bytes torch files (the device tool returns files up to 16 MB)."""
    parts, cur, size = [], {}, 0
    for k in sorted(sd):
        nb = sd[k].numel() * 4
        if cur and size + nb > max_bytes:
            parts.append(cur)
            cur, size = {}, 0
        cur[k] = sd[k]
        size += nb
    parts.append(cur)
    for i, p in enumerate(parts):
        torch.save(p, out / f"state_{i}.pt")


def load_state(ckpt: Path) -> dict:
    sd = {}
    for f in sorted(ckpt.glob("state_*.pt")):
        sd.update(torch.load(f))
    return sd


# ----------------------------------------------------------------------------------------------
# export: the HF checkpoint (config.json through transformers, bf16 safetensors)


def demo_hf_config(vocab: int = None):
    from transformers import DiffusionGemmaConfig

    tc = dict(DEMO_TEXT_CONFIG)
    if vocab:
        tc["vocab_size"] = vocab
    return DiffusionGemmaConfig(
        text_config=tc, canvas_length=DEMO_CANVAS,
        vision_config={"model_type": "gemma4_vision", "hidden_size": 16, "intermediate_size": 32,
                       "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 8,
                       "position_embedding_size": 16},
        boi_token_id=3, eoi_token_id=3, image_token_id=3,  # no vision in the demo: point at <unk>
    )


GENERATION_CONFIG = {
    "bos_token_id": 2, "pad_token_id": 0, "eos_token_id": [1, 106, 50],
    "max_new_tokens": 256, "max_denoising_steps": 48, "entropy_bound": 0.1, "t_min": 0.4, "t_max": 0.8,
    "stability_threshold": 1, "confidence_threshold": 0.005,
}


def export(ckpt: Path, tok_dir: Path, out: Path):

    from transformers import DiffusionGemmaForBlockDiffusion

    sd = load_state(ckpt)
    cfg = demo_hf_config()
    hf = DiffusionGemmaForBlockDiffusion(cfg)
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    unexpected = [k for k in unexpected if "inv_freq" not in k]
    assert not unexpected, unexpected
    bad = [k for k in missing if not (k.startswith("model.encoder.vision_tower") or k.startswith("model.encoder.embed_vision")
                                      or k.startswith("model.encoder.language_model.") or k == "lm_head.weight")]
    assert not bad, bad
    hf.tie_weights()
    hf = hf.to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(out, safe_serialization=True)
    (out / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2) + "\n")
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tok_dir / f, out / f)
    print(f"exported to {out}")


def eval_engine(model_dir: Path | None, per_family: int, out: Path, semantics: str = "contract", seed: int = 0,
                families: list[str] | None = None):
    """Held-out exact match etc. measured through the package itself: diffgemma.load + diffgemma.generate."""
    import collections

    sys.path.insert(0, str(HERE))
    import demo_data
    import diffgemma
    from diffgemma.generation import generate

    model = diffgemma.load(model_dir, device="cpu", dtype=torch.float32)
    tok = model.tokenizer
    rows = []
    t0 = time.time()
    for ex in demo_data.heldout_set(per_family):
        if families and ex.family not in families:
            continue
        ids = tok.apply_chat_template(ex.messages, tools=ex.tools, enable_thinking=ex.enable_thinking)
        target = tok.encode(ex.target)
        r = generate(model, torch.tensor(ids), seed=seed, max_new_tokens=400, semantics=semantics)
        ok = r.tokens == target[:-1] and r.stop_token == target[-1]
        rows.append({"family": ex.family, "ok": ok, "n_tokens": len(r.tokens) + (r.stop_token is not None),
                     "forwards": r.forwards, "steps_per_block": r.steps_per_block, "stop_reasons": r.stop_reasons,
                     "retries": r.retries, "answer": ex.answer, "text": tok.decode(r.tokens),
                     "name_kind": tool_call_name_kind(ex, tok, demo_data) if ex.family == "tool_call" else None})
    res = {"semantics": semantics, "seed": seed, "per_family": per_family, "seconds": time.time() - t0,
           "settings": dataclasses.asdict(r.settings) if getattr(r, "settings", None) is not None else None}
    for fam in list(demo_data.FAMILIES) + ["_all"]:
        rs = [r for r in rows if fam in (r["family"], "_all")]
        if not rs:
            continue
        blocks = [s for r in rs for s in r["steps_per_block"]]
        stops = collections.Counter(s for r in rs for s in r["stop_reasons"])
        res[fam] = {"n": len(rs), "exact_match": sum(r["ok"] for r in rs) / len(rs),
                    "tokens_per_forward": sum(r["n_tokens"] for r in rs) / max(1, sum(r["forwards"] for r in rs)),
                    "mean_steps_per_block": sum(blocks) / max(1, len(blocks)), "stop_reasons": dict(stops),
                    "retries": sum(r["retries"] for r in rs)}
    res["tool_call_by_name_kind"] = {
        kind: f"{sum(r['ok'] for r in rows if r['name_kind'] == kind)}/{sum(r['name_kind'] == kind for r in rows)}"
        for kind in sorted({r["name_kind"] for r in rows if r["name_kind"]})}
    res["_failures"] = [r for fam in demo_data.FAMILIES for r in [r for r in rows if r["family"] == fam and not r["ok"]][:30]]
    out.write_text(json.dumps(res, indent=1))
    for fam, r in res.items():
        if isinstance(r, dict) and "exact_match" in r:
            print(f"{fam:12s} n={r['n']:4d} em={r['exact_match']:.2f} tpf={r['tokens_per_forward']:.2f} "
                  f"steps/block={r['mean_steps_per_block']:.1f} stops={r['stop_reasons']}", flush=True)
    print("tool calls by held-out name:", res["tool_call_by_name_kind"], flush=True)
    return res


def tool_call_name_kind(ex, tok, demo_data) -> str:
    """What a held-out tool call has to copy: add_numbers' digits, or a city that is real or made up (a
    syllable name, or an alphabetic token of the shipped tokenizer), written as one token or several."""
    city = ex.meta["args"].get("city")
    if city is None:
        return "add_numbers"
    pool = "real" if city in demo_data.CITIES else "made-up" if city in demo_data.SYNTHETIC_CITIES else "token-word"
    return f"{pool}, {'one token' if len(tok.encode(city)) == 1 else 'several tokens'}"


def plot(loss_log: Path, out: Path):
    """Loss curve PNG (matplotlib is a tool-time extra, not a package dependency)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    log = json.loads(loss_log.read_text())
    steps = [r["step"] for r in log["log"]]
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=110)
    ax.plot(steps, [r["loss"] for r in log["log"]], lw=1.2)
    ax.set_yscale("log")
    ax.set_xlabel("step (batch %d blocks of %d tokens)" % (log["batch"], DEMO_CANVAS))
    ax.set_ylabel("weighted canvas cross-entropy")
    ax.set_title("diffgemma demo model: %d steps, %.0f s on one H200" % (log["steps"], log["train_seconds"]))
    ax.grid(alpha=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    print(f"wrote {out}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--out", type=Path, default=Path("build/demo"))
    p.add_argument("--n-train", type=int, default=150_000)
    p.add_argument("--heldout-per-family", type=int, default=100)
    p.add_argument("--vocab", type=int, default=DEMO_TEXT_CONFIG["vocab_size"])
    p.add_argument("--tokenizer", type=Path, default=None, help="reuse this tokenizer dir (continued training)")
    p.add_argument("--history-prob", type=float, default=0.1, help="share of multi-turn training chats")
    p.add_argument("--isolate-spaces", action="store_true",
                   help="a new tokenizer with spaces as tokens of their own (tools/build_tokenizer.py)")
    t = sub.add_parser("train")
    t.add_argument("--data", type=Path, default=Path("build/demo"))
    t.add_argument("--out", type=Path, required=True)
    t.add_argument("--seconds", type=float, default=420)
    t.add_argument("--batch", type=int, default=256)
    t.add_argument("--lr", type=float, default=1.5e-3)
    t.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--eval-per-family", type=int, default=None)
    t.add_argument("--chunks", type=int, default=4, help="length-sorted chunks per batch (gradient accumulation)")
    t.add_argument("--init", type=Path, default=None, help="start from this model.safetensors (continue training)")
    t.add_argument("--warmup", type=int, default=200, help="linear warm-up steps")
    t.add_argument("--cut-prob", type=float, default=0.0,
                   help="fraction of canvases starting mid-block (run 1 used 0; recommended 0.25)")
    e = sub.add_parser("export")
    e.add_argument("--ckpt", type=Path, required=True)
    e.add_argument("--tokenizer", type=Path, default=Path("build/demo/tokenizer"))
    e.add_argument("--out", type=Path, default=HERE.parent / "src" / "diffgemma" / "assets" / "demo")
    v = sub.add_parser("eval", help="held-out metrics through diffgemma.load + diffgemma.generate (CPU)")
    v.add_argument("--model", type=Path, default=None, help="checkpoint dir (default: the embedded demo)")
    v.add_argument("--per-family", type=int, default=20)
    v.add_argument("--semantics", default="contract", choices=["contract", "hf"])
    v.add_argument("--seed", type=int, default=0)
    v.add_argument("--families", default=None, help="comma list: evaluate only these families")
    v.add_argument("--out", type=Path, required=True)
    pl = sub.add_parser("plot", help="loss curve PNG from a loss_log.json (needs matplotlib)")
    pl.add_argument("--log", type=Path, required=True)
    pl.add_argument("--out", type=Path, default=HERE.parent / "docs" / "demo_loss.png")
    args = ap.parse_args(argv)
    if args.cmd == "plot":
        plot(args.log, args.out)
    elif args.cmd == "eval":
        eval_engine(args.model, args.per_family, args.out, args.semantics, args.seed,
                    args.families.split(",") if args.families else None)
    elif args.cmd == "prepare":
        if args.isolate_spaces and args.tokenizer is not None:
            p.error("--isolate-spaces builds a new tokenizer; it cannot be combined with --tokenizer")
        prepare(args.out, args.n_train, args.heldout_per_family, args.vocab, args.tokenizer, args.history_prob,
                args.isolate_spaces)
    elif args.cmd == "train":
        train(args.data, args.out, args.seconds, args.batch, args.lr, args.device, args.seed,
              chunks=args.chunks, cut_prob=args.cut_prob, eval_per_family=args.eval_per_family,
              init=args.init, warm=args.warmup)
    else:
        export(args.ckpt, args.tokenizer, args.out)


if __name__ == "__main__":
    main()
