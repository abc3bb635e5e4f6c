"""Images in a chat prompt: content parts -> prompt ids, and the prefill that feeds the images in.

A user message may carry image content parts, `{"type": "image", "image": X}` with X a path, bytes or
a PIL image. `prepare_parts` decodes every image of a message once (an InputError naming the part before
any model work); `render_prompt` renders the chat template and expands each image placeholder the template
wrote (the tokenizer's `<image>` text, as transformers' Gemma-4 processor finds it) into
`<boi> <image> x num_soft_tokens <eoi>`.

Prompt keys. Every image uses the same `<image>` id, so prefix matching on ids alone would reuse the KV
of another picture. A rendered prompt is therefore a *key*: the token ids, with each image's run of
`<image>` ids replaced by a negative sentinel derived from that image's content digest (`image_key`).
Negative values are never token ids, equal images give equal keys (a repeated image still reuses its
KV) and different images differ at their run's first position. Keys are plain int lists, so slots.py's
prefix matching works unchanged; `prefill` turns a key back into ids plus image features.
"""

from __future__ import annotations

import inspect
import io
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import ConfigError, InputError
from .config import VisionConfig
from .merge import image_groups, merge_image_embeddings
from .preprocess import MAX_IMAGE_PIXELS, PreparedImage, open_image, prepare_image

# Template-side image part: what the chat template sees in place of an image (transformers' chat format).
IMAGE_PART_TYPES = ("image", "input_image")


@dataclass(frozen=True)
class PromptImage:
    """One decoded image of a conversation: its patches, the bytes the op-log keeps, its prompt key."""

    prepared: PreparedImage
    data: bytes  # the encoded file as given (a PIL image is kept as PNG, lossless)
    key: int  # the sentinel its soft-token run has in a prompt key


def image_key(digest: str) -> int:
    """The negative sentinel of an image with this content digest (52 bits of it: a float64 keeps it exact)."""
    return -1 - int(digest[:13], 16)


def is_image_part(part) -> bool:
    return isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES


def _encoded_bytes(image, what: str) -> bytes:
    """The bytes to journal: the file's own bytes, or a PNG of a PIL image."""
    if isinstance(image, (bytes, bytearray, memoryview)):
        return bytes(image)
    if isinstance(image, (str, Path)):
        try:
            return Path(image).expanduser().read_bytes()
        except OSError as e:
            raise InputError(f"{what} {str(image)!r}: cannot read it ({e.strerror or e})") from None
    buf = io.BytesIO()
    open_image(image, what).save(buf, format="PNG")
    return buf.getvalue()


def prepare_one(image, vision: "Vision", what: str = "image", max_pixels: int = MAX_IMAGE_PIXELS) -> PromptImage:
    if isinstance(image, PromptImage):
        return image
    prepared = prepare_image(image, vision.config.processing, what=what, max_pixels=max_pixels)
    return PromptImage(prepared, _encoded_bytes(image, what), image_key(prepared.digest))


def message_images(messages) -> list:
    """Every image part's payload, in prompt order."""
    out = []
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            out += [p.get("image") for p in content if is_image_part(p)]
    return out


def has_images(messages) -> bool:
    return any(isinstance(m, dict) and isinstance(m.get("content"), list) and any(map(is_image_part, m["content"]))
               for m in messages)


def prepare_parts(content, vision: "Vision", where: str = "content", max_images: int | None = None,
                  max_pixels: int = MAX_IMAGE_PIXELS):
    """A message's content with each image part's payload decoded into a PromptImage (all or an error)."""
    if not isinstance(content, list):
        return content
    n = sum(map(is_image_part, content))
    if max_images is not None and n > max_images:
        raise InputError(f"{where}: {n} images, at most {max_images} allowed")
    out = []
    for i, part in enumerate(content):
        if is_image_part(part):
            if "image" not in part:
                raise InputError(f"{where}[{i}]: an image part needs an 'image' (a path, bytes or a PIL image)")
            part = {"type": "image", "image": prepare_one(part["image"], vision, f"{where}[{i}]", max_pixels)}
        elif not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise InputError(f"{where}[{i}]: expected a text or an image part, got {kind!r}")
        out.append(part)
    return out


def _template_messages(messages, template: str, placeholder: str) -> list[dict]:
    """The messages as the template takes them: content-part lists stay lists where the template knows image parts
    (an image part's payload becomes a placeholder text naming its type, as transformers hands a template media it
    must not read); otherwise flattened to text with the placeholder per image."""
    parts_aware = "image" in template
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            if parts_aware:
                content = [{"type": "image", "image": f"<{type(p.get('image')).__name__}>"} if is_image_part(p)
                           else p for p in content]
            else:
                content = "".join(placeholder if is_image_part(p) else p["text"] for p in content)
            m = {**m, "content": content}
        out.append(m)
    return out


