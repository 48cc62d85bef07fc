"""Synthetic images for golden cases, from a spec in the case file (docs/golden.md, the image case).

A case declares its image as data, e.g. ``image: {kind: checkerboard, width: 56, height: 56}``;
:func:`parse_spec` checks it strictly (an unknown kind or field is an error naming the case file)
and :func:`make_image` draws it: the same spec gives the same uint8 [H, W, 3] array everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from k3bundle.media.errors import MediaError
from k3bundle.media.geometry import PATCH

#: The kinds of synthetic image, each with its optional fields and their defaults.
KINDS: dict[str, dict[str, int]] = {
    # black and white squares, white at the top left; 14-pixel squares = one patch each
    "checkerboard": {"square": PATCH},
}
REQUIRED = ("kind", "width", "height")
MAX_SIDE = 16384  # a synthetic image's largest side, in pixels


@dataclass(frozen=True)
class ImageSpec:
    kind: str
    width: int
    height: int
    square: int = PATCH


def _positive(spec: dict, key: str, source: str, hi: int) -> int:
    v = spec[key]
    if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= hi:
        raise MediaError(f"{source}: image.{key} must be an integer from 1 to {hi:,}, got {v!r}")
    return v


def parse_spec(spec: object, source: str) -> ImageSpec:
    """A case file's ``image:`` mapping -> :class:`ImageSpec`; ``source`` is the case file."""
    if not isinstance(spec, dict):
        raise MediaError(f"{source}: image must be a mapping like {{kind: checkerboard, width: 56, "
                         f"height: 56}}, got {spec!r}")
    missing = [k for k in REQUIRED if k not in spec]
    if missing:
        raise MediaError(f"{source}: image.{missing[0]} is missing (required: {', '.join(REQUIRED)})")
    kind = spec["kind"]
    if kind not in KINDS:
        raise MediaError(f"{source}: image.kind {kind!r} is not one of {', '.join(sorted(KINDS))}")
    known = set(REQUIRED) | set(KINDS[kind])
    unknown = sorted(set(spec) - known, key=str)
    if unknown:
        raise MediaError(f"{source}: unknown field image.{unknown[0]} for kind {kind} "
                         f"(known: {', '.join(sorted(known))})")
    width, height = _positive(spec, "width", source, MAX_SIDE), _positive(spec, "height", source, MAX_SIDE)
    options = {k: _positive(spec, k, source, MAX_SIDE) for k in KINDS[kind] if k in spec}
    return ImageSpec(kind, width, height, **options)


def make_image(spec: ImageSpec) -> np.ndarray:
    """The image of ``spec``: uint8 [height, width, 3]."""
    rows = np.arange(spec.height)[:, None] // spec.square
    cols = np.arange(spec.width)[None, :] // spec.square
    white = (rows + cols) % 2 == 0
    return np.where(white[..., None], 255, 0).astype(np.uint8).repeat(3, axis=2)
