"""Values as an engine reads them: every quantized device tensor, read through the bundle's declared
convention, against the source tensor it claims to hold.

Re-deriving a bundle with the converter proves the converter is deterministic, not that it is
right: a writer that stores a scale under a name whose convention means something else (an NVFP4
``weight_global_scale`` holding the dequant multiplier instead of its reciprocal, scales left
un-swizzled, nibbles swapped) re-derives to the same bytes. This check reads the device tensors
the way a loader of the declared convention does (``BundleWeights``: the convention's names and
scale meaning, the layout's scale layout) and compares the values with the source's, decoded from
the release's own MXFP4 / BF16 storage. Exact where the format is lossless, except the 32-blocks
the manifest lists as re-quantized (NVFP4 from MXFP4), which may lose up to their own largest
magnitude (they lie 2^17 or more below the tensor's largest block); a lossy format's values
within its own ``value_bound`` (FP8 E4M3, MXFP4 from BF16: docs/bundle-format.md "Conventions").
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from k3bundle.bundle.weights import BundleWeights, read_format
from k3bundle.formats import mxfp4
from k3bundle.schema import ROLE_BY_NAME, Format
from k3bundle.schema.roles import Scope
from k3bundle.checkpoint import SourceCheckpoint
from k3bundle.storage import CONVENTIONS, COPY
from k3bundle.storage.arrays import block_amax


def _recoded(index: dict) -> list[tuple[str, int | None]]:
    """(role, layer) of every role with a quantized or re-coded device tensor."""
    seen = sorted({(e["role"], -1 if e["layer"] is None else e["layer"]) for e in index["tensors"]
                   if e["transform"] != COPY})
    return [(role, None if layer == -1 else layer) for role, layer in seen]


def _instances(index: dict, experts: int) -> Iterator[tuple[str, int | None, int | None]]:
    """(role, layer, expert) of every role instance with a quantized or re-coded device tensor."""
    for role, lay in _recoded(index):
        if ROLE_BY_NAME[role].scope is Scope.EXPERT:
            for x in range(experts):
                yield role, lay, x
        else:
            yield role, lay, None


def _source_value(src: SourceCheckpoint, role: str, layer: int | None, expert: int | None) -> torch.Tensor:
    r = ROLE_BY_NAME[role]
    if r.fmt is Format.MXFP4:
        packed = src.get(src.schema.name(role, layer, expert, part="packed"))
        scale = src.get(src.schema.name(role, layer, expert, part="scale"))
        return mxfp4.dequantize(packed, scale, torch.float32)
    return src.get(src.schema.name(role, layer, expert)).to(torch.float32)


def _allowed(entry: dict, convention: str, want: torch.Tensor, requant: torch.Tensor | None) -> torch.Tensor:
    """Per-element allowed |error| of a device value decoding to ``want``'s source value."""
    fmt = read_format(entry, convention)
    if not fmt.lossless:
        return fmt.value_bound(want)
    allowed = torch.zeros_like(want)
    if requant is not None:
        allowed = torch.where(requant, block_amax(want, mxfp4.BLOCK), allowed)
    return allowed


