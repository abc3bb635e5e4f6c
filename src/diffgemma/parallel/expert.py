"""Expert parallelism: rank r of G holds experts [r·E/G, (r+1)·E/G) of every layer, every other weight whole.

  ExpertShard            a TensorSource that hands out this rank's slice of each expert stack (bf16, packed records,
                         or FP8 values with their row scales) and every other tensor as it is; it reads only the
                         slice where the source allows (safetensors slices, a pack's record bytes)
  ExpertParallelForward  Forward with the layer's experts split: routing runs whole on every rank (replicated
                         weights, the same bits), each rank runs its experts on the routes sent to them and sums
                         their weighted outputs in f32, one all-reduce adds the ranks' sums, and the layer's finish
                         (post-norms, residual, layer scalar, next input norm) runs on the reduced sum as before

The plan of the routes (ops/moe_plan.py) is made for all E experts; this rank's routes are a contiguous run of its
rows, [offs[first-1], offs[last]). They are read through device offsets, never a host copy, so the step stays one
CUDA graph (the all-reduce captured in it): the expert GEMMs get the plan's rows from that start on, and the offsets
of their own experts (docs/ARCHITECTURE.md, 'Several GPUs').
"""

from __future__ import annotations

import torch

from ..model.forward import Forward
from ..ops.fp8_weight import Fp8Weight
from ..ops.layouts import planes
from ..ops.moe import expert_ffn
from ..ops.moe_plan import expert_order_ref
from ..ops.rmsnorm import layer_finish_moe

EXPERT_TENSORS = ("experts.gate_up_proj", "experts.down_proj")
SUM_BLOCK = 2048  # tokens per pass of the partial sum: bounds its [tokens, k, hidden] f32 temporary at prefill


def is_expert(name: str) -> bool:
    return name.endswith(EXPERT_TENSORS)


def expert_share(num_experts: int, rank: int, size: int) -> tuple[int, int]:
    """(first expert, count) of `rank`'s share."""
    count = num_experts // size
    return rank * count, count


class ExpertShard:
    """`source` with each expert stack [E, ...] cut to experts [first, first + count) (shape, get, record bytes).
    Every other name, and every other method of the source, passes through."""

    def __init__(self, source, first: int, count: int):
        self.source, self.first, self.count = source, first, count
        self._handles = {}
        if hasattr(source, "record_tensor"):  # a source that makes its records on the device (the benchmark's)
            self.record_tensor = self._record_tensor
        if hasattr(source, "fp8_weight"):  # a source with FP8 tensors (a hub FP8 checkpoint, Fp8QuantizedSource)
            self.fp8_weight = self._fp8_weight

    def __getattr__(self, name):
        return getattr(self.source, name)

    def shape(self, name):
        shape = tuple(self.source.shape(name))
        return (self.count,) + shape[1:] if is_expert(name) else shape

    def get(self, name, dtype=None, device="cpu"):
        if not is_expert(name):
            return self.source.get(name, dtype=dtype, device=device)
        file_of = getattr(self.source, "file_of", None)
        if file_of is not None:  # safetensors: read the slice alone
            t = self._safetensors_slice(file_of(name), name)
        else:
            t = self.source.get(name, dtype=dtype, device=device).narrow(0, self.first, self.count)
        return t.to(device=device, dtype=dtype or t.dtype).clone()

    def _fp8_weight(self, name, device="cpu") -> Fp8Weight | None:
        """The source's FP8 form of `name` (None where it has none); of an expert stack, experts [first, first + count)
        of its values and of its per-row scales alike, read on the host and then moved to `device`."""
        if not is_expert(name):
            return self.source.fp8_weight(name, device)
        fw = self.source.fp8_weight(name, "cpu")
        if fw is None:
            return None
        return Fp8Weight(fw.weight.narrow(0, self.first, self.count).contiguous(),
                         fw.scale.narrow(0, self.first, self.count).contiguous()).to(device)

    def _safetensors_slice(self, path, name) -> torch.Tensor:
        from safetensors import safe_open

        handle = self._handles.get(path)
        if handle is None:
            handle = self._handles[path] = safe_open(str(path), framework="pt", device="cpu")
        return handle.get_slice(name)[self.first:self.first + self.count]

    def record(self, name):
        """The record of the share: each plane's rows of experts [first, first + count), copied out of the source's
        (memory-mapped) record, so only those bytes are read."""
        full = self.source.record(name)
        if not is_expert(name):
            return full
        out = bytearray(self._share_nbytes(name))
        for src, dst in self._plane_pairs(name):
            a = src.offset + self.first * dst.rows // self.count * dst.row_bytes if src.rows != 1 else src.offset
            out[dst.offset:dst.offset + dst.nbytes] = full[a:a + dst.nbytes]
        return memoryview(out)

    def _record_tensor(self, name, device=None):
        full = self.source.record_tensor(name, device)
        if not is_expert(name):
            return full
        out = torch.zeros(self._share_nbytes(name), dtype=torch.uint8, device=full.device)
        for src, dst in self._plane_pairs(name):
            a = src.offset + self.first * dst.rows // self.count * dst.row_bytes if src.rows != 1 else src.offset
            out[dst.offset:dst.offset + dst.nbytes].copy_(full[a:a + dst.nbytes])
        return out

    def _plane_pairs(self, name):
        fmt = self.source.kind(name)
        return zip(planes(fmt, self.source.shape(name)), planes(fmt, self.shape(name)))

    def _share_nbytes(self, name) -> int:
        last = planes(self.source.kind(name), self.shape(name))[-1]
        return last.offset + last.nbytes


