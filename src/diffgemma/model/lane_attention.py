"""A batched denoise's attention over its lanes (Forward.denoise_batch; docs/ARCHITECTURE.md, 'Batching').

Each lane attends to its own cache. With streams (options.lane_streams) each lane runs on a stream of its own, forked
from the layer's and joined before the o projection, so the lanes' small kernels overlap on the GPU: the same kernels
on the same inputs, the same bits. Where the layer's o projection is FP8, each lane quantizes its own output rows per
token into its rows of one pair of buffers (on its stream), so the o GEMM reads them without a concatenation and with
the bits the whole output's quantization gives (per-token quantization is row by row).
"""

from __future__ import annotations

import torch

from ..ops.fp8_quant import fp8_row_buffers, fp8_rows_done, quantize_rows
from ..ops.fp8_weight import Fp8Weight


def lanes_attend(layers, lanes, streams, device):
    """-> attend(li, qkv, need_out) over `lanes` ((first row, end row, the lane's attend) each, in row order):
    the lanes' outputs as one [rows, width] tensor, or an Fp8Rows where layer li's o projection is FP8. streams:
    one a lane, or None (one after another on the current stream)."""

    def attend(li, qkv, need_out):
        o_w = layers[li].o
        fp8 = need_out and isinstance(o_w, Fp8Weight)
        # made on the layer's stream before the fork; the lanes write their rows, and the join orders every read
        rows = fp8_row_buffers(len(qkv), o_w.shape[1], device) if fp8 else None

        def run(a, b, lane):
            o = lane(li, qkv[a:b], need_out)
            return quantize_rows(o, out=(rows[0][a:b], rows[1][a:b])) if fp8 else o

        if streams is None:
            outs = [run(*lane) for lane in lanes]
        else:
            main = torch.cuda.current_stream(device)
            outs = []
            for lane, s in zip(lanes, streams):  # fork: each lane on its own stream
                s.wait_stream(main)
                with torch.cuda.stream(s):
                    outs.append(run(*lane))
            for s in streams:  # join before anything reads the lanes' outputs
                main.wait_stream(s)
        if fp8:
            return fp8_rows_done(*rows)
        return torch.cat(outs) if need_out else None

    return attend
