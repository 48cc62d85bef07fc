"""Image input for Kimi K3's vision path: decoding, the released preprocessing, synthetic images.

``geometry`` (sizes and media-token counts, no pixels), ``image`` (Pillow decode, bicubic resize,
pad, normalise, patchify: docs/vision.md), ``synthetic`` (golden cases' generated images).
"""

from k3bundle.media.errors import MediaError
from k3bundle.media.geometry import PATCH, ResizePlan, media_tokens, plan_resize

__all__ = ["PATCH", "MediaError", "ResizePlan", "media_tokens", "plan_resize"]
