"""One ``torch.distributed`` process per TP/EP rank: the device run, really sharded.

``Distributed.prepare`` launches ``torchrun --nproc_per_node N -m k3bundle.validate.worker``.
Each worker reads only its rank's device tensors (``BundleWeights(rank=r)``) and runs the
executor's one case runner and teacher-forced pass on them; partial results cross ranks through
``all_reduce`` / ``all_gather`` (gloo on CPU, NCCL on CUDA); rank 0 writes the device arrays of
every case, which ``case`` then hands to the judge exactly like a merged run.
Supported layouts: attention tensor-parallel over every rank (TP = world), EP over the same
ranks, no pipeline stages and no attention data parallelism — the merged mode covers the rest.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from k3bundle.bundle.weights import bundle_layout
from k3bundle.golden.store import read_npz
from k3bundle.validate.devices import EXACT_SAME, Device, as_tensor, builtin_output, exact_applies
from k3bundle.validate.errors import ValidateError

class Distributed(Device):
    def __init__(self, bundle: str | Path, device: str = "cpu", nproc: int | None = None,
                 results: str | Path | None = None, backend: str | None = None, name: str | None = None):
        self.bundle = Path(bundle)
        par = bundle_layout(self.bundle)["parallel"]
        world = par["tp"]
        if par.get("pp", 1) != 1 or par.get("attention_dp", 1) != 1:
            raise ValidateError(f"{self.bundle}: --ranks distributed needs a layout without pipeline stages or "
                                f"attention data parallelism (pp {par.get('pp')}, attention_dp "
                                f"{par.get('attention_dp')}); use --ranks merged")
        if nproc is not None and nproc != world:
            raise ValidateError(f"{self.bundle}: the layout has {world} ranks, --nproc {nproc} differs")
        super().__init__(name or device)
        self.device, self.nproc = device, world
        self.backend = backend  # every rank's executor runs this backend's kernels (None: the reference)
        self.results_dir = None if results is None else Path(results)  # a worker run made elsewhere
        self.runs_cases_in_prepare = self.results_dir is None  # one torchrun of every rank runs every case
        self.results: dict[str, tuple[dict, dict | None]] = {}
        self.reference, self.exact_section = "", EXACT_SAME  # whether the ranks recompute a long case's layer inputs

    def prepare(self, validation: Path, cases: list[str]) -> None:
        # every rank asks the same question of the same files (worker.main): the float32 recomputation
        # that feeds a case of sampled positions runs on the goldens' own weights only
        self.reference, section = exact_applies(self.bundle, validation, self.device)
        if section is not None:
            self.exact_section = section
            self.exact_status = (f"{self.reference}; on every rank, for cases of sampled positions only (the "
                                 "recomputation that feeds their layer checks); a case that taps every position "
                                 "has it on the built-in device in one process")
        if self.results_dir is not None:  # e.g. a multi-host torchrun of the worker
            self._read(self.results_dir, cases)
            return
        with tempfile.TemporaryDirectory(prefix="k3-ranks-") as tmp:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(self.nproc),
                   "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
                   "-m", "k3bundle.validate.worker", str(self.bundle), str(validation), tmp, self.device,
                   self.backend or "reference"]
            env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
            r = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if r.returncode != 0:
                full = f"\n{r.stdout}\n{r.stderr}" if os.environ.get("K3BUNDLE_DEBUG") else ""
                raise ValidateError(f"{self.bundle}: distributed device run failed (exit {r.returncode}): "
                                    f"{_cause(r.stderr + chr(10) + r.stdout)}{full}")
            self._read(Path(tmp), cases)

    def _read(self, directory: Path, cases: list[str]) -> None:
        for name in cases:
            f = directory / f"{name}.npz"
            if not f.is_file():
                raise ValidateError(f"{f}: missing; the rank workers wrote no result for case {name!r}")
            arrays = read_npz(f)
            cand = {k[5:]: as_tensor(v.copy()) for k, v in arrays.items() if k.startswith("cand/")}
            outs = {k[5:]: as_tensor(v.copy()) for k, v in arrays.items() if k.startswith("outs/")}
            self.results[name] = (cand, outs or None)

    def case(self, name, golden, ids):
        return builtin_output(*self.results[name], golden, self.exact_section, self.reference)

def _cause(output: str) -> str:
    """The line that says why a rank died: ``rank N: Type: message`` from the last exception
    line of a traceback, else the last line (torchrun's ``====`` banners are skipped)."""
    lines = [l.strip() for l in output.strip().splitlines() if l.strip()]
    errors = [l for l in lines if _is_exception_line(l)]
    if errors:
        m = _EXCEPTION.search(errors[-1])
        rank = _RANK.match(errors[-1])
        return (f"rank {rank.group(1)}: " if rank else "") + errors[-1][m.start(1):]
    useful = [l for l in lines if set(l) - set("=-* ")]
    return useful[-1] if useful else "(no output)"

_RANK = re.compile(r"\[(?:default)?(?:rank)?(\d+)\]")
_EXCEPTION = re.compile(r"(?:^|[\s\]:])([A-Za-z_][\w.]*(?:Error|Exception|Interrupt)): ")


def _is_exception_line(line: str) -> bool:
    """``RuntimeError: …``, also behind torchrun's ``[rank1]:`` prefix."""
    return _EXCEPTION.search(line) is not None

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

