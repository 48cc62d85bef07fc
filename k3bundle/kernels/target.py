"""What a conformance run needs from a target: per-rank dimensions, the op list, the device's card."""

from __future__ import annotations

from pathlib import Path

import torch

from k3bundle.bundle.graph import graph_manifest
from k3bundle.checklist.kernels import _dims
from k3bundle.config import K3Config, load_config, release_config_path
from k3bundle.data_dirs import data_dirs
from k3bundle.io.strict_yaml import read_yaml
from k3bundle.layouts import load_layout
from k3bundle.plan import make_plan


def target_dims(target: str, config: str | Path | None = None) -> tuple[dict, list[str], str]:
    """(per-rank dims, the target's custom_ops in order, the layout's name) for ``target``."""
    layout = load_layout(target)
    cfg: K3Config = load_config(Path(config) if config is not None else release_config_path())
    plan = make_plan(cfg, layout)
    t = cfg.text
    dims = {**_dims(plan), "scaling": t.routed_scaling_factor, "situ_beta": t.activation_situ_beta,
            "situ_cap": t.activation_situ_linear_beta}
    ops = [o["op"] for o in graph_manifest(plan)["custom_ops"]]
    return dims, ops, layout.name


def device_card(device: str) -> dict | None:
    """The card of a shipped layout whose name names this CUDA device (e.g. "H200"); None on CPU
    or for a GPU no layout describes (then no roofline bound is given)."""
    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(dev).upper()
    for d in data_dirs("layouts"):
        for p in sorted(d.glob("*.yaml")):
            card = (read_yaml(p) or {}).get("card") or {}
            words = [w for w in str(card.get("name", "")).upper().replace("(", " ").split() if any(ch.isdigit() for ch in w)]
            if words and words[0] in name and card.get("peak_flops", {}).get("bf16"):
                return card
    return None
