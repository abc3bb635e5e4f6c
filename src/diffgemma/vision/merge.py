"""Images in the prompt: the token layout, the embedding merge, and the prefill attention rule.

Layout (transformers' Gemma-4 processor): each image in the prompt is written as
    <boi> <image> x num_soft_tokens <eoi>
and the text model sees, at every <image> position, that image's next soft-token embedding from the
vision tower (in place of the token's own scaled embedding: soft tokens are not multiplied by
sqrt(hidden_size)); every other position keeps its text embedding.

Attention rule during prefill: where the checkpoint says use_bidirectional_attention="vision",
the <image> tokens of one image (one unbroken run of them) see each other in both directions, on
every layer and regardless of the sliding window; everything else stays causal (and windowed on
sliding layers). <boi>/<eoi> are ordinary causal tokens. `image_groups` labels the rows; the model's
prefill applies the rule (ReferenceModel.prefill(..., image_groups=...)). A run must be prefilled in
one call: the rule only relates rows of the same call, so a split image would lose its bidirectional half.
"""

from __future__ import annotations

import torch

from ..errors import InputError
from .config import VisionConfig


def image_placeholder(num_soft_tokens: int, cfg: VisionConfig) -> list[int]:
    """The ids that stand for one image in the prompt: boi, num_soft_tokens image tokens, eoi."""
    if num_soft_tokens <= 0:
        raise InputError(f"an image needs at least one soft token, got {num_soft_tokens}")
    return [cfg.boi_token_id] + [cfg.image_token_id] * num_soft_tokens + [cfg.eoi_token_id]


def image_runs(ids: torch.Tensor, image_token_id: int) -> list[tuple[int, int]]:
    """(start, end) of every maximal run of image tokens in a 1-D id tensor, in order."""
    is_image = (ids == image_token_id).to(torch.int8)
    edges = torch.diff(is_image, prepend=is_image.new_zeros(1), append=is_image.new_zeros(1))
    starts = torch.nonzero(edges == 1).flatten().tolist()
    ends = torch.nonzero(edges == -1).flatten().tolist()
    return list(zip(starts, ends))


def image_groups(ids: torch.Tensor, cfg: VisionConfig) -> torch.Tensor | None:
    """Per position: the index of the image run it belongs to, or -1 for text (transformers'
    block_sequence_ids). None when the checkpoint keeps image tokens causal: no extra rule then."""
    if not cfg.bidirectional_images:
        return None
    groups = torch.full(ids.shape, -1, dtype=torch.long, device=ids.device)
    for g, (start, end) in enumerate(image_runs(ids, cfg.image_token_id)):
        groups[start:end] = g
    return groups


def merge_image_embeddings(text_embeds: torch.Tensor, ids: torch.Tensor, features: list[torch.Tensor],
                           cfg: VisionConfig) -> torch.Tensor:
    """Replace each image run's rows of `text_embeds` [T, H] with that image's features, in order.

    features: one [num_soft_tokens, H] tensor per image, in prompt order. The runs and the images
    must correspond one to one, each run exactly as long as its image's soft tokens.
    """
    if text_embeds.dim() != 2 or text_embeds.shape[0] != ids.shape[0]:
        raise InputError(f"merge: embeddings {list(text_embeds.shape)} do not match {list(ids.shape)} ids")
    runs = image_runs(ids, cfg.image_token_id)
    if len(runs) != len(features):
        raise InputError(f"prompt has {len(runs)} image placeholder(s) but {len(features)} image(s) were given")
    out = text_embeds.clone()
    for i, ((start, end), feats) in enumerate(zip(runs, features)):
        if feats.dim() != 2 or feats.shape != (end - start, text_embeds.shape[1]):
            raise InputError(f"image {i + 1}: {end - start} placeholder tokens in the prompt, but its features "
                             f"have shape {list(feats.shape)} (expected [{end - start}, {text_embeds.shape[1]}])")
        out[start:end] = feats.to(out.dtype)
    return out
