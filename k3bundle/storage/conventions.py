"""Tensor conventions: the names of a bundle's quantized device tensors and what their values mean.

A layout declares one (``convention:``), and every device tensor of the bundle follows it exactly,
so that a loader of that convention reads the bytes by their names and gets the right values:

- ``compressed-tensors`` (the release's own convention): ``weight_packed`` (E2M1 pairs, low
  nibble = even column), ``weight_scale`` (E8M0 per 32 for MXFP4, E4M3 per 16 for NVFP4, F32 for
  FP8), ``weight_global_scale`` = the NVFP4 *quantization* global scale, i.e. **1 / the dequant
  multiplier** (compressed-tensors' ``generate_gparam`` gives 448·6/amax; its ModelOpt converter
  turns ``weight_scale_2`` x into 1/x); ``input_global_scale`` likewise, where activations are
  quantized. Its description file is a ``quantization_config`` document (``config_groups``).
- ``modelopt`` (NVIDIA ModelOpt checkpoints): NVFP4 as ``weight`` (packed E2M1), ``weight_scale``
  (E4M3 per 16), ``weight_scale_2`` = **the dequant multiplier** itself, ``input_scale`` where
  activations are quantized. Its description file is ``hf_quant_config.json``.

Which storage formats a convention can name is each format's own word (``StorageFormat.named_under``:
those its description file describes, and those that do not quantize).

The codecs (``k3bundle.formats``) always work with the dequant multiplier
(x = e2m1 · e4m3 · multiplier, docs/formats.md); a convention converts it to and from what it
stores. k3bundle's formats are weight-only, so no activation scale is written under either.
"""

from __future__ import annotations

from dataclasses import dataclass

from k3bundle.errors import CodecError
from k3bundle.storage.lazy import lazy

torch = lazy("torch")  # the NVFP4 global scale's arithmetic only

COMPRESSED_TENSORS = "compressed-tensors"
MODELOPT = "modelopt"


@dataclass(frozen=True)
class Convention:
    name: str
    file: str  # the quantization description, written beside the device weights
    suffixes: tuple[tuple[str, str], ...]  # device part -> suffix on the weight stem
    reciprocal_global: bool  # the stored NVFP4 global scale is 1 / the dequant multiplier
    semantics: str  # one line, for messages: what the names mean

    def suffix(self, part: str) -> str:
        return dict(self.suffixes)[part]

    def store_global(self, multiplier: torch.Tensor) -> torch.Tensor:
        """The f32 value stored for an NVFP4 dequant multiplier under this convention."""
        m = multiplier.to(torch.float64)
        stored = (1.0 / m if self.reciprocal_global else m).to(torch.float32)
        if not bool(torch.isfinite(stored).all()) or bool((stored == 0).any()):
            raise CodecError(f"{self.name}: the NVFP4 global scale of multiplier {m.tolist()} does not fit f32")
        return stored

    def load_global(self, stored: torch.Tensor) -> torch.Tensor:
        """The dequant multiplier a loader of this convention takes from the stored global scale."""
        s = stored.to(torch.float64)
        return (1.0 / s if self.reciprocal_global else s).to(torch.float32)


CONVENTIONS: dict[str, Convention] = {c.name: c for c in (
    Convention(COMPRESSED_TENSORS, "quantization_config.json",
               (("weight", ".weight"), ("packed", ".weight_packed"), ("scale", ".weight_scale"),
                ("global_scale", ".weight_global_scale")),
               reciprocal_global=True,
               semantics="weight_packed low nibble = even column, weight_global_scale = 1 / dequant multiplier"),
    Convention(MODELOPT, "hf_quant_config.json",
               (("weight", ".weight"), ("packed", ".weight"), ("scale", ".weight_scale"),
                ("global_scale", ".weight_scale_2")),
               reciprocal_global=False,
               semantics="weight low nibble = even column, weight_scale_2 = dequant multiplier"),
)}


def convention(name: str) -> Convention:
    if name not in CONVENTIONS:
        raise CodecError(f"unknown tensor convention {name!r} (known: {', '.join(CONVENTIONS)})")
    return CONVENTIONS[name]
