"""The reference forward of Gemma-4's vision tower and its projector, in plain torch, to be read as the spec.

image patches [P, 3·p²] (pixels in [0, 1])
  -> patch embedding: linear(2·(pixels - 0.5)) + learned x-embedding[x] + learned y-embedding[y]
  -> num_layers encoder layers, every patch attending to every patch of its image (no mask):
       x += norm(o_proj(attn(q, k, v)))  with q, k = RoPE2d(norm_w(proj(norm_w(x)))), v = norm(proj(...))
       x += norm(mlp(norm(x)))           (gated GELU-tanh MLP; RMSNorms are x·w; attention scale 1)
     2-D RoPE: the first half of each head rotates by the patch's x, the second half by its y,
     each half pairing dimension d with d + head_dim/4.
  -> pooling: mean over each pooling_kernel_size² block of patches, times sqrt(hidden_size)
  -> (optional) standardize: (h - std_bias) · std_scale
  -> projector (embed_vision): linear(no-scale RMSNorm(h)) into the text model's hidden size.
The result is one text-space embedding per soft token, in the image's row-major pooled order.

Weights are read from the checkpoint in its own layout (transformers' tensor names), only on the
first image: a text-only session never touches them. The GEMMs run in the dtype given (float32 by
default; bf16 on the fast engine's GPU, where attention is torch's fused SDPA), norms, pooling and
softmax in at least float32; images are encoded one at a time, on their real patches only.
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch
import torch.nn.functional as F

from ..errors import InputError, TensorError
from .config import VisionConfig
from .preprocess import PreparedImage

TOWER = "model.encoder.vision_tower."
PROJECTOR = "model.encoder.embed_vision."
_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
_CLIP_BOUNDS = ("input_min", "input_max", "output_min", "output_max")


def expected_vision_tensors(cfg: VisionConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the tower and projector need, with its shape, keyed by checkpoint name."""
    D, F_, H, KV, hd = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    out = {
        TOWER + "patch_embedder.input_proj.weight": (D, 3 * cfg.patch_size**2),
        TOWER + "patch_embedder.position_embedding_table": (2, cfg.position_embedding_size, D),
        PROJECTOR + "embedding_projection.weight": (cfg.text_hidden_size, D),
    }
    shapes = {"self_attn.q_proj": (H * hd, D), "self_attn.k_proj": (KV * hd, D), "self_attn.v_proj": (KV * hd, D),
              "self_attn.o_proj": (D, H * hd), "mlp.gate_proj": (F_, D), "mlp.up_proj": (F_, D),
              "mlp.down_proj": (D, F_)}
    for i in range(cfg.num_layers):
        p = f"{TOWER}encoder.layers.{i}."
        for lin in _LINEARS:
            out[p + lin + ".linear.weight"] = shapes[lin]
            if cfg.use_clipped_linears:
                for bound in _CLIP_BOUNDS:
                    out[p + lin + "." + bound] = ()
        out[p + "self_attn.q_norm.weight"] = (hd,)
        out[p + "self_attn.k_norm.weight"] = (hd,)
        for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            out[p + norm + ".weight"] = (D,)
    if cfg.standardize:
        out[TOWER + "std_bias"] = (D,)
        out[TOWER + "std_scale"] = (D,)
    return out


# ----------------------------------------------------------------------------- building blocks

