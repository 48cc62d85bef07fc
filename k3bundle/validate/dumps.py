"""Device dumps: intermediates from an external runtime, one safetensors file per case.

Format (docs/dump-format.md): ``DIR/CASE.safetensors`` holding tensors named exactly as the
golden taps of that case (``layers.{l}.mixer_out`` …), per-position taps with one row per
golden position (``CASE/positions`` in the goldens, in that order), plus optionally
``greedy_tokens`` (I64 [steps]) and ``step_logits`` ([steps, V]). Required per case:
``logits``, ``final_hidden`` and, for every layer, ``layers.{l}.mixer_out`` and
``layers.{l}.ffn_out``; every other golden tap is optional. A tap that is present must have the
golden's shape and only finite values. Problems are collected and reported in one
``DumpError`` (exit 2), naming the file and tensor. Which taps are required is the tap
grammar's word (``executor.taps.TAPS``, ``in_dump``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from k3bundle.executor.taps import dump_required, layer_of
from k3bundle.io import SafetensorsFile
from k3bundle.validate.errors import DumpError

OPTIONAL_EXTRA = ("greedy_tokens", "step_logits")


def num_layers(golden: dict) -> int:
    """Number of decoder layers, from the golden's prompt taps."""
    layers = {layer_of(k) for k in golden if k.startswith("layers.")}
    return max(layers) + 1 if layers else 0


def read_dump(directory: str | Path, case: str, golden: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """Load and check ``DIR/CASE.safetensors`` against the case's golden arrays."""
    path = Path(directory) / f"{case}.safetensors"
    if not path.is_file():
        raise DumpError(f"{path}: missing dump for case {case!r}")
    problems: list[str] = []
    out: dict[str, torch.Tensor] = {}
    with SafetensorsFile(path) as f:
        keys = set(f.keys())
        for name in dump_required(num_layers(golden)):
            if name not in keys:
                problems.append(f"required tap {name!r} is missing")
        for name in sorted(keys):
            if name not in golden and name not in OPTIONAL_EXTRA:
                problems.append(f"tensor {name!r} is not a golden tap of case {case!r}")
                continue
            t = f.get(name)
            want = golden.get(name)
            if name == "step_logits" and "step_logits" in golden:
                want = golden["step_logits"]
            if name == "greedy_tokens":
                want = golden.get("greedy_tokens")
            if want is not None and tuple(t.shape) != tuple(want.shape):
                problems.append(f"tensor {name!r} has shape {list(t.shape)}, the golden has {list(want.shape)}")
                continue
            if t.dtype.is_floating_point and not bool(torch.isfinite(t).all()):
                bad = int((~torch.isfinite(t)).sum())
                problems.append(f"tensor {name!r} has {bad} NaN/Inf value(s)")
                continue
            out[name] = t
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise DumpError(f"{path}: {problems[0]}{more}")
    return out