def _requantized_mask(requantized: dict[str, list], key: str, shape: tuple[int, int]) -> torch.Tensor | None:
    blocks = requantized.get(key)
    if not blocks:
        return None
    mask = torch.zeros(shape[0], shape[1] // mxfp4.BLOCK, dtype=torch.bool)
    for r, b in blocks:
        mask[r, b] = True
    return mask.repeat_interleave(mxfp4.BLOCK, dim=1)


def check_values(bundle: Path, src: SourceCheckpoint, index: dict, manifest: dict,
                 fail) -> tuple[int, int]:
    """Compare every re-coded slice with the source; ``fail(message)`` for each that differs.

    Returns (role instances, rank slices) checked.
    """
    bw = BundleWeights(bundle, dtype="float32")
    conv = CONVENTIONS[bw.convention]
    requantized = {q["source_key"]: q["blocks"] for q in manifest.get("nvfp4_requantized", [])}
    instances = slices = 0
    threads = torch.get_num_threads()
    stacked: set[tuple[str, int | None]] = set()
    try:
        for role, layer in _recoded(index):  # routed experts stored stacked: a whole rank's stack at once
            if ROLE_BY_NAME[role].scope is Scope.EXPERT:  # (large tensors: torch's intra-op threads help)
                done = _check_expert_stacks(bw, src, conv, requantized, role, layer, fail)
                if done is not None:
                    stacked.add((role, layer))
                    instances, slices = instances + done[0], slices + done[1]
        torch.set_num_threads(1)  # the rest is many small tensors: intra-op threads only contend
        for role, layer, expert in _instances(index, bw.config.text.num_experts):
            if (role, layer) in stacked:
                continue
            got = bw.slices(role, layer, expert)
            if not got:
                continue
            full = _source_value(src, role, layer, expert)
            part = "packed" if ROLE_BY_NAME[role].fmt is Format.MXFP4 else "weight"
            key = src.schema.name(role, layer, expert, part=part)
            mask = _requantized_mask(requantized, key, tuple(full.shape)) if full.ndim == 2 else None
            instances += 1
            for entry, value in got:
                slices += 1
                s = entry["source"]
                rows = slice(*s["rows"])
                cols = slice(*s["cols"]) if s.get("cols") is not None and full.ndim == 2 else slice(None)
                want = full[rows, cols] if full.ndim == 2 else full[rows]
                req = mask[rows, cols] if mask is not None else None
                err = (value.to(torch.float32) - want).abs()
                bad = ~(err <= _allowed(entry, bw.convention, want, req))  # NaN error counts as bad
                if bool(bad.any()):
                    at = [int(i) for i in bad.nonzero()[0]]
                    where = f"rank {entry['rank']} {entry['key']}" + ("" if expert is None or "experts" not in s
                                                                       else f" expert {expert}")
                    fail(f"{where}: read through the declared {conv.name} convention ({entry['storage']}, "
                         f"{conv.semantics}) it is not the source {key}: "
                         f"{int(bad.sum())} of {bad.numel()} values off, e.g. {float(value[tuple(at)]):.6g} "
                         f"for {float(want[tuple(at)]):.6g} at {at}")
    finally:
        torch.set_num_threads(threads)
        bw.close()
    return instances, slices


def _check_expert_stacks(bw: BundleWeights, src: SourceCheckpoint, conv, requantized: dict[str, list],
                         role: str, layer: int, fail) -> tuple[int, int] | None:
    """``check_values`` for one routed-expert role of one layer, every rank's stacked experts
    decoded in one pass (the same comparison, element for element, as the one-expert path);
    None when the layout does not stack them or their format is lossy (its bound may span a tensor)."""
    stacks = bw.expert_stacks(role, layer)
    if not stacks or any(not read_format(entry, bw.convention).lossless for entry, _, _ in stacks):
        return None
    n = bw.config.text.num_experts
    name = src.schema.name
    keys = [name(role, layer, e, part="packed") for e in range(n)]  # each name once: the schema's rule
    packed = src.get_stack(keys)
    scale = src.get_stack([name(role, layer, e, part="scale") for e in range(n)])
    full = mxfp4.dequantize(packed, scale, torch.float32)  # [experts, rows, cols]
    slices = 0
    for entry, (a, b), value in stacks:
        s = entry["source"]
        rows = slice(*s["rows"])
        cols = slice(*s["cols"]) if s.get("cols") is not None else slice(None)
        want = full[a:b, rows, cols]
        allowed = torch.zeros_like(want)
        for e in range(a, b):  # re-quantized NVFP4 blocks (rare): their own bound, as one by one
            mask = _requantized_mask(requantized, keys[e], tuple(full.shape[1:])) if requantized else None
            if mask is not None:
                allowed[e - a] = _allowed(entry, bw.convention, want[e - a], mask[rows, cols])
        bad = ~((value.to(torch.float32) - want).abs() <= allowed)
        slices += b - a
        if bool(bad.any()):
            for i in bad.reshape(b - a, -1).any(-1).nonzero().flatten().tolist():
                at = [int(j) for j in bad[i].nonzero()[0]]
                key = keys[a + i]
                fail(f"rank {entry['rank']} {entry['key']} expert {a + i}: read through the declared {conv.name} "
                     f"convention ({entry['storage']}, {conv.semantics}) it is not the source {key}: "
                     f"{int(bad[i].sum())} of {bad[i].numel()} values off, e.g. {float(value[i][tuple(at)]):.6g} "
                     f"for {float(want[i][tuple(at)]):.6g} at {at}")
    return n, slices


__all__ = ["check_values"]