class ExpertParallelForward(Forward):
    """Forward over one rank's experts (the weights' expert stacks hold experts [first, first + count)). One rank:
    Forward's own MoE, bit for bit."""

    def __init__(self, config, weights, *, group, **kw):
        super().__init__(config, weights, **kw)
        self.group = group
        self.first, self.count = expert_share(config.num_experts, group.rank, group.size)
        self._ones: dict = {}

    def _moe(self, lw, x, dense, moe_in, weights, src, inv, offs, order, scalar, w_next, path_routes):
        if self.group.size == 1:
            return super()._moe(lw, x, dense, moe_in, weights, src, inv, offs, order, scalar, w_next, path_routes)
        part = self.local_expert_sum(lw, moe_in, weights, src, inv, offs, order, x.dtype, path_routes)
        self.group.all_reduce(part)
        # the reduced sum through the same finish: the "un-permute" of one route per token with weight 1 is exact
        rows, ones = self._identity(len(x))
        return layer_finish_moe(x, dense, part, rows, ones, lw.post_ff1_norm, lw.post_ff2_norm, lw.post_ff_norm,
                                scalar, self.config.rms_norm_eps, w_next)

    def local_expert_sum(self, lw, moe_in, weights, src, inv, offs, order, dtype, path_routes=None) -> torch.Tensor:
        """f32 [T, H]: Σ over this rank's routes of token t of weight · expert output (zero where it has none).
        path_routes: the route count the layer's kernel paths go by (None: all of them), passed on as it is: the layer
        chose its experts' input form (ops/moe_paths.takes_f16_operand) by it against this rank's stack, and the GEMMs
        must choose the same path."""
        T, k = weights.shape
        M = src.numel()
        offs = offs.long()
        start = offs[self.first - 1] if self.first else torch.zeros((), dtype=torch.long, device=offs.device)
        mine_offs = (offs[self.first:self.first + self.count] - start).to(torch.int32)
        mine_src = src.index_select(0, torch.clamp(start + self._rows_arange(M), max=M - 1))
        mine_order = expert_order_ref(mine_offs) if order is not None else None
        # rows past this rank's last route are the GEMMs' scratch (never written): the sum below never reads them
        y = expert_ffn(moe_in, lw.experts_gu, lw.experts_down, mine_offs, src=mine_src, order=mine_order,
                       out_dtype=dtype, path_routes=path_routes)
        dest = inv.view(T, k) - start
        mine = (dest >= 0) & (dest < mine_offs[-1])
        dest = dest.clamp(0, M - 1)
        w = weights.float()
        out = torch.empty(T, y.shape[-1], dtype=torch.float32, device=y.device)
        for s in range(0, T, SUM_BLOCK):
            e = min(T, s + SUM_BLOCK)
            picked = y.index_select(0, dest[s:e].reshape(-1)).view(e - s, k, -1).float()
            out[s:e] = torch.where(mine[s:e, :, None], picked * w[s:e, :, None], 0.0).sum(1)
        return out

    def _identity(self, T: int):
        """(arange(T), ones [T, 1] f32) on the device, made once per T: constants a graph reads."""
        got = self._ones.get(T)
        if got is None:
            got = self._ones[T] = (torch.arange(T, device=self.device),
                                   torch.ones(T, 1, dtype=torch.float32, device=self.device))
        return got
