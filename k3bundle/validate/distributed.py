"""One ``torch.distributed`` process per TP/EP rank: the device run, really sharded.

``Distributed.prepare`` launches ``torchrun --nproc_per_node N -m k3bundle.validate.worker``.
Each worker reads only its rank's device tensors (``BundleWeights(rank=r)``) and runs the
executor's one case runner and teacher-forced pass on them; partial results cross ranks through
``all_reduce`` / ``all_gather`` (gloo on CPU, NCCL on CUDA); rank 0 writes the device arrays of
every case, which ``case`` then hands to the judge exactly like a merged run.
Supported layouts: attention tensor-parallel over every rank (TP = world), EP over the same
ranks, no pipeline stages and no attention data parallelism — the merged mode covers the rest.

A rank that stalls or dies never leaves validate waiting: every collective gives up after the
collective timeout, and this process kills the whole launch (its own session) once no rank has
written its heartbeat (``worker.progress``) for the timeout plus a margin. The error line names
the rank that stopped advancing, read from the ranks' progress files.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from k3bundle.bundle.weights import bundle_layout
from k3bundle.golden.store import read_npz
from k3bundle.validate.devices import EXACT_SAME, Device, as_tensor, builtin_output, exact_applies
from k3bundle.validate.errors import ValidateError
from k3bundle.validate.worker import PROGRESS

COLLECTIVE_TIMEOUT_S = 300.0
SILENCE_MARGIN_S = 60.0  # beyond the collective timeout: process start-up, torchrun's own teardown

class Distributed(Device):
    def __init__(self, bundle: str | Path, device: str = "cpu", nproc: int | None = None,
                 results: str | Path | None = None, backend: str | None = None, name: str | None = None,
                 collective_timeout: float = COLLECTIVE_TIMEOUT_S):
        if not 0 < collective_timeout < 1e6:
            raise ValidateError(f"--collective-timeout must be between 0 and 1e6 seconds, got {collective_timeout}")
        self.collective_timeout = float(collective_timeout)
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
                   self.backend or "reference", str(self.collective_timeout)]
            env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
            code, output, silent = _launch(cmd, env, Path(tmp), self.collective_timeout + SILENCE_MARGIN_S)
            if code != 0 or silent:
                full = f"\n{output}" if os.environ.get("K3BUNDLE_DEBUG") else ""
                why = (f"no rank advanced for {self.collective_timeout + SILENCE_MARGIN_S:.0f} s; all stopped"
                       if silent else f"exit {code}")
                culprit, cause = _culprit(Path(tmp), self.nproc, output), _cause(output)
                said = "; ".join(x for x in (culprit, cause) if x and (not culprit or _is_exception_line(x)
                                                                       or x is culprit))
                raise ValidateError(f"{self.bundle}: distributed device run failed ({why}): {said}{full}")
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

def _launch(cmd: list[str], env: dict, tmp: Path, silence_s: float) -> tuple[int, str, bool]:
    """Run torchrun in its own session; kill that session once no rank's heartbeat is newer than
    ``silence_s`` (or on any exception here, e.g. SIGTERM), so no rank outlives validate.
    Returns the exit status, the launcher's output and whether it was killed for silence."""
    log = tmp / "launcher.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    silent, started = False, time.time()
    try:
        while proc.poll() is None:
            time.sleep(0.5)
            beats = [p.stat().st_mtime for p in (tmp / PROGRESS).glob("rank-*")] if (tmp / PROGRESS).is_dir() else []
            if time.time() - max(beats, default=started) > silence_s:
                silent = True
                break
    finally:
        if proc.poll() is None:
            _kill_session(proc)
    return proc.returncode, log.read_text(errors="replace"), silent


def _kill_session(proc: subprocess.Popen) -> None:
    """SIGTERM to torchrun and every rank (one session), SIGKILL after 10 s."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(wait)
            break
        except subprocess.TimeoutExpired:
            continue
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # ranks torchrun left behind after it exited
    except ProcessLookupError:
        pass


def _culprit(tmp: Path, world: int, output: str) -> str:
    """``rank R stalled|died at STEP (rank Q reached STEP)`` from the progress files the workers
    write and torchrun's root cause (the rank whose process ended first, with its status)."""
    reached = {}
    for r in range(world):
        f = tmp / PROGRESS / f"rank-{r}"
        text = f.read_text().strip() if f.is_file() else "-1 not started"
        step, _, what = text.partition(" ")
        reached[r] = (int(step) if step.lstrip("-").isdigit() else -1, what)
    root = _ROOT.search(output)
    first, code = (int(root.group(1)), int(root.group(2))) if root else (None, None)
    status = "" if code is None else (f"exit status {code}" if code >= 0 else f"signal {-code}")
    low, high = min(s for s, _ in reached.values()), max(s for s, _ in reached.values())
    if low == high:
        return "" if first is None else f"rank {first} died first ({status}) at '{reached[first][1]}'"
    behind = [r for r, (s, _) in reached.items() if s == low]
    ahead = next(r for r, (s, _) in reached.items() if s == high)
    how = f"died ({status})" if first in behind else "stalled (no progress within the collective timeout)"
    return (f"rank {', '.join(str(r) for r in behind)} {how} at '{reached[behind[0]][1]}' while rank {ahead} "
            f"reached '{reached[ahead][1]}'")


# torchrun's summary: "Root Cause (first observed failure): ... rank : 1 (local_rank: 1) exitcode : 1 (pid ...)"
_ROOT = re.compile(r"Root Cause.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", re.S)


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