def render_prompt(tokenizer, vision: "Vision | None", messages, **template_kw) -> tuple[list[int], dict]:
    """Render `messages` -> (prompt key, {key: PromptImage}). Without image parts: the template's ids as they are.
    Image payloads must already be PromptImages (prepare_parts)."""
    images = message_images(messages)
    if not images:
        return tokenizer.apply_chat_template(messages, **template_kw), {}
    if vision is None:
        raise InputError("this model has no vision tower; it cannot take images")
    if not all(isinstance(x, PromptImage) for x in images):
        images = [prepare_one(x, vision, f"image {i + 1}") for i, x in enumerate(images)]
    cfg = vision.config
    texts = [tokenizer.id_to_token(i) for i in (cfg.boi_token_id, cfg.image_token_id, cfg.eoi_token_id)]
    if any(t is None for t in texts):
        raise InputError(f"the tokenizer has no token for the image ids {cfg.boi_token_id}/{cfg.image_token_id}/"
                         f"{cfg.eoi_token_id} of config.json")
    boi, image, eoi = texts
    text = tokenizer.apply_chat_template(_template_messages(messages, tokenizer.chat_template or "", image),
                                         tokenize=False, **template_kw)
    pieces = text.split(image)
    if len(pieces) - 1 != len(images):
        raise InputError(f"the prompt holds {len(pieces) - 1} image placeholder(s) ({image!r}) for "
                         f"{len(images)} image(s); image text must not appear in text parts")
    expanded = pieces[0] + "".join(boi + image * img.prepared.num_soft_tokens + eoi + piece
                                   for img, piece in zip(images, pieces[1:]))
    ids = tokenizer.encode(expanded)
    key, k = [], 0
    for i, t in enumerate(ids):
        if t == cfg.image_token_id:
            if i == 0 or ids[i - 1] != cfg.image_token_id:
                k += 1
            key.append(images[k - 1].key)
        else:
            key.append(t)
    if k != len(images):  # pragma: no cover - the split above already matched them
        raise InputError(f"the prompt holds {k} image runs for {len(images)} image(s)")
    return key, {img.key: img for img in images}


# -- the per-model vision state -----------------------------------------------------------------------

class Vision:
    """A model's vision side: its config and its tower (weights read on the first image)."""

    def __init__(self, model):
        from .tower import VisionTower, expected_vision_tensors

        path = getattr(model, "path", None)
        if path is None:
            raise InputError("this model has no checkpoint directory; it cannot take images")
        try:
            cfg = VisionConfig.from_checkpoint(path)
        except ConfigError as e:
            raise InputError(f"{path}: this model cannot take images ({e})") from None
        if "embeds" not in inspect.signature(model.prefill).parameters:
            raise InputError("this model's prefill takes no image embeddings (embeds=); it cannot take images")
        # The tower computes in the text model's dtype on its device (bf16 on the fast engine's GPU; f32 or f64 for
        # the reference and the CPU engine), its norms and softmax in at least f32.
        tower = VisionTower.from_checkpoint(path, device=model.embedding.device,
                                            dtype=getattr(model, "dtype", model.embedding.dtype))
        if not any(name in tower._source.keys() for name in expected_vision_tensors(cfg)):
            raise InputError(f"{path}: this model cannot take images (its checkpoint has no vision tower)")
        self.config = cfg
        self.tower = tower


_VISION: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def vision_for(model) -> Vision:
    """The model's Vision, made on first use; InputError where the model cannot take images."""
    with _LOCK:
        try:
            return _VISION[model]
        except KeyError:
            v = _VISION[model] = Vision(model)
            return v
        except TypeError:  # not weak-referenceable: no caching
            return Vision(model)


def prefill_images(model, cache, key: list[int], images: dict) -> list[int]:
    """Prefill the part of prompt key `key` up to the end of its last image run in one call (image features merged
    in, the image attention rule on) -> the text after it, as ids, for the loop to prefill. A key without images
    comes back as it is."""
    last = max((i for i, t in enumerate(key) if t < 0), default=None)
    if last is None:
        return list(key)
    vision = vision_for(model)
    cfg = vision.config
    head, order = [], []
    for i, t in enumerate(key[:last + 1]):
        if t < 0:
            if t not in images:
                raise InputError(f"prompt position {i}: image key {t} names no image of this prompt")
            if i == 0 or key[i - 1] != t:
                order.append(images[t])
            head.append(cfg.image_token_id)
        else:
            head.append(t)
    device = model.embedding.device
    ids = torch.tensor(head, dtype=torch.long, device=device)
    features = vision.tower.encode([img.prepared for img in order])
    embeds = merge_image_embeddings(model.embed(ids), ids, features, cfg)
    model.prefill(cache, ids, embeds=embeds, image_groups=image_groups(ids, cfg))
    return list(key[last + 1:])
