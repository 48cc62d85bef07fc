"""Trained weights shipped inside the package, for presets that name a ``weights:`` file.

A trained preset (``tiny-trained``) is one fixed model, not a draw: its text tensors were
trained by ``bench/train_tiny.py`` and are stored as the release stores them (BF16, F32 and
MXFP4 packed/scale pairs under the release's names) in one safetensors file, zstd-compressed,
under ``k3bundle/data/``. synth copies them byte for byte; tensors the file does not hold
(the vision tower and projector, which nothing trains yet) are drawn as for any preset.

The file is data: it is parsed by ``safetensors`` (no pickle), its decompressed size is
bounded, and every tensor is checked against the schema's name, shape and dtype before use.
"""

from __future__ import annotations

from importlib import resources

import torch

from k3bundle.errors import SynthError
from k3bundle.io.dtypes import TORCH_TO_SAFETENSORS
from k3bundle.schema import Schema, Section

MAX_BYTES = 256 << 20  # a shipped model is a few MB; refuse anything absurd before allocating


def data_root():
    """``k3bundle/data`` (a Traversable; tests point it elsewhere)."""
    return resources.files("k3bundle").joinpath("data")


def load_trained(relpath: str, schema: Schema) -> dict[str, torch.Tensor]:
    """The text tensors of ``k3bundle/data/<relpath>``, checked against ``schema``."""
    import zstandard
    from safetensors.torch import load

    res = data_root().joinpath(*relpath.split("/"))
    if not res.is_file():
        raise SynthError(f"k3bundle/data/{relpath}: trained weights are missing from this install")
    try:
        raw = zstandard.ZstdDecompressor().decompress(res.read_bytes(), max_output_size=MAX_BYTES)
        tensors = load(raw)
    except Exception as e:  # zstd or safetensors: a damaged file, named
        raise SynthError(f"k3bundle/data/{relpath}: not a zstd-compressed safetensors file ({e})") from None
    want = {s.name: s for s in schema.tensors() if s.role.section is Section.TEXT}
    missing, extra = sorted(set(want) - set(tensors)), sorted(set(tensors) - set(want))
    if missing or extra:
        what = f"missing {missing[0]}" if missing else f"unexpected {extra[0]}"
        raise SynthError(f"k3bundle/data/{relpath}: does not match the preset's text tensors "
                         f"({len(missing)} missing, {len(extra)} unexpected; {what})")
    for name, spec in want.items():
        t = tensors[name]
        if tuple(t.shape) != spec.shape or TORCH_TO_SAFETENSORS.get(t.dtype) != spec.dtype:
            raise SynthError(f"k3bundle/data/{relpath}: {name} is {t.dtype} {tuple(t.shape)}, "
                             f"the schema says {spec.dtype} {spec.shape}")
    return tensors
