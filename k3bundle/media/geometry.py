"""Where an image lands on MoonViT's patch grid: the resize, pad and token arithmetic (docs/vision.md).

Pure integer and float arithmetic on the image's size, no pixels (docs/kimi-k3.md §3.9, V0). The
numbers are the released processor's (``preprocessor_config.json``: patch 14, merge 2×2,
``in_patch_limit`` 65,536, ``patch_limit_on_one_side`` 512); the rounding follows it too: the
patch budget counts whole patches of the *original* size (at least one per side), the scaled
size is truncated, never rounded, and the image is never enlarged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from k3bundle.media.errors import MediaError

PATCH = 14  # vision_config.patch_size: one patch is 14×14 pixels
MERGE = 2  # vision_config.merge_kernel_size: 2×2 patches become one LM token (V4)
IN_PATCH_LIMIT = 65536  # the patch budget of one image, counted on the original size
SIDE_PATCH_LIMIT = 512  # at most 512 patches along either side
UNIT = PATCH * MERGE  # 28: the padded image is a whole number of merged 2×2 patch blocks


@dataclass(frozen=True)
class ResizePlan:
    """One image's geometry: original, resized (before padding) and padded sizes, in pixels."""

    width: int
    height: int
    new_width: int
    new_height: int
    padded_width: int
    padded_height: int

    @property
    def grid_thw(self) -> tuple[int, int, int]:
        """(frames, patch rows, patch columns) of the padded image: MoonViT's ``grid_thws`` row."""
        return (1, self.padded_height // PATCH, self.padded_width // PATCH)

    @property
    def num_patches(self) -> int:
        """Patches the vision tower sees: rows × columns."""
        return (self.padded_height // PATCH) * (self.padded_width // PATCH)

    @property
    def num_tokens(self) -> int:
        """``<|media_pad|>`` positions in the prompt: (H/28)·(W/28), one per merged 2×2 block."""
        return (self.padded_height // UNIT) * (self.padded_width // UNIT)


def _round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit


def plan_resize(width: int, height: int) -> ResizePlan:
    """The released processor's geometry for a ``width`` × ``height`` image (V0)."""
    for name, v in (("width", width), ("height", height)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise MediaError(f"image {name} must be a positive integer, got {v!r}")
    whole = max(1, width // PATCH) * max(1, height // PATCH)  # whole patches of the original
    side = SIDE_PATCH_LIMIT * PATCH  # 7168 pixels
    scale = min(1.0, math.sqrt(IN_PATCH_LIMIT / whole), side / width, side / height)
    new_w = min(max(1, int(width * scale)), side)  # truncated, at least 1, at most 7168
    new_h = min(max(1, int(height * scale)), side)
    return ResizePlan(width, height, new_w, new_h, _round_up(new_w, UNIT), _round_up(new_h, UNIT))


def media_tokens(width: int, height: int) -> int:
    """How many ``<|media_pad|>`` tokens an image of this original size takes in the prompt."""
    return plan_resize(width, height).num_tokens
