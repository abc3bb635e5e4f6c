"""OpenAI `image_url` content parts -> image parts the chat takes, with the server's limits.

A part is `{"type": "image_url", "image_url": {"url": URL}}` (or the URL as a plain string). `data:` URLs
with base64 PNG, JPEG or WebP are decoded here; http(s) URLs are refused unless the server runs with
`--allow-image-urls`, and are then fetched with a byte cap and a total timeout (redirects not followed; the
operator who allows URLs lets clients make the server fetch any address it can reach). Every
problem is a 400 naming the part (`messages[1].content[2]: ...`): a bad data URL, another media type, too
many bytes, too many images in the request, or an image PIL cannot decode or that is too large once decoded
(those last ones when the image is prepared, vision/preprocess.py).
"""

from __future__ import annotations

import base64
import binascii
import logging
import re
from dataclasses import dataclass

from ..vision.preprocess import MAX_IMAGE_PIXELS
from .errors import RequestError

log = logging.getLogger("diffgemma.server")

MEDIA_TYPES = ("image/png", "image/jpeg", "image/jpg", "image/webp")
# a data URL's part before its first comma (its base64 data follows the comma)
_DATA_HEADER = re.compile(r"data:(?P<type>[\w.+-]+/[\w.+-]+)?(?P<params>(;[^;,]*)*?);base64")
_PIECE = 1 << 20  # base64 characters decoded per call, a multiple of 4


@dataclass(frozen=True)
class ImageLimits:
    """What the server accepts of a request's images."""

    max_bytes: int = 20 * 1024 * 1024  # per image, decoded from base64 (or fetched)
    max_images: int = 8  # per request, over all its messages
    max_pixels: int = MAX_IMAGE_PIXELS  # width x height as the file declares it
    allow_urls: bool = False  # fetch http(s) URLs
    url_timeout_s: float = 10.0


def _bad(message: str, where: str) -> RequestError:
    return RequestError(400, f"{where}: {message}", "messages")


def decode_data_url(url: str, where: str, limits: ImageLimits) -> bytes:
    header, comma, text = url.partition(",")
    m = _DATA_HEADER.fullmatch(header) if comma else None
    if m is None:
        raise _bad("not a base64 data URL (expected data:image/png;base64,...)", where)
    media = (m.group("type") or "").lower()
    if media not in MEDIA_TYPES:
        raise _bad(f"media type {media or 'none'!r}; expected image/png, image/jpeg or image/webp", where)
    if len(text) * 3 // 4 > limits.max_bytes + 3:  # over, unless whitespace (wrapped lines) makes it look longer
        text = _without_whitespace(text)
        if len(text) * 3 // 4 > limits.max_bytes + 3:
            raise _bad(f"the image is over this server's limit of {limits.max_bytes} bytes", where)
    try:
        data = _b64decode(text)
    except (binascii.Error, ValueError):
        raise _bad("the data URL's base64 does not decode", where) from None
    if not data:
        raise _bad("the data URL holds no bytes", where)
    if len(data) > limits.max_bytes:
        raise _bad(f"the image is {len(data)} bytes, over this server's limit of {limits.max_bytes} bytes", where)
    return data


def _pieces(text: str):
    return (text[i:i + _PIECE] for i in range(0, len(text), _PIECE))


def _without_whitespace(text: str) -> str:
    return "".join("".join(piece.split()) for piece in _pieces(text))


def _b64decode(text: str) -> bytes:
    """Strict base64, whitespace anywhere allowed (data URLs may wrap lines) -> the bytes; binascii.Error or
    ValueError when it does not decode. Decoded _PIECE characters at a time (whole 4-character groups), so a large
    image leaves the interpreter to the server's other threads between pieces."""
    try:
        return _b64decode_strict(text)
    except (binascii.Error, ValueError):
        compact = _without_whitespace(text)
        if len(compact) == len(text):
            raise
        return _b64decode_strict(compact)


def _b64decode_strict(text: str) -> bytes:
    out = []
    for i in range(0, len(text), _PIECE):
        piece = text[i:i + _PIECE]
        if piece.endswith("=") and i + _PIECE < len(text):  # padding is only at the very end
            raise binascii.Error("padding before the end of the data")
        out.append(base64.b64decode(piece, validate=True))
    return b"".join(out)


