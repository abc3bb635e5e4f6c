"""Image -> pixel patches, exactly as transformers' Gemma-4 image processor (PIL backend) makes them.

Steps, per image:
1. decode (a path, bytes, or a PIL image) and convert to RGB, compositing transparency onto white;
2. resize with aspect ratio kept to the largest size that fits the patch budget
   (max_soft_tokens · pooling_kernel_size² patches) with both sides multiples of
   patch_size · pooling_kernel_size (bicubic, via PIL);
3. rescale uint8 -> [0, 1] (float64 product, stored as float32), no mean/std normalisation;
4. cut into patch_size x patch_size patches, row-major, each flattened as (row, column, channel);
5. record each patch's (x, y) grid position.

The image becomes (patches / pooling_kernel_size²) soft tokens. transformers pads every image to
max_patches with zero patches at position (-1, -1) so images can be batched; `pad_batch` builds that
layout, while the reference tower takes the real patches only.

Every way an image can be bad (missing file, not an image, truncated, 0x0, too many pixels) raises
one InputError naming the image; a list of images is fully checked before any is returned.
"""

from __future__ import annotations

import hashlib
import io
import math
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import InputError
from .config import ImageProcessing

# Decoding refuses images above this many pixels before it allocates them (a PNG of a few kB can
# declare 100000 x 100000). 50 MP covers any camera or screenshot; the model sees at most ~1 MP.
MAX_IMAGE_PIXELS = 50_000_000


@dataclass(frozen=True)
class PreparedImage:
    """One image as the vision tower takes it (real patches only, no padding)."""

    pixel_values: torch.Tensor  # [num_patches, 3 · patch_size²] float32 in [0, 1]
    positions: torch.Tensor  # [num_patches, 2] int64, (x, y) patch grid coordinates
    grid: tuple[int, int]  # (patch rows, patch columns)
    num_soft_tokens: int
    digest: str  # sha256 of the decoded RGB pixels and their size: equal images hash equal


def _pil():
    try:
        from PIL import Image
    except ImportError:  # pragma: no cover - pillow is a dependency
        raise InputError("images need the 'pillow' package: pip install pillow") from None
    return Image


def open_image(image, what: str = "image", max_pixels: int = MAX_IMAGE_PIXELS):
    """Decode `image` (str/Path to a file, bytes, or a PIL image) to a fully loaded RGB PIL image."""
    Image = _pil()
    if isinstance(image, Image.Image):
        pil, name = image, what
    else:
        if isinstance(image, (str, Path)):
            path = Path(image).expanduser()
            name = f"{what} {str(path)!r}"
            if not path.is_file():
                raise InputError(f"{name}: no such file" if not path.exists() else f"{name}: not a file")
            try:
                data = path.read_bytes()
            except OSError as e:
                raise InputError(f"{name}: cannot read it ({e.strerror or e})") from None
        elif isinstance(image, (bytes, bytearray, memoryview)):
            data, name = bytes(image), what
        else:
            raise InputError(f"{what}: expected a file path, bytes or a PIL image, got {type(image).__name__}")
        if not data:
            raise InputError(f"{name}: empty (0 bytes), expected an image file (PNG, JPEG, WebP, ...)")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", Image.DecompressionBombWarning)
                pil = Image.open(io.BytesIO(data))
        except (Image.DecompressionBombWarning, Image.DecompressionBombError):
            raise InputError(f"{name}: declares too many pixels (at most {max_pixels} allowed)") from None
        except Exception:  # PIL raises UnidentifiedImageError, and sometimes others, for non-images
            raise InputError(f"{name}: not an image PIL can decode (expected PNG, JPEG, WebP, GIF, ...)") from None
    width, height = pil.size
    if width <= 0 or height <= 0:
        raise InputError(f"{name}: has size {width}x{height}, expected at least 1x1 pixels")
    if width * height > max_pixels:
        raise InputError(f"{name}: is {width}x{height} = {width * height} pixels, more than the {max_pixels} allowed")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            pil.load()  # decode now: a truncated file fails here, not halfway through a forward
            return _to_rgb(pil)
    except (Image.DecompressionBombWarning, Image.DecompressionBombError):
        raise InputError(f"{name}: declares too many pixels (at most {max_pixels} allowed)") from None
    except (OSError, ValueError, SyntaxError, EOFError) as e:
        raise InputError(f"{name}: corrupt or truncated image data ({e})") from None


