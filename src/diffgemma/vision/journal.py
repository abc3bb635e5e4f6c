"""Images in the op-log: a 'generate' op whose prompt key holds images gets an "images" field
{prompt key (as text): sha256 of the image's bytes}, and the bytes go to `<log>.images/<sha256>`, written
once per distinct image. Replay reads them back and decodes them again, so it re-executes the images.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from ..errors import InputError


def image_dir(log_path) -> Path:
    log_path = Path(log_path)
    return log_path.with_name(log_path.name + ".images")


def save_images(log_path, prompt: list[int], images: dict) -> dict[str, str]:
    """Write the bytes of each image `prompt` holds next to the log -> the op's "images" field."""
    out = {}
    folder = image_dir(log_path)
    for key in dict.fromkeys(t for t in prompt if t < 0):
        if key not in images:
            raise InputError(f"prompt key {key} names no image of this prompt")
        data = images[key].data
        sha = hashlib.sha256(data).hexdigest()
        path = folder / sha
        if not path.exists():
            folder.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{sha}.{os.getpid()}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, path)  # whole or absent, never half
        out[str(key)] = sha
    return out


def load_images(log_path, field, model, where: str) -> dict:
    """The op's "images" field -> {prompt key: PromptImage}, decoded again from the side files."""
    from .prompt import prepare_one, vision_for

    if not isinstance(field, dict):
        raise InputError(f"{where}: 'images' must be an object of prompt key -> sha256")
    vision = vision_for(model)
    out = {}
    for key, sha in field.items():
        path = image_dir(log_path) / str(sha)
        if not path.is_file():
            raise InputError(f"{where}: image {sha} is missing (expected the file {path})")
        img = prepare_one(path.read_bytes(), vision, f"{where}: image {sha}")
        if str(img.key) != str(key):
            raise InputError(f"{where}: image {sha} decodes to key {img.key}, the log says {key} "
                             f"(another image processor setting?)")
        out[img.key] = img
    return out
