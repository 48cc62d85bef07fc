"""Device dumps: intermediates from an external runtime, one safetensors file per case.

Format (docs/dump-format.md): ``DIR/CASE.safetensors`` holding tensors named exactly as the
golden taps of that case (``layers.{l}.mixer_out`` …), per-position taps with one row per
golden position (``CASE/positions`` in the goldens, in that order), plus optionally
``greedy_tokens`` (I64 [steps]) and ``step_logits`` ([steps, V]), and the runtime's own serving
paths (``serving.PATH.TAP``: ``validate.dump_serving``). Required per case:
``logits``, ``final_hidden`` and, for every layer, ``layers.{l}.mixer_out`` and
``layers.{l}.ffn_out``; every other golden tap is optional. A tap that is present must have the
golden's shape and only finite values. Every problem of every case file is collected before
any case is judged and reported in one ``DumpError`` (exit 2), one line each naming the file
and tensor. Which taps are required is the tap
grammar's word (``executor.taps.TAPS``, ``in_dump``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from k3bundle.executor.taps import dump_required, layer_of, tap_kind
from k3bundle.io import SafetensorsFile
from k3bundle.validate.dump_serving import check_entries, split
from k3bundle.validate.errors import DumpError

OPTIONAL_EXTRA = ("greedy_tokens", "step_logits")


def num_layers(golden: dict) -> int:
    """Number of decoder layers, from the golden's prompt taps."""
    layers = {layer_of(k) for k in golden if k.startswith("layers.")}
    return max(layers) + 1 if layers else 0


def _value_problem(name: str, t: torch.Tensor, want: np.ndarray | None, vocab: int | None,
                   experts: int | None) -> str | None:
    """What is wrong with a dumped tensor's dtype or values, if anything: ids must be integers in
    range (a float or out-of-range id would be judged, or index out of bounds), and a float tap
    must not arrive as integers (a dump of the wrong tensor, or of a quantized code)."""
    ids = name == "greedy_tokens" or tap_kind(name) == "router_ids"
    if ids or (want is not None and want.dtype.kind in "iub"):
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            return f"tensor {name!r} has dtype {_dtype(t)}; ids must be integers"
        bound = vocab if name == "greedy_tokens" else experts if tap_kind(name) == "router_ids" else None
        if t.numel() and int(t.min()) < 0:
            return f"tensor {name!r} holds a negative id ({int(t.min())})"
        if bound is not None and t.numel() and int(t.max()) >= bound:
            return f"tensor {name!r} holds id {int(t.max())}, outside 0..{bound - 1}"
        return None
    if not t.dtype.is_floating_point:
        return f"tensor {name!r} has dtype {_dtype(t)}; this tap holds floats (BF16, F16 or F32)"
    if not bool(torch.isfinite(t).all()):
        return f"tensor {name!r} has {int((~torch.isfinite(t)).sum())} NaN/Inf value(s)"
    return None


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def check_dump(directory: str | Path, case: str, golden: dict[str, np.ndarray], vocab: int | None = None,
               experts: int | None = None) -> tuple[list[str], dict[str, torch.Tensor]]:
    """``DIR/CASE.safetensors`` checked against the case's golden arrays — names, shapes, dtypes
    and id ranges (``vocab`` for greedy tokens, ``experts`` for router ids): (every problem, one
    line each naming the file and tensor; the tensors that passed)."""
    path = Path(directory) / f"{case}.safetensors"
    if not path.exists():
        return [f"{path}: missing dump for case {case!r}"], {}
    problems: list[str] = []
    out: dict[str, torch.Tensor] = {}
    with SafetensorsFile(path) as f:
        keys = set(f.keys())
        for name in dump_required(num_layers(golden)):
            if name not in keys:
                problems.append(f"required tap {name!r} is missing")
        serving_problems, serving = check_entries(f.get, keys, golden, OPTIONAL_EXTRA)
        problems += serving_problems
        out.update(serving)
        for name in sorted(k for k in keys if split(k) is None):
            if name not in golden and name not in OPTIONAL_EXTRA:
                problems.append(f"tensor {name!r} is not a golden tap of case {case!r}")
                continue
            t = f.get(name)
            want = golden.get(name)
            if want is not None and tuple(t.shape) != tuple(want.shape):
                problems.append(f"tensor {name!r} has shape {list(t.shape)}, the golden has {list(want.shape)}")
                continue
            bad = _value_problem(name, t, want, vocab, experts)
            if bad:
                problems.append(bad)
                continue
            out[name] = t
    return [f"{path}: {p}" for p in problems], out


def _check_folder(directory: Path) -> None:
    if not directory.is_dir():
        raise DumpError(f"{directory}: --dumps must be a folder of CASE.safetensors files, "
                        f"and this is {'a file' if directory.exists() else 'missing'}")


def _raise(directory: Path, problems: list[str]) -> None:
    """One problem: one line. Several: a count, then each on its own line (nothing is judged)."""
    if len(problems) == 1:
        raise DumpError(problems[0])
    if problems:
        raise DumpError(f"{directory}: {len(problems)} problems in the dumps, nothing judged:\n"
                        + "\n".join(problems))


def check_dumps(directory: str | Path, goldens: dict[str, dict[str, np.ndarray]], vocab: int | None = None,
                experts: int | None = None) -> None:
    """Every case's dump checked before any case is judged, so that every problem of every
    file is reported at once (``DumpError``, one line each)."""
    directory = Path(directory)
    _check_folder(directory)
    _raise(directory, [p for case, golden in goldens.items()
                       for p in check_dump(directory, case, golden, vocab, experts)[0]])


def read_dump(directory: str | Path, case: str, golden: dict[str, np.ndarray], vocab: int | None = None,
              experts: int | None = None) -> dict[str, torch.Tensor]:
    """The checked taps of ``DIR/CASE.safetensors`` (``check_dump``); any problem: ``DumpError``."""
    directory = Path(directory)
    _check_folder(directory)
    problems, out = check_dump(directory, case, golden, vocab, experts)
    _raise(directory, problems)
    return out