def _to_rgb(pil):
    """RGB, with any transparency composited onto a white background (transformers' convert_to_rgb)."""
    Image = _pil()
    if "A" in pil.getbands() or pil.info.get("transparency") is not None:
        rgba = pil.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return pil.convert("RGB")


def target_size(height: int, width: int, settings: ImageProcessing) -> tuple[int, int]:
    """The resized (height, width): the largest aspect-preserving size within the patch budget whose
    sides are multiples of patch_size · pooling_kernel_size (a very thin image keeps one such row/column)."""
    patch, pool = settings.patch_size, settings.pooling_kernel_size
    max_patches = settings.max_patches
    budget_px = max_patches * patch**2
    factor = math.sqrt(budget_px / (height * width))
    side = pool * patch
    h = int(math.floor(factor * height / side)) * side
    w = int(math.floor(factor * width / side)) * side
    longest = (max_patches // pool**2) * side
    if h == 0 and w == 0:
        raise InputError(f"image of {width}x{height} pixels cannot be resized to a whole number of "
                         f"{side}x{side} tiles")
    if h == 0:
        h, w = side, min(int(math.floor(width / height)) * side, longest)
    elif w == 0:
        h, w = min(int(math.floor(height / width)) * side, longest), side
    if h * w > budget_px:  # cannot happen for the sizes above; kept as transformers' own guard
        raise InputError(f"image of {width}x{height} pixels would need {h}x{w}, over {max_patches} patches")
    return h, w


def num_soft_tokens(height: int, width: int, settings: ImageProcessing) -> int:
    """How many image tokens an image of this size becomes (without decoding it)."""
    h, w = target_size(height, width, settings)
    return (h // settings.patch_size) * (w // settings.patch_size) // settings.pooling_kernel_size**2


def prepare_image(image, settings: ImageProcessing, what: str = "image",
                  max_pixels: int = MAX_IMAGE_PIXELS) -> PreparedImage:
    """Decode, resize, rescale and patch one image."""
    Image = _pil()
    rgb = open_image(image, what, max_pixels)
    width, height = rgb.size
    h, w = target_size(height, width, settings)
    if (h, w) != (height, width):
        rgb = rgb.resize((w, h), resample=Image.BICUBIC)
    pixels = np.asarray(rgb, dtype=np.uint8)  # [h, w, 3]
    digest = hashlib.sha256(f"{w}x{h}:".encode() + pixels.tobytes()).hexdigest()
    scaled = (pixels.astype(np.float64) * settings.rescale_factor).astype(np.float32)
    p = settings.patch_size
    rows, cols = h // p, w // p
    # [rows, p, cols, p, 3] -> [rows, cols, p, p, 3]: patch-major, then (row, column, channel) inside a patch.
    patches = scaled.reshape(rows, p, cols, p, 3).transpose(0, 2, 1, 3, 4).reshape(rows * cols, p * p * 3)
    ys, xs = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    positions = np.stack([xs, ys], axis=-1).reshape(rows * cols, 2)
    return PreparedImage(
        pixel_values=torch.from_numpy(np.ascontiguousarray(patches)),
        positions=torch.from_numpy(positions.astype(np.int64)),
        grid=(rows, cols),
        num_soft_tokens=rows * cols // settings.pooling_kernel_size**2,
        digest=digest,
    )


def prepare_images(images, settings: ImageProcessing, max_images: int | None = None,
                   max_pixels: int = MAX_IMAGE_PIXELS) -> list[PreparedImage]:
    """prepare_image over a list; any bad image fails the whole list (naming which one)."""
    images = list(images)
    if max_images is not None and len(images) > max_images:
        raise InputError(f"{len(images)} images given, at most {max_images} allowed")
    many = len(images) > 1
    return [prepare_image(img, settings, what=f"image {i + 1}" if many else "image", max_pixels=max_pixels)
            for i, img in enumerate(images)]


def pad_batch(images: list[PreparedImage], settings: ImageProcessing) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' batched layout: pixel_values [B, max_patches, D] zero-padded and positions
    [B, max_patches, 2] padded with (-1, -1)."""
    n, dim = settings.max_patches, 3 * settings.patch_size**2
    pixels = torch.zeros(len(images), n, dim, dtype=torch.float32)
    positions = torch.full((len(images), n, 2), -1, dtype=torch.int64)
    for i, img in enumerate(images):
        pixels[i, : len(img.pixel_values)] = img.pixel_values
        positions[i, : len(img.positions)] = img.positions
    return pixels, positions