def fetch_url(url: str, where: str, limits: ImageLimits) -> bytes:
    """GET an http(s) image with the byte cap and the timeout (each wait at most url_timeout_s, and no more pieces
    read past it); no redirects, no other schemes. Blocking: the server prepares requests in a thread pool
    (prepare.py), so a URL that never answers holds its own request only."""
    import time

    import httpx

    deadline = time.monotonic() + limits.url_timeout_s
    try:
        with httpx.Client(timeout=limits.url_timeout_s, follow_redirects=False) as client:
            with client.stream("GET", url) as r:
                if r.status_code != 200:
                    raise _bad(f"fetching {url!r} gave HTTP {r.status_code}", where)
                declared = r.headers.get("content-length")
                if declared is not None and declared.isdigit() and int(declared) > limits.max_bytes:
                    raise _bad(f"{url!r} is {declared} bytes, over this server's limit of {limits.max_bytes}", where)
                data = bytearray()
                for piece in r.iter_bytes():
                    data += piece
                    if len(data) > limits.max_bytes:
                        raise _bad(f"{url!r} is over this server's limit of {limits.max_bytes} bytes", where)
                    if time.monotonic() > deadline:
                        raise _bad(f"fetching {url!r} took over {limits.url_timeout_s:g} s", where)
    except httpx.TimeoutException:
        raise _bad(f"fetching {url!r} took over {limits.url_timeout_s:g} s", where) from None
    except httpx.HTTPError as e:
        raise _bad(f"cannot fetch {url!r} ({type(e).__name__}: {e})", where) from None
    if not data:
        raise _bad(f"{url!r} returned no bytes", where)
    return bytes(data)


def image_part(part: dict, where: str, limits: ImageLimits) -> dict:
    """An OpenAI image_url part -> {"type": "image", "image": bytes}."""
    spec = part.get("image_url")
    url = spec.get("url") if isinstance(spec, dict) else spec
    if not isinstance(url, str) or not url:
        raise _bad("an image_url part needs {'image_url': {'url': 'data:image/png;base64,...'}}", where)
    scheme = url.split(":", 1)[0].lower()
    if scheme == "data":
        data = decode_data_url(url, where, limits)
    elif scheme in ("http", "https"):
        if not limits.allow_urls:
            raise _bad("this server does not fetch image URLs; send the image as a data URL "
                       "(data:image/png;base64,...), or start the server with --allow-image-urls", where)
        data = fetch_url(url, where, limits)
    else:
        raise _bad(f"URL scheme {scheme!r}; expected a data: URL (or http(s) with --allow-image-urls)", where)
    return {"type": "image", "image": data}


def user_content(content, where: str, limits: ImageLimits | None, text) -> str | list:
    """A user message's content: text as `text(content, where)` makes it, or, with image_url parts, a list of
    text and image parts."""
    if not (isinstance(content, list) and any(isinstance(p, dict) and p.get("type") == "image_url" for p in content)):
        return text(content, where)
    limits = limits or ImageLimits()
    out = []
    for i, part in enumerate(content):
        here = f"{where}.content[{i}]"
        if isinstance(part, dict) and part.get("type") == "image_url":
            out.append(image_part(part, here, limits))
        elif isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
            out.append({"type": "text", "text": part["text"]})
        else:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise _bad(f"expected a text or an image_url part, got {kind!r}", here)
    return out


def count_images(messages, limits: ImageLimits | None) -> int:
    limits = limits or ImageLimits()
    n = sum(1 for m in messages if isinstance(m.get("content"), list)
            for p in m["content"] if p.get("type") == "image")
    if n > limits.max_images:
        raise RequestError(400, f"messages: {n} images, over this server's limit of {limits.max_images} per request",
                           "messages")
    return n


def prepare(model, messages: list[dict], limits: ImageLimits | None) -> list[dict]:
    """Decode every image of the request (each a 400 naming its message part): the messages the Session takes."""
    from ..errors import DiffgemmaError, InputError
    from ..vision.prompt import prepare_parts, vision_for

    limits = limits or ImageLimits()
    try:
        vision = vision_for(model)
    except DiffgemmaError as e:  # why (its files, its config) is the operator's to read, in the server's log
        log.info("a request with images refused: %s", e)
        raise RequestError(400, "messages: this model cannot take images; send text only", "messages") from None
    out = []
    for i, m in enumerate(messages):
        if isinstance(m.get("content"), list):
            try:
                m = {**m, "content": prepare_parts(m["content"], vision, f"messages[{i}].content",
                                                   max_pixels=limits.max_pixels)}
            except InputError as e:
                raise RequestError(400, str(e), "messages") from None
        out.append(m)
    return out
