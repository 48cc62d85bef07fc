"""Numeric formats: pure tensor-in/tensor-out codecs (no I/O).

Modules: ``e2m1`` (FP4 element codes), ``mxfp4`` (OCP MX, E8M0 per 32),
``nvfp4`` (E4M3 per 16 + f32 global), ``fp8`` (E4M3 per channel / 128x128 block),
``scale_swizzle`` (Blackwell 128x4 scale layout).

``CODECS`` maps a format name to its `Codec`. Signatures differ between formats
(nvfp4 carries a global scale, fp8 returns float8 tensors), so layouts call the
functions with the arguments the module documents.
"""

from dataclasses import dataclass
from types import ModuleType
from typing import Callable

from k3bundle.formats import e2m1, fp8, mxfp4, nvfp4, scale_swizzle


@dataclass(frozen=True)
class Codec:
    """A registered weight format: its module and quantize/dequantize functions."""

    name: str
    module: ModuleType
    quantize: Callable
    dequantize: Callable


CODECS: dict[str, Codec] = {
    "mxfp4": Codec("mxfp4", mxfp4, mxfp4.quantize, mxfp4.dequantize),
    "nvfp4": Codec("nvfp4", nvfp4, nvfp4.quantize, nvfp4.dequantize),
    "fp8-e4m3-channel": Codec("fp8-e4m3-channel", fp8, fp8.quantize_channel, fp8.dequantize_channel),
    "fp8-e4m3-block128": Codec("fp8-e4m3-block128", fp8, fp8.quantize_block, fp8.dequantize_block),
}

__all__ = ["CODECS", "Codec", "e2m1", "fp8", "mxfp4", "nvfp4", "scale_swizzle"]