def _work(dtype: torch.dtype) -> torch.dtype:
    """The dtype norms and softmax compute in: at least float32 (a bf16 tower keeps only its GEMMs in bf16)."""
    return torch.promote_types(dtype, torch.float32)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x²) + eps) · w (weight None = the no-scale variant), computed in at least float32."""
    xf = x.to(_work(x.dtype))
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y if weight is None else y * weight.to(xf.dtype)).to(x.dtype)


def rope_1d(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """x [P, heads, n]; rotates pairs (d, d + n/2) by positions·inv_freq (angles formed in float32)."""
    ang = positions.to(torch.float32)[:, None] * inv_freq.to(torch.float32)[None, :]
    cos, sin = ang.cos().to(x.dtype)[:, None, :], ang.sin().to(x.dtype)[:, None, :]
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def rope_2d(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """First half of each head rotated by the x coordinate, second half by the y coordinate."""
    half = x.shape[-1] // 2
    return torch.cat([rope_1d(x[..., :half], positions[:, 0], inv_freq),
                      rope_1d(x[..., half:], positions[:, 1], inv_freq)], dim=-1)


# ----------------------------------------------------------------------------- the tower

class VisionTower:
    """Gemma-4's vision tower + projector over a TensorSource; weights are read on first use.

    `source` is anything with the checkpoint module's TensorSource interface (keys / shape / get),
    e.g. the SafetensorsSource of the checkpoint directory.
    """

    def __init__(self, cfg: VisionConfig, source, *, device="cpu", dtype: torch.dtype = torch.float32):
        self.config = cfg
        self.device = torch.device(device)
        self.dtype = dtype
        self._source = source
        self._w: dict[str, torch.Tensor] | None = None
        self._lock = threading.Lock()
        spatial = cfg.head_dim // 2
        self.inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, spatial, 2, dtype=torch.float32) / spatial))

    @staticmethod
    def from_checkpoint(directory, *, device="cpu", dtype: torch.dtype = torch.float32) -> "VisionTower":
        """Parse the checkpoint's vision config now; read no tensor until the first image.

        `directory` is an HF checkpoint or a quantized pack (whose vision tensors are dequantized on read).
        """
        from ..loader import open_source

        cfg = VisionConfig.from_checkpoint(directory)
        return VisionTower(cfg, open_source(Path(directory)), device=device, dtype=dtype)

    @property
    def loaded(self) -> bool:
        return self._w is not None

    def load(self) -> None:
        """Validate every tower tensor's presence and shape, then read them all (or none)."""
        with self._lock:
            if self._w is not None:
                return
            expected = expected_vision_tensors(self.config)
            have = self._source.keys()
            missing = [n for n in expected if n not in have]
            if missing:
                more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
                raise TensorError(f"vision tower: tensor {missing[0]!r} is missing from the checkpoint{more}; "
                                  f"expected shape {list(expected[missing[0]])}")
            for name, shape in expected.items():
                got = tuple(self._source.shape(name))
                if got != shape:
                    raise TensorError(f"vision tower: tensor {name!r} has shape {list(got)}, expected {list(shape)}")
            weights = {name: self._source.get(name, dtype=self.dtype, device=self.device) for name in expected}
            self._w = weights

    @torch.no_grad()
    def encode(self, images: list[PreparedImage]) -> list[torch.Tensor]:
        """Each image's soft-token embeddings in text space: [num_soft_tokens, text_hidden_size]."""
        for i, img in enumerate(images):
            self._check(img, i)
        self.load()
        return [self._encode_one(img) for img in images]

    # -- internals ---------------------------------------------------------------------------

    def _check(self, img: PreparedImage, index: int) -> None:
        cfg, what = self.config, f"image {index + 1}"
        rows, cols = img.grid
        k = cfg.pooling_kernel_size
        if img.pixel_values.shape != (rows * cols, 3 * cfg.patch_size**2) or img.positions.shape != (rows * cols, 2):
            raise InputError(f"{what}: patches {list(img.pixel_values.shape)} do not fit a {rows}x{cols} grid of "
                             f"{cfg.patch_size}x{cfg.patch_size} patches (prepared for another model?)")
        if rows % k or cols % k:
            raise InputError(f"{what}: a {rows}x{cols} patch grid cannot be pooled by {k}x{k}")
        if max(rows, cols) > cfg.position_embedding_size:
            raise InputError(f"{what}: a {rows}x{cols} patch grid exceeds the tower's "
                             f"{cfg.position_embedding_size} patch positions per side")

    def _encode_one(self, img: PreparedImage) -> torch.Tensor:
        cfg, w, eps = self.config, self._w, self.config.rms_norm_eps
        pixels = img.pixel_values.to(self.device, _work(self.dtype))
        pos = img.positions.to(self.device)
        table = w[TOWER + "patch_embedder.position_embedding_table"]
        x = (2 * (pixels - 0.5)).to(self.dtype) @ w[TOWER + "patch_embedder.input_proj.weight"].T
        x = x + table[0][pos[:, 0]] + table[1][pos[:, 1]]
        inv_freq = self.inv_freq.to(self.device)
        for i in range(cfg.num_layers):
            x = self._layer(i, x, pos, inv_freq)
        # Pool k x k blocks of the row-major patch grid into one soft token each, row-major.
        rows, cols = img.grid
        k = cfg.pooling_kernel_size
        h = x.to(_work(x.dtype)).view(rows // k, k, cols // k, k, -1).mean(dim=(1, 3)).reshape(-1, x.shape[-1])
        h = h * cfg.hidden_size**0.5
        if cfg.standardize:
            h = (h - w[TOWER + "std_bias"].to(h.dtype)) * w[TOWER + "std_scale"].to(h.dtype)
        return rms_norm(h, None, eps).to(self.dtype) @ w[PROJECTOR + "embedding_projection.weight"].T

    def _linear(self, prefix: str, x: torch.Tensor) -> torch.Tensor:
        w = self._w
        if self.config.use_clipped_linears:
            x = torch.clamp(x, w[prefix + ".input_min"], w[prefix + ".input_max"])
        y = x @ w[prefix + ".linear.weight"].T
        if self.config.use_clipped_linears:
            y = torch.clamp(y, w[prefix + ".output_min"], w[prefix + ".output_max"])
        return y

    def _layer(self, i: int, x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
        cfg, w, eps = self.config, self._w, self.config.rms_norm_eps
        p = f"{TOWER}encoder.layers.{i}."
        P, hd = x.shape[0], cfg.head_dim
        h = rms_norm(x, w[p + "input_layernorm.weight"], eps)
        q = self._linear(p + "self_attn.q_proj", h).view(P, cfg.num_heads, hd)
        k = self._linear(p + "self_attn.k_proj", h).view(P, cfg.num_kv_heads, hd)
        v = self._linear(p + "self_attn.v_proj", h).view(P, cfg.num_kv_heads, hd)
        q = rope_2d(rms_norm(q, w[p + "self_attn.q_norm.weight"], eps), pos, inv_freq)
        k = rope_2d(rms_norm(k, w[p + "self_attn.k_norm.weight"], eps), pos, inv_freq)
        v = rms_norm(v, None, eps)
        groups = cfg.num_heads // cfg.num_kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        if x.dtype in (torch.float32, torch.float64):
            probs = torch.softmax(torch.einsum("qhd,khd->hqk", q, k), dim=-1)  # scale 1: QK-norm folds it in
            a = torch.einsum("hqk,khd->qhd", probs, v).reshape(P, -1)
        else:  # half precision: torch's fused attention (f32 softmax and accumulation), no [P, P] scores in memory
            a = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), scale=1.0)
            a = a.transpose(0, 1).reshape(P, -1)
        x = x + rms_norm(self._linear(p + "self_attn.o_proj", a), w[p + "post_attention_layernorm.weight"], eps)
        h = rms_norm(x, w[p + "pre_feedforward_layernorm.weight"], eps)
        m = F.gelu(self._linear(p + "mlp.gate_proj", h), approximate="tanh") * self._linear(p + "mlp.up_proj", h)
        return x + rms_norm(self._linear(p + "mlp.down_proj", m), w[p + "post_feedforward_layernorm.weight"], eps)
