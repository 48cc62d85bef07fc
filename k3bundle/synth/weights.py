"""Random weights for synthetic checkpoints, scaled so activations stay O(1).

Every logical tensor draws from its own stream, keyed by (seed, tensor name), so a tensor's
values depend on nothing else: shards can be written in any order or in parallel and the
bytes stay the same. The stream (``synth/stream.py``) is defined bit for bit on every
platform, and so is everything after it: the draw is scaled in float64 with correctly rounded
operations and rounded once to the stored dtype (F32, BF16), so ``synth --preset P --seed S``
writes the same bytes on every machine. Routed experts are rounded once to float32 and stored
as real MXFP4 encodings (OCP FLOOR rule, the OCP-recommended conversion, defined from float32).

Scales (docs/kimi-k3.md §3 equations keep every sub-layer input RMS-normalised, so matching each
projection's fan-in keeps outputs near unit RMS):
- projections [out, in...]: N(0, 1/fan_in), fan_in = product of the non-output dims;
- RMSNorm gains: 1 + 0.1 N(0, 1), so a gain applied twice or not at all is visible;
- the roles in ``SPECIAL`` below.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np
import torch

from k3bundle.formats import mxfp4
from k3bundle.schema import Format, Schema, TensorSpec
from k3bundle.synth import stream

# role -> (kind, std): draws that the fan-in rule does not cover
SPECIAL = {
    "embed": ("normal", 1.0),  # token embeddings: the residual stream starts at unit RMS
    "kda.dt_bias": ("normal", 0.5),
    "kda.A_log": ("a_log", None),  # log(U[1, 16]) per head, zero padding after the heads
    "moe.router_bias": ("normal", 0.1),  # moves selection sometimes, never the weights (R2/R3)
    "vit.pos_emb": ("normal", 0.1),
    # forget-gate input z (K3) at ~0.1 RMS: with exp(A_log) up to 16 the gate argument stays
    # O(1) and BF16 rounding of z moves the decay by ~1e-3, not ~1e-1, so the synthetic model
    # is as well-conditioned under BF16 as a trained one and BF16 tolerances can be meaningful
    "kda.f_b_proj": ("fan_in", 0.1),
}


class PortableDraw:
    """Synth's draw: the portable stream of (seed, name), in float64 (numpy arrays)."""

    def __init__(self, seed: int, name: str):
        self._stream = stream.Stream(seed, name)

    def normal(self, shape: tuple[int, ...]) -> np.ndarray:
        return self._stream.normal(math.prod(shape)).reshape(shape)

    def uniform(self, n: int) -> np.ndarray:
        return self._stream.uniform(n)

    zeros = staticmethod(np.zeros)
    log = staticmethod(stream.log)


class TorchDraw:
    """The draw synth made before the portable stream: ``torch.Generator`` seeded from
    sha256(seed:name), float32 arithmetic. Its last bits differ between CPU builds; it stays
    because the shipped ``tiny-trained`` was trained from it (``bench/train_tiny.py``)."""

    def __init__(self, seed: int, name: str):
        digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
        self._gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))

    def normal(self, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.randn(shape, generator=self._gen)

    def uniform(self, n: int) -> torch.Tensor:
        return torch.rand(n, generator=self._gen)

    @staticmethod
    def zeros(shape: tuple[int, ...]) -> torch.Tensor:
        return torch.zeros(shape, dtype=torch.float32)

    log = staticmethod(torch.log)


def _is_gain(spec: TensorSpec) -> bool:
    return len(spec.logical_shape) == 1 and spec.role.role.endswith("norm")


def logical_values(schema: Schema, spec: TensorSpec, seed: int, draw=PortableDraw) -> torch.Tensor:
    """The values of one logical tensor (an MXFP4 pair shares one draw): float64 from synth's
    portable draw, float32 from ``TorchDraw``. Every rule below is one correctly rounded
    operation after another in the draw's precision."""
    d = draw(seed, spec.stem)
    shape = spec.logical_shape
    kind, std = SPECIAL.get(spec.role.role, (None, None))
    if kind == "a_log":
        heads = schema.dims["H"]
        x = d.zeros(shape)
        x[:heads] = d.log(1 + 15 * d.uniform(heads))
    elif kind == "normal":
        x = std * d.normal(shape)
    elif kind == "fan_in":
        x = std * d.normal(shape) / math.sqrt(math.prod(shape[1:]))
    elif _is_gain(spec):
        x = 1 + 0.1 * d.normal(shape)
    else:
        x = d.normal(shape) / math.sqrt(math.prod(shape[1:]))
    return torch.from_numpy(x) if isinstance(x, np.ndarray) else x


def round_bf16(values: torch.Tensor) -> torch.Tensor:
    """``values`` rounded once to BF16, to nearest, ties to even. torch rounds float64 through
    float32 (twice: 1 + 2**-8 + 2**-40 becomes 1, not 1 + 2**-7), so float64 is rounded here
    on its bits; float32 and narrower go through torch, which rounds them once. Values must be
    finite and zero or of magnitude at least 2**-126 (BF16's normal range)."""
    if values.dtype != torch.float64:
        return values.to(torch.bfloat16)
    bits = values.contiguous().numpy().view(np.uint64)
    drop = np.uint64(45)  # float64 keeps 52 fraction bits, BF16 7
    r = (bits >> drop) & np.uint64(1)  # the kept last bit: ties go to the even one
    r += np.uint64((1 << 44) - 1)
    r += bits  # a carry out of the fraction steps the exponent, as rounding up should
    r >>= drop
    r <<= drop
    return torch.from_numpy(r.view(np.float64).astype(np.float32)).to(torch.bfloat16)


def stored_form(spec: TensorSpec, values: torch.Tensor) -> dict[str, torch.Tensor]:
    """A logical tensor's float values as the release stores them: {name: tensor}, both halves
    of an MXFP4 pair (OCP FLOOR scale rule, from the values rounded once to float32), else BF16
    or F32 as declared, each rounded once."""
    if spec.role.fmt is Format.MXFP4:
        packed, scales = mxfp4.quantize(values.float(), scale_rule="floor")
        parts = {"packed": packed, "scale": scales}
        return {spec.name: parts[spec.part], spec.pair_name: parts["scale" if spec.part == "packed" else "packed"]}
    return {spec.name: values.float().contiguous() if spec.dtype == "F32" else round_bf16(values).contiguous()}


def make_tensors(schema: Schema, specs: list[TensorSpec], seed: int,
                 fixed: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Stored tensors for ``specs``: BF16/F32 as declared, MXFP4 as (packed, scale) pairs;
    ``fixed`` (a trained preset's tensors, stored form) replaces the draw where it has a name."""
    out: dict[str, torch.Tensor] = {}
    for spec in specs:
        if spec.name in out:
            continue
        if fixed is not None and spec.name in fixed:
            out[spec.name] = fixed[spec.name]
            continue
        out.update(stored_form(spec, logical_values(schema, spec, seed)))
    for spec in specs:  # every tensor must have its declared stored shape and dtype
        t = out[spec.name]
        assert tuple(t.shape) == spec.shape, (spec.name, tuple(t.shape), spec.shape)
    return out
