"""Faults of a bundle's bytes: each edits a copy of a clean bundle in place and returns where
it planted the defect (``Planted``), or None where the layout has no such tensor.

``golden`` is the goldens' intermediates (the most- and least-used experts are read from the
greedy case's routes); ``rng`` is seeded by the job's seed.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np
import torch

from k3bundle.calibrate.bundle_edits import (EXPERT_PARTS, entries, expert_slots, get_slot, index, read_tensor,
                                             set_slot, write_tensor)
from k3bundle.calibrate.planted import Planted


def _used(golden: dict, layer: int, case: str = "greedy") -> tuple[np.ndarray, np.ndarray]:
    return np.unique(golden[f"{case}/layers.{layer}.router_ids"], return_counts=True)


def dt_bias(bundle: Path, golden: dict, rng) -> Planted:
    """KDA dt_bias negated on the last rank (a sign error in one TP shard)."""
    es = entries(bundle, "layers.2.self_attn.dt_bias")
    e = max(es, key=lambda x: x["rank"])
    write_tensor(bundle, e, -read_tensor(bundle, e))
    return Planted(2, "layers.2.mixer_out")


def swap_experts(bundle: Path, golden: dict, rng) -> Planted:
    """The two most-used routed experts of layer 1 exchanged (every part, every rank)."""
    vals, counts = _used(golden, 1)
    a, b = (int(v) for v in vals[np.argsort(-counts)[:2]])
    for part in EXPERT_PARTS:
        sa, sb = expert_slots(bundle, 1, a, part), expert_slots(bundle, 1, b, part)
        for x, y in zip(sa, sb):  # rank-ordered slices of the two experts
            ta, tb = get_slot(bundle, x).clone(), get_slot(bundle, y).clone()
            set_slot(bundle, x, tb)
            set_slot(bundle, y, ta)
    return Planted(1, "layers.1.ffn_out")


def scale_byte(bundle: Path, golden: dict, rng) -> Planted:
    """One scale byte of the most-used expert of layer 4 raised by 8 (E8M0: ×256; E4M3: ×2⁸ᐟ⁸)."""
    vals, counts = _used(golden, 4)
    ex = int(vals[counts.argmax()])
    slot = expert_slots(bundle, 4, ex, "w2.weight_scale")[0]
    t = get_slot(bundle, slot).clone()
    flat = (t if t.dtype == torch.uint8 else t.view(torch.uint8)).view(-1)
    i = int((flat != 0).nonzero()[0, 0])  # a byte that holds a real scale, not swizzle padding
    flat[i] = (int(flat[i]) + 8) % 256
    set_slot(bundle, slot, t)
    return Planted(4, "layers.4.ffn_out")


def transposed_shard(bundle: Path, golden: dict, rng) -> Planted:
    """Layer 1's KDA q_proj shard on rank 0 written transposed (row-/column-major confusion;
    same bytes, so a non-square shard is transposed then read back in its own shape)."""
    e = entries(bundle, "layers.1.self_attn.q_proj.weight", rank=0)[0]
    t = read_tensor(bundle, e)
    write_tensor(bundle, e, t.t().contiguous().reshape(t.shape))
    return Planted(1, "layers.1.mixer_out")


def router_bias(bundle: Path, golden: dict, rng) -> Planted:
    """The least-used expert of layer 2 gets +10 selection bias on every rank: misrouting."""
    vals, counts = _used(golden, 2)
    ex = int(vals[counts.argmin()])
    for e in entries(bundle, "layers.2.block_sparse_moe.gate.e_score_correction_bias"):
        t = read_tensor(bundle, e)
        t[ex] += 10.0
        write_tensor(bundle, e, t)
    return Planted(2, "layers.2.router_ids")


def perturb_layer(scale: float):
    """The fault "every BF16/F32 tensor of layer 5's KDA mixer × (1 + scale·N(0,1))"."""
    def fault(bundle: Path, golden: dict, rng) -> Planted:
        base = rng.randrange(1 << 30)
        for e in index(bundle):
            if ".layers.5.self_attn." in e["key"] and e["dtype"] in ("BF16", "F32"):
                # seeded by the key: a replicated tensor gets the same perturbation on every rank
                gen = torch.Generator().manual_seed(base ^ zlib.crc32(e["key"].encode()))
                t = read_tensor(bundle, e)
                noise = torch.randn(t.shape, generator=gen, dtype=torch.float64)
                write_tensor(bundle, e, (t.double() * (1 + scale * noise)).to(t.dtype))
        return Planted(5, "layers.5.mixer_out")
    fault.__doc__ = f"Every BF16/F32 tensor of layer 5's KDA mixer × (1 + {scale:g}·N(0,1)) on every rank."
    return fault


def nan_weight(bundle: Path, golden: dict, rng) -> Planted:
    """One NaN weight: a single element of layer 3's MLA q_b_proj on rank 0 (drawn by the seed)
    made NaN, as a corrupted write or an overflowed conversion leaves it; nothing crashes."""
    e = entries(bundle, "layers.3.self_attn.q_b_proj.weight", rank=0)[0]
    t = read_tensor(bundle, e)
    t.view(-1)[rng.randrange(t.numel())] = float("nan")
    write_tensor(bundle, e, t)
    return Planted(3, "layers.3.mixer_out")


def router_bias_sign(bundle: Path, golden: dict, rng) -> Planted:
    """Layer 5's router correction bias with its sign flipped on every rank (a converter that
    negates e_score_correction_bias): the selection favours the experts it should hold back."""
    for e in entries(bundle, "layers.5.block_sparse_moe.gate.e_score_correction_bias"):
        write_tensor(bundle, e, -read_tensor(bundle, e))
    return Planted(5, "layers.5.router_ids")
