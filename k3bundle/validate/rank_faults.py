"""A rank of ``validate --ranks distributed`` that stalls or dies, run on a bundle and judged.

Each fault runs ``k3bundle validate BUNDLE --ranks distributed`` in a child process with the
worker's test hook (``K3BUNDLE_TEST_RANK_FAULT=stall:R`` / ``die:R``, ``validate.worker``); it is a
clean error when validate exits 2 within the collective timeout plus the launch's margin, with
one ``error:`` line naming rank R, no sign-off in its report folder and no process of the run
left. A clean run afterwards (no hook) that passes is the re-validation.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from k3bundle.validate.distributed import SILENCE_MARGIN_S
from k3bundle.validate.worker import FAULT_ENV

FAULTS = {"rank_stall": ("stall", "stalled"), "rank_death": ("die", "died")}
TEARDOWN_S = 30.0  # torchrun's SIGTERM-then-SIGKILL of the other ranks, on top of the launch's limit


@dataclass
class RankFault:
    key: str
    clean: bool
    line: str  # validate's error line (or what was wrong with the run)
    seconds: float
    revalidated: bool | None = None


def _validate(bundle: Path, device: str, timeout_s: float, out: Path, hook: str | None) -> tuple[int, str, float]:
    env = {k: v for k, v in os.environ.items() if k not in (FAULT_ENV, "K3BUNDLE_DEBUG")}
    if hook:
        env[FAULT_ENV] = hook
    cmd = [sys.executable, "-m", "k3bundle", "validate", str(bundle), "--ranks", "distributed", "--device", device,
           "--collective-timeout", str(timeout_s), "--out", str(out)]
    t0 = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env,
                       timeout=None if hook is None else timeout_s + SILENCE_MARGIN_S + TEARDOWN_S + 120)
    return r.returncode, r.stderr, time.monotonic() - t0


def run_rank_faults(bundle: str | Path, device: str = "cpu", timeout_s: float = 60.0, rank: int = 1,
                    say=lambda s: None) -> list[RankFault]:
    """Both faults on ``rank`` of ``bundle``, then one clean run as their re-validation."""
    bundle, out = Path(bundle), []
    with tempfile.TemporaryDirectory(prefix="k3-rank-faults-") as tmp:
        for key, (hook, word) in FAULTS.items():
            say(f"faults: {key} (rank {rank} of validate --ranks distributed, collective timeout {timeout_s:g} s)")
            reports = Path(tmp) / key
            code, err, seconds = _validate(bundle, device, timeout_s, reports, f"{hook}:{rank}")
            errors = [l for l in err.splitlines() if l.startswith("error:")]
            signoff = sorted(p.name for p in reports.glob("signoff*")) if reports.is_dir() else []
            problems = [p for p in (
                f"exit {code}, not 2" if code != 2 else "",
                f"{len(errors)} error lines, not 1" if len(errors) != 1 else "",
                f"the error line does not name rank {rank} as {word}" if errors and f"rank {rank} {word}" not in errors[0] else "",
                f"sign-off left: {', '.join(signoff)}" if signoff else "",
                f"{seconds:.0f} s, over the collective timeout + {SILENCE_MARGIN_S + TEARDOWN_S:.0f} s"
                if seconds > timeout_s + SILENCE_MARGIN_S + TEARDOWN_S else "",
                "a process of the run outlived validate" if _left(bundle) else "") if p]
            line = errors[0][len("error:"):].strip() if len(errors) == 1 else (err.strip().splitlines() or ["(no output)"])[-1]
            out.append(RankFault(key, not problems, line if not problems else "; ".join(problems) + f": {line}", seconds))
        say("faults: a clean validate --ranks distributed after them")
        code, err, _ = _validate(bundle, device, timeout_s, Path(tmp) / "clean", None)
    for r in out:
        r.revalidated = code == 0
    return out


def _left(bundle: Path) -> bool:
    """Any process whose command line names the bundle (a rank or torchrun of the run)."""
    mine = str(bundle)
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            args = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(mine in a.decode(errors="replace") for a in args) and b"k3bundle.validate.worker" in b" ".join(args):
            return True
    return False
