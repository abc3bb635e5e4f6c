"""The engine's checks of what a caller hands it: ids, a denoise's SC input, a prefill's image embeddings and groups.
Each bad input is one InputError naming it and what was expected, raised before anything is written."""

from __future__ import annotations

import torch

from ..errors import InputError


def check_ids(engine, ids, what: str, check_range: bool) -> torch.Tensor:
    """A 1-D non-empty integer tensor of ids (in range where check_range), on the engine's device as int64."""
    if not isinstance(ids, torch.Tensor):
        ids = torch.as_tensor(ids, dtype=torch.long)
    if ids.dim() != 1 or ids.dtype not in (torch.int64, torch.int32) or len(ids) == 0:
        raise InputError(f"{what}: expected a non-empty 1-D integer tensor, got shape {list(ids.shape)} "
                         f"dtype {ids.dtype}")
    if check_range and (int(ids.min()) < 0 or int(ids.max()) >= engine.config.vocab_size):
        raise InputError(f"{what}: ids must be in [0, {engine.config.vocab_size}), got range "
                         f"[{int(ids.min())}, {int(ids.max())}]")
    return ids.to(engine.device, torch.long)


def check_image_inputs(engine, T: int, embeds, groups):
    """prefill's embeds / image_groups, checked and on the device (embeds in the model's dtype)."""
    H = engine.config.hidden_size
    if embeds is not None:
        if (not isinstance(embeds, torch.Tensor) or tuple(embeds.shape) != (T, H)
                or not embeds.is_floating_point()):
            got = (f"{list(embeds.shape)} {embeds.dtype}" if isinstance(embeds, torch.Tensor)
                   else type(embeds).__name__)
            raise InputError(f"prefill: embeds is {got}, expected a floating [{T}, {H}] tensor")
        embeds = embeds.to(engine.device, engine.dtype)
    if groups is not None:
        if (not isinstance(groups, torch.Tensor) or tuple(groups.shape) != (T,)
                or groups.dtype not in (torch.int64, torch.int32)):
            got = (f"{list(groups.shape)} {groups.dtype}" if isinstance(groups, torch.Tensor)
                   else type(groups).__name__)
            raise InputError(f"prefill: image_groups is {got}, expected a [{T}] integer tensor (image index or -1)")
        groups = groups.to(engine.device, torch.long)
        if bool((groups < -1).any()):
            raise InputError(f"prefill: image_groups holds {int(groups.min())}; expected image indices >= 0 or -1")
    return embeds, groups


def check_denoise(engine, cache, canvas_ids, sc_logits, sc_embeds):
    """A denoise call's inputs, checked -> (ids on the device, mode: 'none' / 'logits' / 'embeds', the SC input or
    None)."""
    ids = check_ids(engine, canvas_ids, "canvas ids", check_range=not getattr(canvas_ids, "is_cuda", False))
    C, V, H = len(ids), engine.config.vocab_size, engine.config.hidden_size
    if C > cache.canvas:
        raise InputError(f"denoise: canvas of {C} tokens exceeds the cache's canvas scratch ({cache.canvas})")
    if sc_logits is not None and sc_embeds is not None:
        raise InputError("denoise: pass sc_logits or sc_embeds, not both")
    if sc_logits is not None and tuple(sc_logits.shape) != (C, V):
        raise InputError(f"denoise: sc_logits has shape {list(sc_logits.shape)}, expected [{C}, {V}]")
    if sc_embeds is not None and tuple(sc_embeds.shape) != (C, H):
        raise InputError(f"denoise: sc_embeds has shape {list(sc_embeds.shape)}, expected [{C}, {H}]")
    if sc_logits is not None:
        return ids, "logits", sc_logits
    return ids, ("none" if sc_embeds is None else "embeds"), sc_embeds


def prefill_chunks(n: int, chunk: int, groups: torch.Tensor | None) -> list[tuple[int, int]]:
        """[start, end) prefill chunks of at most `chunk` rows, except that no chunk ends inside an image (the rows of
        one group id, from its first row to its last): that chunk ends before the image, or after it where the image
        starts the chunk (then it is longer than `chunk`)."""
        span = {}
        if groups is not None:
            for i, g in enumerate(groups.tolist()):
                if g >= 0:
                    span[g] = (span.get(g, (i, i))[0], i + 1)
        inside = sorted(span.values())
        out, s = [], 0
        while s < n:
            e = min(s + chunk, n)
            for a, b in inside:
                if a < e < b:
                    e = a if a > s else b
                    break
            out.append((s, e))
            s = e
        return out
