"""The README's demo idle and next to busy processes, under two CPU policies (docs/performance.md "Under load").

For each policy and each load (0 = idle, then ``--busy`` competing processes), runs
``python -m k3bundle demo --out DIR --force --json`` in a subprocess and records the wall time of
every step (the demo's own ``--json``) and of the whole command (interpreter start included).
A competing process is ``python -c 'while True: pass'``: one core's worth of CPU-bound work; this
script starts it before the demo and kills it after.

Policies:

- ``torch-default``: what the command did before k3bundle/runtime.py: torch's own thread count and
  libgomp's default wait (spin 300,000 iterations, ``GOMP_SPINCOUNT=300000``, before sleeping).
- ``k3bundle``: the command line's policy (passive wait, threads from the available CPUs).
- ``NAME:VAR=VALUE,VAR=VALUE``: any other environment, for exploring.

Prints one Markdown table: seconds per step, the steps' total, the command's wall time, and the
loaded/idle ratio of the wall time per policy.

    python bench/load.py --out /tmp/k3-load
    python bench/load.py --out /tmp/k3-load --policy k3bundle --policy 'one-thread:K3BUNDLE_THREADS=1'
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
POLICY_ENV = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME", "K3BUNDLE_THREADS")
BUSY = "while True: pass"


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in POLICY_ENV}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def torch_default_threads() -> int:
    r = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                       env=clean_env(), capture_output=True, text=True, check=True)
    return int(r.stdout)


def policy_env(spec: str) -> tuple[str, dict[str, str]]:
    if spec == "torch-default":
        # GOMP_SPINCOUNT=300000 is libgomp's default; setting it keeps k3bundle's policy off
        return spec, {"OMP_NUM_THREADS": str(torch_default_threads()), "GOMP_SPINCOUNT": "300000"}
    if spec == "k3bundle":
        return spec, {}
    name, _, pairs = spec.partition(":")
    return name, dict(p.split("=", 1) for p in pairs.split(",") if p)


def run_demo(out: Path, env: dict[str, str], long_tokens: int, busy: int) -> dict:
    competitors = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(busy)]
    try:
        t = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "k3bundle", "demo", "--out", str(out), "--force", "--json",
                            "--long-tokens", str(long_tokens)], env={**clean_env(), **env},
                           capture_output=True, text=True)
        wall = time.monotonic() - t
    finally:
        for p in competitors:
            p.kill()
            p.wait()
    if r.returncode != 0:
        sys.exit(f"demo failed (exit {r.returncode}): {(r.stderr or r.stdout).strip()[-2000:]}")
    doc = json.loads(r.stdout)
    return {"wall": wall, "seconds": doc["seconds"], "steps": {s["name"]: s["seconds"] for s in doc["steps"]}}


def table(rows: list[dict]) -> str:
    steps = list(dict.fromkeys(s for r in rows for s in r["steps"]))
    head = ["policy", "competing processes", *steps, "steps total", "wall", "wall / idle"]
    lines = ["| " + " | ".join(head) + " |", "|---|---:|" + "---:|" * (len(head) - 2)]
    idle = {r["policy"]: r["wall"] for r in rows if r["busy"] == 0}
    for r in rows:
        ratio = f"{r['wall'] / idle[r['policy']]:.2f}×" if r["policy"] in idle else "–"
        cells = [r["policy"], str(r["busy"]), *(f"{r['steps'].get(s, float('nan')):.1f}" for s in steps),
                 f"{r['seconds']:.1f}", f"{r['wall']:.1f}", ratio]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="Demo working directory (replaced on every run).")
    ap.add_argument("--policy", action="append",
                    help="torch-default, k3bundle or NAME:VAR=VALUE,...; repeatable (default: the first two).")
    ap.add_argument("--busy", type=int, default=1, help="Competing CPU-bound processes in the loaded runs.")
    ap.add_argument("--long-tokens", type=int, default=1024, help="The demo's long-context case (its default).")
    ap.add_argument("--json", type=Path, help="Also write the rows here.")
    a = ap.parse_args()
    rows = []
    for spec in a.policy or ["torch-default", "k3bundle"]:
        name, env = policy_env(spec)
        for busy in (0, a.busy):
            r = run_demo(a.out, env, a.long_tokens, busy)
            rows.append({"policy": name, "env": env, "busy": busy, **r})
            print(f"{name}, {busy} competing: {r['wall']:.1f} s", file=sys.stderr, flush=True)
    print(f"{os.cpu_count()} CPUs, load average at the end {os.getloadavg()[0]:.2f}", file=sys.stderr)
    print(table(rows))
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
