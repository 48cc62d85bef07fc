"""A torchrun worker of ``k3bundle validate --ranks distributed`` (see ``distributed.py``).

Usage (launched by validate): ``torchrun --nproc_per_node N -m k3bundle.validate.worker
BUNDLE VALIDATION_DIR OUT_DIR DEVICE [BACKEND]`` (BACKEND: ``k3bundle.kernels`` name, default reference). Every rank runs every case on its own shard of the
weights through the same ``devices.device_arrays`` as the in-process device (a case of sampled
positions with its float32 recomputation, on the rank's shard of the goldens' own weights); rank 0 writes
``OUT_DIR/CASE.npz`` with the device arrays (``cand/…``) and the teacher-forced layer outputs
(``outs/…``).
"""

from __future__ import annotations

import os
import sys
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


def main(bundle: str, validation: str, out: str, device: str, kernels: str = "reference") -> None:
    backend = "nccl" if device.startswith("cuda") else "gloo"
    rank = int(os.environ["RANK"])
    if device.startswith("cuda"):
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', rank))}"
        torch.cuda.set_device(torch.device(device))
    dist.init_process_group(backend)
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
        for entry in read_meta(inter).get("cases", []):
            if entry.get("status") != "ok":
                continue
            name = entry["name"]
            golden = {k[len(name) + 1:]: v for k, v in inter.items() if k.startswith(name + "/")}
            cand, outs = device_arrays(weights, golden, inputs[f"{name}/ids"], reference_weights=reference)
            cand = _gather_heads(cand, weights.world, weights.device)
            if rank == 0:
                arrays = {f"cand/{k}": to_numpy(v) for k, v in cand.items()}
                arrays.update({f"outs/{k}": to_numpy(v) for k, v in (outs or {}).items()})
                write_npz(Path(out) / f"{name}.npz", arrays)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:6])
