"""Numeric formats: pure tensor-in/tensor-out codecs (no I/O).

Modules: ``e2m1`` (FP4 element codes), ``mxfp4`` (OCP MX, E8M0 per 32),
``nvfp4`` (E4M3 per 16 + f32 global), ``fp8`` (E4M3 per channel / 128x128 block),
``scale_swizzle`` (Blackwell 128x4 scale layout).

The storage formats a layout names (``k3bundle.storage``) are built on these codecs.

Their block geometry is in ``geometry`` as plain numbers, importable without torch; the codec
modules load on first use (PEP 562), so importing ``geometry`` loads nothing else.
"""

import importlib

__all__ = ["e2m1", "fp8", "geometry", "mxfp4", "nvfp4", "scale_swizzle"]


def __getattr__(name: str):
    if name in __all__:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
