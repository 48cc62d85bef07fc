"""Random weights for synthetic checkpoints, scaled so activations stay O(1).

Every logical tensor draws from its own generator, seeded from (seed, tensor name), so a
tensor's values depend on nothing else: shards can be written in any order or in
parallel and the bytes stay the same. Routed experts are drawn in float32 and stored as
real MXFP4 encodings (OCP FLOOR rule, the OCP-recommended conversion).

Scales (spec §3 equations keep every sub-layer input RMS-normalised, so matching each
projection's fan-in keeps outputs near unit RMS):
- projections [out, in...]: N(0, 1/fan_in), fan_in = product of the non-output dims;
- RMSNorm gains: 1 + 0.1 N(0, 1), so a gain applied twice or not at all is visible;
- the roles in ``SPECIAL`` below.
"""

from __future__ import annotations

import hashlib
import math

import torch

from k3bundle.formats import mxfp4
from k3bundle.schema import Format, Schema, TensorSpec

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


def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def _is_gain(spec: TensorSpec) -> bool:
    return len(spec.logical_shape) == 1 and spec.role.role.endswith("norm")


def logical_values(schema: Schema, spec: TensorSpec, seed: int) -> torch.Tensor:
    """The float32 values of one logical tensor (an MXFP4 pair shares one draw)."""
    gen = _generator(seed, spec.stem)
    shape = spec.logical_shape
    kind, std = SPECIAL.get(spec.role.role, (None, None))
    if kind == "a_log":
        heads = schema.dims["H"]
        x = torch.zeros(shape, dtype=torch.float32)
        x[:heads] = torch.log(1 + 15 * torch.rand(heads, generator=gen))
        return x
    if kind == "normal":
        return std * torch.randn(shape, generator=gen)
    if kind == "fan_in":
        return std * torch.randn(shape, generator=gen) / math.sqrt(math.prod(shape[1:]))
    if _is_gain(spec):
        return 1 + 0.1 * torch.randn(shape, generator=gen)
    fan_in = math.prod(shape[1:])
    return torch.randn(shape, generator=gen) / math.sqrt(fan_in)


def stored_form(spec: TensorSpec, values: torch.Tensor) -> dict[str, torch.Tensor]:
    """A logical tensor's float values as the release stores them: {name: tensor}, both halves
    of an MXFP4 pair (OCP FLOOR scale rule), else BF16 or F32 as declared."""
    if spec.role.fmt is Format.MXFP4:
        packed, scales = mxfp4.quantize(values, scale_rule="floor")
        parts = {"packed": packed, "scale": scales}
        return {spec.name: parts[spec.part], spec.pair_name: parts["scale" if spec.part == "packed" else "packed"]}
    return {spec.name: values.float().contiguous() if spec.dtype == "F32" else values.to(torch.bfloat16).contiguous()}


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
