"""Numeric formats: pure tensor-in/tensor-out codecs (no I/O).

Modules: ``e2m1`` (FP4 element codes), ``mxfp4`` (OCP MX, E8M0 per 32),
``nvfp4`` (E4M3 per 16 + f32 global), ``fp8`` (E4M3 per channel / 128x128 block),
``scale_swizzle`` (Blackwell 128x4 scale layout).

The storage formats a layout names (``k3bundle.storage``) are built on these codecs.
"""

from k3bundle.formats import e2m1, fp8, mxfp4, nvfp4, scale_swizzle

__all__ = ["e2m1", "fp8", "mxfp4", "nvfp4", "scale_swizzle"]
