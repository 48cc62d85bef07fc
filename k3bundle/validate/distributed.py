"""One ``torch.distributed`` process per TP/EP rank: the device run, really sharded.

``DistributedDevice.run`` launches ``torchrun --nproc_per_node N -m k3bundle.validate.worker``.
Each worker reads only its rank's device tensors (``BundleWeights(rank=r)``); partial results
cross ranks through ``all_reduce`` / ``all_gather`` (gloo on CPU, NCCL on CUDA); rank 0 writes
the device arrays of every case, which this process then judges exactly like a merged run.
Supported layouts: attention tensor-parallel over every rank (TP = world), EP over the same
ranks, no pipeline stages and no attention data parallelism — the merged mode covers the rest.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from k3bundle.bundle.weights import bundle_layout
from k3bundle.golden.store import read_npz
from k3bundle.validate.run import ValidateError


class DistributedDevice:
    distributed = True

    def __init__(self, bundle: str | Path, device: str = "cpu", nproc: int | None = None):
        self.bundle = Path(bundle)
        self.device = device
        par = bundle_layout(self.bundle)["parallel"]
        world = par["tp"]
        if par.get("pp", 1) != 1 or par.get("attention_dp", 1) != 1:
            raise ValidateError(f"{self.bundle}: --ranks distributed needs a layout without pipeline stages or "
                                f"attention data parallelism (pp {par.get('pp')}, attention_dp "
                                f"{par.get('attention_dp')}); use --ranks merged")
        if nproc is not None and nproc != world:
            raise ValidateError(f"{self.bundle}: the layout has {world} ranks, --nproc {nproc} differs")
        self.nproc = world

    def run(self, validation: Path) -> dict[str, tuple[dict, dict | None]]:
        with tempfile.TemporaryDirectory(prefix="k3-ranks-") as tmp:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(self.nproc),
                   "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
                   "-m", "k3bundle.validate.worker", str(self.bundle), str(validation), tmp, self.device]
            env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
            r = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if r.returncode != 0:
                tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["(no output)"]
                raise ValidateError(f"{self.bundle}: distributed device run failed (exit {r.returncode}): {tail[0]}")
            out = {}
            for f in sorted(Path(tmp).glob("*.npz")):
                arrays = read_npz(f)
                cand = {k[5:]: _t(v) for k, v in arrays.items() if k.startswith("cand/")}
                outs = {k[5:]: _t(v) for k, v in arrays.items() if k.startswith("outs/")}
                out[f.stem] = (cand, outs or None)
            return out

    def __call__(self, dtype: str):  # the merged reference is never needed in device mode
        raise ValidateError("a distributed device has no in-process weights")


def _t(a):
    import torch

    return torch.from_numpy(a.copy())


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
