"""One device tensor of a bundle read, or rewritten in place (same dtype and size): how the fault
catalogue corrupts a copy of a bundle. Index entries are ``weights.index.json``'s."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from k3bundle.file_names import WEIGHTS_INDEX
from k3bundle.io import SafetensorsFile

#: every part of a routed expert a layout may store (MXFP4 codes and scales, NVFP4's global scale)
EXPERT_PARTS = ("w1.weight_packed", "w2.weight_packed", "w3.weight_packed",
                "w1.weight_scale", "w2.weight_scale", "w3.weight_scale",
                "w1.weight_global_scale", "w2.weight_global_scale", "w3.weight_global_scale")


def index(bundle: Path) -> list[dict]:
    return json.loads((Path(bundle) / WEIGHTS_INDEX).read_text())["tensors"]


def entries(bundle: Path, suffix: str, rank: int | None = None) -> list[dict]:
    """The index entries whose key ends in ``suffix`` (on ``rank``, or every rank)."""
    return [e for e in index(bundle) if e["key"].endswith(suffix) and (rank is None or e["rank"] == rank)]


def read_tensor(bundle: Path, e: dict) -> torch.Tensor:
    """One device tensor of a bundle, by its index entry."""
    with SafetensorsFile(Path(bundle) / e["file"]) as f:
        return f.get(e["key"]).clone()


def write_tensor(bundle: Path, e: dict, new: torch.Tensor) -> None:
    """Rewrite one device tensor in place, same dtype and size: a corrupted bundle."""
    with SafetensorsFile(Path(bundle) / e["file"]) as f:
        info, old = f.info(e["key"]), f.get(e["key"])
    new = new.contiguous()
    if new.dtype != old.dtype or new.numel() != old.numel():
        raise ValueError(f"{e['key']}: a rewrite must keep dtype {old.dtype} and {old.numel()} elements")
    raw = (new if new.dtype == torch.uint8 else new.view(torch.uint8)).numpy().tobytes()
    with open(Path(bundle) / e["file"], "r+b") as fh:
        fh.seek(info.abs_begin)
        fh.write(raw)


def expert_slots(bundle: Path, layer: int, e: int, part: str) -> list[tuple[dict, int | None]]:
    """Where routed expert ``e``'s ``part`` (e.g. "w2.weight_scale") lives: (entry, stack row) per rank."""
    out = []
    for x in index(bundle):
        k = x["key"]
        if f".layers.{layer}.block_sparse_moe.experts.{e}.{part}" in k:
            out.append((x, None))
        elif k.endswith(f".layers.{layer}.block_sparse_moe.experts.{part}"):
            a, b = x["source"]["experts"]
            if a <= e < b:
                out.append((x, e - a))
    return out


def get_slot(bundle: Path, slot) -> torch.Tensor:
    t = read_tensor(bundle, slot[0])
    return t if slot[1] is None else t[slot[1]]


def set_slot(bundle: Path, slot, value: torch.Tensor) -> None:
    if slot[1] is None:
        write_tensor(bundle, slot[0], value)
    else:
        t = read_tensor(bundle, slot[0])
        t[slot[1]] = value
        write_tensor(bundle, slot[0], t)
