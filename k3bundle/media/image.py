"""Decode an image and turn it into MoonViT's input: patches [N, 3, 14, 14] and grid (1, h, w).

docs/kimi-k3.md §3.9 (V0); the choices are in docs/vision.md. The steps, each its own function:

1. decode with Pillow, from a regular file only (a FIFO would hang the read);
2. resize to :func:`geometry.plan_resize`'s size with Pillow's BICUBIC, in the image's own mode,
   as the released processor does (so a palette image is resized by Pillow's nearest rule);
3. make it RGB: an image with alpha is composited on the release's chessboard (8-pixel squares,
   white 255 top-left, grey 180), anything else is converted;
4. pad right and bottom with zeros to a multiple of 28 (before normalising, so padding is -1);
5. normalise x/255 then (x - 0.5)/0.5, in float32;
6. cut into 14×14 patches in row-major order: patch k is row k // w, column k % w.
"""

from __future__ import annotations

import io
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from k3bundle.io.files import open_regular
from k3bundle.media.errors import MediaError
from k3bundle.media.geometry import PATCH, ResizePlan, plan_resize

# The released processor's normalisation (preprocessor_config.json image_mean / image_std).
MEAN = 0.5
STD = 0.5
# Its background for transparent pixels (transparent_bg_config), composited after the resize.
CHESS_SQUARE = 8
CHESS_WHITE = 255
CHESS_GREY = 180


@dataclass(frozen=True)
class ImageInput:
    """One preprocessed image: what the vision tower takes, and what the prompt needs."""

    patches: torch.Tensor  # float32 [N, 3, 14, 14], row-major over the patch grid
    plan: ResizePlan

    @property
    def grid_thw(self) -> tuple[int, int, int]:
        return self.plan.grid_thw

    @property
    def size(self) -> tuple[int, int]:
        """The original (width, height): the media block's ``image {W}x{H}``."""
        return (self.plan.width, self.plan.height)

    @property
    def num_tokens(self) -> int:
        return self.plan.num_tokens


def open_image(path: str | os.PathLike[str]) -> Image.Image:
    """Decode ``path`` completely (a truncated file fails here, not later); one-line errors."""
    p = Path(path)
    try:
        with os.fdopen(open_regular(p), "rb") as f:
            data = f.read()
    except OSError as e:
        raise MediaError(f"{p}: cannot read the image: {e.strerror or e}") from None
    if not data:
        raise MediaError(f"{p}: empty file, not an image")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            image.load()
    except UnidentifiedImageError:
        raise MediaError(f"{p}: not an image Pillow can decode") from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise MediaError(f"{p}: too many pixels to decode safely ({e})") from None
    except (OSError, ValueError, SyntaxError) as e:  # truncated or corrupt data
        raise MediaError(f"{p}: the image data is corrupt or truncated ({e})") from None
    return image


def chessboard(height: int, width: int) -> np.ndarray:
    """The release's background for transparency: uint8 [H, W, 3], white square at the top left."""
    rows = np.arange(height)[:, None] // CHESS_SQUARE
    cols = np.arange(width)[None, :] // CHESS_SQUARE
    grey = (rows + cols) % 2 == 1
    return np.where(grey[..., None], CHESS_GREY, CHESS_WHITE).astype(np.uint8).repeat(3, axis=2)


def _has_alpha(image: Image.Image) -> bool:
    return "A" in image.getbands() or "transparency" in image.info


def to_rgb(image: Image.Image) -> np.ndarray:
    """uint8 [H, W, 3]: alpha composited on :func:`chessboard`, truncated to an integer as the
    release does; any other mode converted by Pillow."""
    if image.mode == "RGB":
        return np.asarray(image)
    if not _has_alpha(image):
        return np.asarray(image.convert("RGB"))
    rgba = np.asarray(image.convert("RGBA")).astype(np.float32)
    alpha = rgba[..., 3:4] / 255.0
    mixed = alpha * rgba[..., :3] + (1.0 - alpha) * chessboard(*rgba.shape[:2]).astype(np.float32)
    return mixed.astype(np.uint8)


def resize(image: Image.Image, width: int, height: int) -> Image.Image:
    """Pillow's BICUBIC (a = -0.5, widened by the scale when shrinking), in the image's own mode."""
    return image.resize((width, height), resample=Image.Resampling.BICUBIC)


def pad(rgb: np.ndarray, padded_height: int, padded_width: int) -> np.ndarray:
    """Zeros on the right and at the bottom, up to the padded size."""
    h, w, _ = rgb.shape
    return np.pad(rgb, ((0, padded_height - h), (0, padded_width - w), (0, 0)))


def normalize(rgb: np.ndarray) -> np.ndarray:
    """float32 (x/255 - mean)/std with the release's mean = std = 0.5: [0, 255] -> [-1, 1]."""
    return (rgb.astype(np.float32) / np.float32(255.0) - np.float32(MEAN)) / np.float32(STD)


def patchify(pixels: np.ndarray) -> torch.Tensor:
    """[H, W, 3] -> [H/14 · W/14, 3, 14, 14], patches in row-major order of the grid."""
    h, w, c = pixels.shape
    grid = pixels.reshape(h // PATCH, PATCH, w // PATCH, PATCH, c)
    return torch.from_numpy(np.ascontiguousarray(grid.transpose(0, 2, 4, 1, 3).reshape(-1, c, PATCH, PATCH)))


def preprocess_image(image: Image.Image, name: str = "image") -> ImageInput:
    """A decoded Pillow image -> :class:`ImageInput`; ``name`` labels errors (the file)."""
    plan = plan_resize(*image.size)
    try:
        rgb = to_rgb(resize(image, plan.new_width, plan.new_height))
    except (OSError, ValueError) as e:
        raise MediaError(f"{name}: mode {image.mode} cannot be made RGB ({e})") from None
    pixels = normalize(pad(rgb, plan.padded_height, plan.padded_width))
    return ImageInput(patchify(pixels), plan)


def preprocess_array(rgb: np.ndarray, name: str = "image") -> ImageInput:
    """A uint8 [H, W, 3] array (e.g. a synthetic image) -> :class:`ImageInput`."""
    if not (isinstance(rgb, np.ndarray) and rgb.dtype == np.uint8 and rgb.ndim == 3 and rgb.shape[2] == 3):
        raise MediaError(f"{name}: expected a uint8 [H, W, 3] array, got {getattr(rgb, 'dtype', type(rgb))} "
                         f"{getattr(rgb, 'shape', '')}")
    return preprocess_image(Image.fromarray(rgb), name)


def preprocess_file(path: str | os.PathLike[str]) -> ImageInput:
    """Decode and preprocess one image file."""
    return preprocess_image(open_image(path), str(path))
