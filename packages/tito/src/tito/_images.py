"""Images in chat messages: where their bytes come from, and how many tokens each one becomes.

Images travel in the internal (OpenAI-shaped) messages as `image_url` content parts whose URL is a
`data:` URL or a local file (`file:///path` or an absolute path, read on tito's machine); the
Anthropic route turns its `image` blocks into such parts. tito never fetches a remote URL: an agent
that has one downloads it and sends the bytes.

`ImageLayout` is the model's processor, asked only for the number of placeholder tokens an image of a
given size expands to (the chat template writes one placeholder per image). The engine expands the
same placeholders itself when it processes the image bytes; `Engine` compares its expansion with
this one on every request (`_engines.py`).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class LoadedImage:
    """An image's bytes, as received, and what the trajectory records of it."""

    data: bytes
    media_type: str
    width: int
    height: int

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    @property
    def data_url(self) -> str:
        return f"data:{self.media_type};base64,{base64.b64encode(self.data).decode()}"


def image_parts(content: Any) -> list[dict]:
    """The `image_url` parts of a message's content, in order."""
    return [part for part in content if part.get("type") == "image_url"] if isinstance(content, list) else []


def part_url(part: dict) -> str:
    image_url = part.get("image_url")
    url = image_url.get("url") if isinstance(image_url, dict) else image_url
    if not isinstance(url, str):
        raise ValueError('an image_url part needs {"image_url": {"url": "data:... or a file path"}}')
    return url


def load_image(url: str) -> LoadedImage:
    """The image behind a `data:` URL or a local file path; a ValueError says what is wrong with it."""
    if url.startswith("data:"):
        header, _, payload = url.partition(",")
        if not header.endswith(";base64"):
            raise ValueError("an image data URL must be base64: data:image/png;base64,...")
        try:
            data = base64.b64decode(payload, validate=True)
        except binascii.Error as error:
            raise ValueError(f"an image data URL does not hold valid base64 ({error})") from None
    elif url.startswith("file://") or url.startswith("/"):
        path = Path(url.removeprefix("file://"))
        if not path.is_file():
            raise ValueError(f"image file {str(path)!r} does not exist on the tito server")
        data = path.read_bytes()
    else:
        raise ValueError(
            f"image URL {url[:40]!r}...: tito reads data: URLs and local file paths only, never the "
            "network; download the image and send it as a data URL"
        )
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            width, height = image.size
            media_type = Image.MIME.get(image.format or "", "application/octet-stream")
    except UnidentifiedImageError:
        raise ValueError("the image bytes are not an image format PIL can read (PNG, JPEG, ...)") from None
    return LoadedImage(data, media_type, width, height)


class ImageLayout:
    """How many placeholder tokens an image becomes, from the model's own processor.

    `processor`: a transformers multimodal processor (`AutoProcessor`); its tokenizer's `image_token`
    is the placeholder the chat template writes once per image.
    """

    def __init__(self, processor) -> None:
        self.processor = processor
        self.image_token_id: int = processor.image_token_id

    def num_tokens(self, image: LoadedImage) -> int:
        # The processor's own count from the image size (the API vLLM's transformers backend uses).
        counts = self.processor._get_num_multimodal_tokens(image_sizes=[(image.height, image.width)])
        return int(counts["num_image_tokens"][0])
