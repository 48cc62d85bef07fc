"""Hashing throughput of ``k3bundle pull`` against ``sha256sum`` over the same files, same run.

What it measures, on one synth checkpoint (``--preset small``, ~0.96 GB) plus ``--extra-gb``
GB of random shard-like files (so interpreter start-up does not dominate), all warm in the
page cache (this is about hashing, not the disk):

* ``sha256sum`` of every file: one process, and one per core (``xargs -P``); and
  ``openssl dgst -sha256`` (the same OpenSSL code Python's hashlib calls);
* ``k3bundle pull DIR`` in place (hash only) with ``--workers 1`` and ``--workers <cores>``;
* ``k3bundle pull REPO --out`` from the local Hub look-alike (``tests/hub_server.py``, run in
  its own process): download + hash + write in one pass;
* the two-pass way: ``hf download --local-dir`` from the same server, then ``sha256sum``
  (huggingface_hub does not verify what it downloads).

Each row: the best wall time of ``--repeat`` runs (the least disturbed by other load) (``/usr/bin/time -v``, so it includes Python
start-up, about 1.8 s for ``k3bundle``), throughput, the ratio to one ``sha256sum`` process,
the time the pull itself reports (``seconds`` in ``--json``, without start-up), and peak RSS.
It also checks that every pull hashed each byte exactly once (``bytes_hashed == bytes``).

    python bench/pull_hash.py --data /tmp/k3pull-bench --extra-gb 2 --repeat 3

Needs ``/usr/bin/time`` (``apt-get install -y time``) and ``sha256sum`` (coreutils).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
REPO_ID = "moonshotai/Kimi-K3-synth"


def timed(cmd: list[str] | str, env: dict | None = None, shell: bool = False) -> tuple[float, int, str]:
    """Run under /usr/bin/time -v: (wall seconds, peak RSS bytes, stdout)."""
    full = ["/usr/bin/time", "-v", "bash", "-c", cmd] if shell else ["/usr/bin/time", "-v", *cmd]
    t0 = time.perf_counter()
    r = subprocess.run(full, env=env, capture_output=True, text=True, cwd=REPO)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        sys.exit(f"failed ({r.returncode}): {cmd}\n{r.stderr[-2000:]}")
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", r.stderr)
    return wall, int(m.group(1)) * 1024 if m else 0, r.stdout


def prepare(data: Path, extra_gb: int) -> Path:
    tree = data / "tree"
    if not (tree / "config.json").exists():
        print(f"writing synth small into {tree} (once) ...", file=sys.stderr)
        subprocess.run([PY, "-m", "k3bundle", "synth", "--preset", "small", "--out", str(tree), "--force"],
                       check=True, cwd=REPO)
    for i in range(extra_gb):
        p = tree / f"extra-shard-{i:05d}.safetensors"
        if not p.exists() or p.stat().st_size != 1 << 30:
            with open(p, "wb") as f:
                for _ in range(1024):
                    f.write(os.urandom(1 << 20))
    for p in tree.glob("extra-shard-*.safetensors"):
        if int(p.stem.split("-")[-1]) >= extra_gb:
            p.unlink()
    (tree / "source.json").unlink(missing_ok=True)
    return tree


def files_of(tree: Path) -> list[Path]:
    return sorted(p for p in tree.rglob("*") if p.is_file() and p.name not in ("source.json",)
                  and not p.name.startswith("."))


def warm(files: list[Path]) -> None:
    for p in files:
        with open(p, "rb") as f:
            while f.read(1 << 24):
                pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=Path("/tmp/k3pull-bench"))
    ap.add_argument("--extra-gb", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    if not Path("/usr/bin/time").exists():
        sys.exit("needs /usr/bin/time: apt-get install -y time")
    cores = os.cpu_count() or 1
    tree = prepare(a.data, a.extra_gb)
    files = files_of(tree)
    total = sum(p.stat().st_size for p in files)
    names = " ".join(f"'{p}'" for p in files)
    warm(files)

    srv = subprocess.Popen([PY, "-m", "tests.hub_server", str(tree), "--repo-id", REPO_ID], cwd=REPO,
                           stdout=subprocess.PIPE, text=True)
    url = srv.stdout.readline().strip()
    hf_home = Path(tempfile.mkdtemp(prefix="k3b-hfhome-"))
    env = {**os.environ, "HF_ENDPOINT": url, "HF_HUB_OFFLINE": "0", "HF_HUB_DISABLE_TELEMETRY": "1",
           "HF_HOME": str(hf_home), "HF_HUB_DISABLE_XET": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
           "NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1"}
    scratch = Path(tempfile.mkdtemp(prefix="k3b-pull-", dir=a.data))
    rows = []

    def run(label: str, make, check=None):
        walls, rss, inner = [], [], []
        for _ in range(a.repeat):
            out = scratch / "out"
            shutil.rmtree(out, ignore_errors=True)
            cmd, shell = make(out)
            w, r, stdout = timed(cmd, env=env, shell=shell)
            walls.append(w)
            rss.append(r)
            if check:
                s = json.loads(stdout)
                assert s["bytes_hashed"] == s["bytes"] == total, (label, s)
                inner.append(s["seconds"])
            shutil.rmtree(out, ignore_errors=True)
            (tree / "source.json").unlink(missing_ok=True)
            warm(files)
        rows.append((label, min(walls), max(rss), min(inner) if inner else None))
        print(f"  {label}: {min(walls):.2f} s (runs: {', '.join(f'{x:.2f}' for x in walls)})", file=sys.stderr)

    load0 = os.getloadavg()[0]
    startup, startup_rss, _ = timed([PY, "-m", "k3bundle", "--version"])
    run("sha256sum, 1 process", lambda o: (f"sha256sum {names} >/dev/null", True))
    if shutil.which("openssl"):
        run("openssl dgst -sha256, 1 process (SHA-NI where the CPU has it)",
            lambda o: (f"openssl dgst -sha256 {names} >/dev/null", True))
    run(f"sha256sum, {cores} processes (xargs -P{cores})",
        lambda o: (f"printf '%s\\0' {names} | xargs -0 -n1 -P{cores} sha256sum >/dev/null", True))
    for w in sorted({1, cores}):
        run(f"k3bundle pull DIR (in place), --workers {w}",
            lambda o, w=w: ([PY, "-m", "k3bundle", "pull", str(tree), "--json", "--workers", str(w)], False), True)
    for w in sorted({1, cores}):
        run(f"k3bundle pull REPO --out (local server), --workers {w}",
            lambda o, w=w: ([PY, "-m", "k3bundle", "pull", REPO_ID, "--out", str(o), "--json", "--workers", str(w)],
                            False), True)
    hf = shutil.which("hf", path=str(Path(PY).parent)) or shutil.which("hf")
    if hf:
        run("hf download --local-dir, then sha256sum (two passes)",
            lambda o: (f"'{hf}' download {REPO_ID} --local-dir '{o}' --quiet >/dev/null && "
                       f"cd '{o}' && find . -type f -not -path './.cache/*' -print0 | xargs -0 sha256sum >/dev/null",
                       True))
    srv.terminate()
    shutil.rmtree(scratch, ignore_errors=True)
    shutil.rmtree(hf_home, ignore_errors=True)

    base = rows[0][1]
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    print(f"Machine: {cpu}, {cores} cores, Python {platform.python_version()}; {len(files)} files, "
          f"{total / 1e9:.2f} GB, warm page cache; best of {a.repeat}; load average {load0:.1f} at start, "
          f"{os.getloadavg()[0]:.1f} at end; `k3bundle --version` alone: {startup:.2f} s, "
          f"{startup_rss / 1e6:.0f} MB RSS.\n")
    print("| run | wall s | GB/s (wall) | vs 1× sha256sum | pull's own s (GB/s) | peak RSS MB |")
    print("|---|---:|---:|---:|---:|---:|")
    for label, wall, rss, inner in rows:
        own = f"{inner:.2f} ({total / inner / 1e9:.2f})" if inner else "–"
        print(f"| {label} | {wall:.2f} | {total / wall / 1e9:.2f} | {base / wall:.2f}× | {own} | {rss / 1e6:.0f} |")


if __name__ == "__main__":
    main()
