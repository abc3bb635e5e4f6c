"""The other ranks' loop: receive each call rank 0's LeadEngine hands over, and make it on this rank's engine.

Each rank keeps its own twin of every cache rank 0 made (by the id rank 0 gave it) and runs the same prefills and
denoises on it, so its forwards' all-reduces meet rank 0's. The results stay here: rank 0 reads its own (every rank's
logits are the same, the all-reduce having given each the same sums).
"""

from __future__ import annotations

import torch

from .engine import DENOISE, DENOISE_BATCH, NEW_CACHE, PREFILL, SETTINGS, STOP, TRUNCATE
from .group import Group


@torch.no_grad()
def follow(engine, group: Group) -> int:
    """Run rank 0's calls on `engine` until it ends the run -> the number of calls made. A failed collective raises
    ParallelError (the launcher ends the process with its message)."""
    caches: dict[int, object] = {}
    calls = 0
    hidden = engine.config.hidden_size

    def receive(*shape, dtype=torch.long):  # a call's tensor, from rank 0
        return group.broadcast(torch.empty(shape, dtype=dtype, device=engine.device))

    while True:
        op, nfreed, *values = group.header()
        if nfreed:
            for cid in group.broadcast_object():
                caches.pop(cid, None)
        if op == STOP:
            return calls
        calls += 1
        if op == SETTINGS:
            engine.options, engine.kv_dtype, engine.use_graphs = group.broadcast_object()
        elif op == NEW_CACHE:
            cid, tokens, slack = values[:3]
            caches[cid] = engine.new_cache(tokens, None if slack < 0 else slack)
        elif op == TRUNCATE:
            cid, length = values[:2]
            caches[cid].truncate(length)
        elif op == PREFILL:
            cid, n, has_embeds, has_groups = values[:4]
            ids = receive(n)
            embeds = receive(n, hidden, dtype=engine.dtype) if has_embeds else None
            groups = receive(n) if has_groups else None
            engine.prefill(caches[cid], ids, embeds, groups)
        elif op == DENOISE:
            cid, n, has_sc = values[:3]
            ids = receive(n)
            engine.denoise_raw(caches[cid], ids, sc_embeds=receive(n, hidden, dtype=engine.dtype) if has_sc else None)
        elif op == DENOISE_BATCH:
            cids, lens, has_sc = group.broadcast_object()
            ids = receive(sum(lens))
            sc = [receive(n, hidden, dtype=engine.dtype) if has else None for n, has in zip(lens, has_sc)]
            engine.denoise_batch_raw([caches[c] for c in cids], list(ids.split(lens)), sc_embeds=sc)
        else:
            raise RuntimeError(f"rank {group.rank}: unknown call {op} from rank 0")
