"""A torchrun worker of ``k3bundle validate --ranks distributed`` (see ``distributed.py``).

Usage (launched by validate): ``torchrun --nproc_per_node N -m k3bundle.validate.worker
BUNDLE VALIDATION_DIR OUT_DIR DEVICE [BACKEND [TIMEOUT_S]]`` (BACKEND: ``k3bundle.kernels`` name, default
reference; TIMEOUT_S: the collective timeout, default 300: a rank that waits longer on a peer raises).
Every rank writes ``OUT_DIR/.progress/rank-N``: the step it has reached (validate names the rank that
stopped advancing) and, touched every second, that it is alive. Every rank runs every case on its own shard of the
weights through the same ``devices.device_arrays`` as the in-process device (a case of sampled
positions with its float32 recomputation, on the rank's shard of the goldens' own weights); rank 0 writes
``OUT_DIR/CASE.npz`` with the device arrays (``cand/…``) and the teacher-forced layer outputs
(``outs/…``).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from k3bundle.bundle.weights import BundleWeights
from k3bundle.executor.weights import resident_budget
from k3bundle.executor.taps import tap_kind
from k3bundle.file_names import GOLDEN_INPUTS, GOLDEN_INTERMEDIATES
from k3bundle.golden.store import read_meta, read_npz, to_numpy, write_npz
from k3bundle.validate.devices import DEVICE_POLICY, EXACT_POLICY, device_arrays, exact_applies, no_tf32

# KDA state taps are per-rank head slices: the axis their heads are on (states carry a leading
# step or snapshot axis in some arrays, so it is counted from the end)
HEAD_AXIS = {"kda_state": -3, "kda_conv": -1}


def _gather_heads(cand: dict[str, torch.Tensor], world: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Join the per-rank KDA head slices so rank 0 holds whole states. Collectives run on the
    process group's device (NCCL has no CPU tensors)."""
    out = {}
    for k, v in cand.items():
        dim = HEAD_AXIS.get(tap_kind(k))
        if dim is None:
            out[k] = v
            continue
        v = v.to(device).contiguous()
        parts = [torch.empty_like(v) for _ in range(world)]
        dist.all_gather(parts, v)
        out[k] = torch.cat(parts, dim=dim).cpu()
    return out


FAULT_ENV = "K3BUNDLE_TEST_RANK_FAULT"  # test hook: ``stall:R`` or ``die:R`` (docs/reliability.md)
PROGRESS = ".progress"  # OUT_DIR/.progress/rank-N: "STEP WHAT", rewritten at each step


def progress(out: str, rank: int, step: int, what: str) -> None:
    """Record the step this rank has reached (its mtime is also the rank's heartbeat)."""
    d = Path(out) / PROGRESS
    d.mkdir(exist_ok=True)
    tmp = d / f".rank-{rank}.tmp"
    tmp.write_text(f"{step} {what}\n")
    os.replace(tmp, d / f"rank-{rank}")


def _heartbeat(out: str, rank: int) -> None:
    """Touch the progress file every second: the parent kills a run whose ranks all went silent."""
    f = Path(out) / PROGRESS / f"rank-{rank}"
    while True:
        time.sleep(1.0)
        try:
            os.utime(f)
        except OSError:
            pass


def planted_fault(rank: int) -> None:
    """Test hook: K3BUNDLE_TEST_RANK_FAULT=stall:R makes rank R sleep forever before its first
    collective; die:R makes it exit with status 1 there."""
    spec = os.environ.get(FAULT_ENV, "")
    kind, _, which = spec.partition(":")
    if not spec or which != str(rank):
        return
    if kind == "die":
        os._exit(1)  # no finally, no destroy_process_group: as a crashed process
    if kind == "stall":
        while True:
            time.sleep(3600)
    raise SystemExit(f"{FAULT_ENV}={spec!r}: expected stall:RANK or die:RANK")


def main(bundle: str, validation: str, out: str, device: str, kernels: str = "reference",
         timeout_s: str = "300") -> None:
    backend = "nccl" if device.startswith("cuda") else "gloo"
    rank = int(os.environ["RANK"])
    if device.startswith("cuda"):
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', rank))}"
        torch.cuda.set_device(torch.device(device))
    progress(out, rank, 0, "started")
    threading.Thread(target=_heartbeat, args=(out, rank), daemon=True).start()
    # every collective (and NCCL's watchdog) gives up on a silent peer after this long
    dist.init_process_group(backend, timeout=timedelta(seconds=float(timeout_s)))
    progress(out, rank, 1, "joined the process group")
    planted_fault(rank)
    try:
        sharing = 1 if device.startswith("cuda") else int(os.environ.get("WORLD_SIZE", 1))  # ranks on one RAM
        weights = BundleWeights(bundle, dtype=DEVICE_POLICY, device=device, rank=rank,
                                resident_bytes=resident_budget(device, DEVICE_POLICY, sharing))
        if kernels != "reference":  # the executor on every rank runs these kernels
            from k3bundle.kernels.backend import load

            weights.backend = load(kernels)
            weights.backend.setup(device)
        reference = None  # the goldens' own weights in float32: what a case of sampled positions is recomputed on
        if exact_applies(Path(bundle), Path(validation), device)[1] is not None:
            no_tf32()
            reference = BundleWeights(bundle, dtype=EXACT_POLICY, device=device, rank=rank,
                                      resident_bytes=resident_budget(device, EXACT_POLICY, sharing))
        inputs = read_npz(Path(validation) / GOLDEN_INPUTS)
        inter = read_npz(Path(validation) / GOLDEN_INTERMEDIATES)
        for i, entry in enumerate(read_meta(inter).get("cases", [])):
            if entry.get("status") != "ok":
                continue
            name = entry["name"]
            progress(out, rank, 2 + i, f"case {name}")
            golden = {k[len(name) + 1:]: v for k, v in inter.items() if k.startswith(name + "/")}
            cand, outs = device_arrays(weights, golden, inputs[f"{name}/ids"], reference_weights=reference)
            cand = _gather_heads(cand, weights.world, weights.device)
            if rank == 0:
                arrays = {f"cand/{k}": to_numpy(v) for k, v in cand.items()}
                arrays.update({f"outs/{k}": to_numpy(v) for k, v in (outs or {}).items()})
                write_npz(Path(out) / f"{name}.npz", arrays)
        dist.barrier()
        progress(out, rank, 1000, "done")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:7])
