"""Every command at the release's tensor count: ``synth --preset full-depth`` (497,220 tensors,
96 shards, about 1 GB), then pull, inspect, schema, plan, convert, verify, trace, checklist,
golden and validate, each as its own process under ``/usr/bin/time -v``.

For each command: wall time, peak RSS, the bytes it must read, hash and write, and the
per-tensor overhead: (wall - the time those bytes take at this machine's measured rates) /
tensors. The rates are measured in the same run on the same files: ``cat > /dev/null`` of the
checkpoint (read from the page cache, as the commands read it after synth), ``openssl dgst
-sha256`` of it (the library hashlib uses) and ``cp`` of it (read + write). The budget is 200 µs
per tensor of bookkeeping (golden and validate compute a 93-layer forward: their time is compute).

Usage:
  python bench/release_scale.py WORK_DIR [--layouts b300-tp8,h200-tp16-ep16,gb300-dep16]
      [--skip golden,validate] [--json OUT.json]
Prints a Markdown table (docs/performance.md "Release scale") and writes the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
K3 = [sys.executable, "-m", "k3bundle"]


def timed(cmd: list[str], log: Path) -> dict:
    """Run ``cmd`` under /usr/bin/time -v: wall seconds, peak RSS (MB), exit code."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.run(["/usr/bin/time", "-v", *cmd], stdout=f, stderr=subprocess.STDOUT,
                            cwd=ROOT).returncode
    wall = time.perf_counter() - t0
    text = log.read_text(errors="replace")
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
    return {"wall_s": round(wall, 2), "rss_mb": round(int(rss.group(1)) / 1024, 1) if rss else None, "rc": rc,
            "cmd": " ".join(c if not c.startswith(str(ROOT)) else os.path.relpath(c, ROOT) for c in cmd)}


def tree_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def files_of(p: Path) -> list[str]:
    return [str(f) for f in sorted(p.rglob("*")) if f.is_file()]


def rates(ckpt: Path, work: Path) -> dict:
    """Bytes per second of reading, hashing and copying the checkpoint on this machine."""
    files, size = files_of(ckpt), tree_bytes(ckpt)
    subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True)  # warm the page cache
    out = {}
    # openssl's SHA-256 is what Python's hashlib runs (the same library, SHA-NI where the CPU has it)
    for name, cmd in (("read", ["cat", *files]), ("sha256", ["openssl", "dgst", "-sha256", *files])):
        t0 = time.perf_counter()
        subprocess.run(cmd, stdout=subprocess.DEVNULL, check=True)
        out[name] = size / (time.perf_counter() - t0)
    dst = work / "cp-baseline"
    shutil.rmtree(dst, ignore_errors=True)
    t0 = time.perf_counter()
    subprocess.run(["cp", "-r", str(ckpt), str(dst)], check=True)
    subprocess.run(["sync"], check=True)
    out["cp"] = size / (time.perf_counter() - t0)
    shutil.rmtree(dst)
    return out


def overhead_us(row: dict, r: dict, tensors: int) -> float:
    """Wall time beyond the bytes' own cost at the measured rates, per tensor (µs)."""
    byte_s = row["read"] / r["read"] + row["hashed"] / r["sha256"] + row["written"] / r["cp"]
    return max(0.0, row["wall_s"] - byte_s) / tensors * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("work", type=Path)
    ap.add_argument("--layouts", default="b300-tp8,h200-tp16-ep16,gb300-dep16")
    ap.add_argument("--skip", default="", help="comma-separated command names to leave out")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    work, skip = a.work.resolve(), set(filter(None, a.skip.split(",")))
    work.mkdir(parents=True, exist_ok=True)
    logs = work / "logs"
    logs.mkdir(exist_ok=True)
    ckpt = work / "ckpt"
    rows: list[dict] = []

    def run(name: str, cmd: list[str], read=0, hashed=0, written=0, tensors=None, check=True) -> dict:
        print(f"[release-scale] {name} ...", file=sys.stderr, flush=True)
        row = {"command": name, **timed(cmd, logs / f"{name.replace(' ', '_')}.log"),
               "read": read, "hashed": hashed, "written": written, "tensors": tensors}
        if check and row["rc"] != 0:
            sys.exit(f"{name} failed (exit {row['rc']}); see {logs}/{name.replace(' ', '_')}.log")
        rows.append(row)
        return row

    if not ckpt.is_dir():
        run("synth", [*K3, "synth", "--preset", "full-depth", "--out", str(ckpt)])
    size = tree_bytes(ckpt)
    r = rates(ckpt, work)
    n = 497_220
    shutil.rmtree(work / "pulled", ignore_errors=True)
    run("pull (local dir)", [*K3, "pull", str(ckpt), "--out", str(work / "pulled")],
        read=size, hashed=size, written=size, tensors=n)
    shutil.rmtree(work / "pulled")
    run("inspect", [*K3, "inspect", str(ckpt)], tensors=n)
    run("schema", [*K3, "schema", "--preset", "full-depth", "--json"], tensors=n)
    for layout in a.layouts.split(","):
        bundle = work / f"bundle-{layout}"
        run(f"plan {layout}", [*K3, "plan", "--source", str(ckpt), "--target", layout], tensors=n)
        if "convert" not in skip:
            shutil.rmtree(bundle, ignore_errors=True)
            row = run(f"convert {layout}", [*K3, "convert", str(ckpt), "--target", layout, "--out", str(bundle)],
                      read=size, hashed=size, tensors=n)
            out = tree_bytes(bundle)
            row["written"] = out
            row["hashed"] += out  # every output is hashed once, read back from the page cache
            manifest = bundle / "manifest.json"
            row["manifest_mb"] = round(manifest.stat().st_size / 2**20, 2)
            row["index_mb"] = round((bundle / "weights.index.json").stat().st_size / 2**20, 2)
        out = tree_bytes(bundle)
        run(f"verify {layout}", [*K3, "verify", str(bundle)], read=out, hashed=out, tensors=n)
        run(f"verify --source {layout}", [*K3, "verify", str(bundle), "--source", str(ckpt)],
            read=out + size, hashed=out + size, tensors=n)
        if layout == a.layouts.split(",")[0]:
            run(f"verify --source {layout} --workers 2", [*K3, "verify", str(bundle), "--source", str(ckpt),
                                                          "--workers", "2"],
                read=out + size, hashed=out + size, tensors=n)
        index = json.loads((bundle / "weights.index.json").read_text())
        rank, key = _some_device_tensor(index)
        run(f"trace {layout}", [*K3, "trace", str(bundle), str(rank), key, "--offset", "0"], tensors=n)
        run(f"checklist --bundle {layout} (--verify sample)",
            [*K3, "checklist", "--target", layout, "--bundle", str(bundle), "--out", str(work / f"checklist-{layout}.md")],
            read=_sampled_bytes(bundle), hashed=_sampled_bytes(bundle), tensors=n)
        run(f"checklist --bundle {layout} --verify full",
            [*K3, "checklist", "--target", layout, "--bundle", str(bundle), "--verify", "full",
             "--out", str(work / f"checklist-{layout}.md")], read=out, hashed=out, tensors=n)
    first = work / f"bundle-{a.layouts.split(',')[0]}"
    extra = {}
    if "convert" not in skip:
        extra["workers"] = workers_determinism(first, ckpt, work, a.layouts.split(",")[0], run)
        extra["resume"] = resume_after_kill(ckpt, work, a.layouts.split(",")[-1])
    if "golden" not in skip:
        cases = work / "cases"
        cases.mkdir(exist_ok=True)
        text = (ROOT / "golden" / "cases" / "greedy.yaml").read_text()
        (cases / "greedy.yaml").write_text(text.replace("steps: 16", "steps: 2"))
        run("golden (greedy, 2 steps)", [*K3, "golden", str(first), "--cases", str(cases),
                                         "--out", str(first / "validation")], tensors=n)
        if "validate" not in skip:
            out = tree_bytes(first / "device_weights")
            run("validate (merged)", [*K3, "validate", str(first), "--ranks", "merged"], read=out, hashed=out,
                tensors=n, check=False)
    for row in rows:
        if row["tensors"]:
            row["overhead_us_per_tensor"] = round(overhead_us(row, r, row["tensors"]), 1)
    result = {"machine": os.uname().machine, "cpus": os.cpu_count(), "checkpoint_bytes": size,
              "rates_bytes_per_s": {k: round(v) for k, v in r.items()}, "rows": rows, **extra}
    if a.json:
        a.json.write_text(json.dumps(result, indent=1))
    print(f"rates: read {r['read'] / 1e9:.2f} GB/s, sha256 {r['sha256'] / 1e9:.2f} GB/s, cp {r['cp'] / 1e9:.2f} GB/s; "
          f"checkpoint {size / 1e9:.2f} GB, {n:,} tensors")
    for k, v in extra.items():
        print(f"{k}: {json.dumps(v)}")
    print("| command | wall s | peak RSS MB | bytes read / hashed / written | µs per tensor beyond bytes |")
    print("|---|---:|---:|---|---:|")
    for row in rows:
        gb = "/".join(f"{row[k] / 1e9:.2f}" for k in ("read", "hashed", "written"))
        us = row.get("overhead_us_per_tensor", "")
        extra = f" (manifest {row['manifest_mb']} MB, index {row['index_mb']} MB)" if "manifest_mb" in row else ""
        flag = "" if row["rc"] == 0 else f" (exit {row['rc']})"
        print(f"| {row['command']}{extra}{flag} | {row['wall_s']} | {row['rss_mb']} | {gb} GB | {us} |")
    return 0


def workers_determinism(bundle: Path, ckpt: Path, work: Path, layout: str, run) -> dict:
    """convert --workers 2 into a second directory: the same manifest (every file's sha256)?"""
    other = work / f"bundle-{layout}-w2"
    shutil.rmtree(other, ignore_errors=True)
    row = run(f"convert {layout} --workers 2", [*K3, "convert", str(ckpt), "--target", layout, "--out", str(other),
                                                "--workers", "2"], tensors=497_220,
              read=tree_bytes(ckpt), hashed=tree_bytes(ckpt) + tree_bytes(bundle), written=tree_bytes(bundle))
    same = (other / "manifest.json").read_bytes() == (bundle / "manifest.json").read_bytes()
    shutil.rmtree(other)
    print(f"[release-scale] --workers 1 and 2 give {'the same' if same else 'DIFFERENT'} manifest", file=sys.stderr)
    return {"layout": layout, "manifest_identical": same, "wall_s_workers_2": row["wall_s"]}


def resume_after_kill(ckpt: Path, work: Path, layout: str, after_units: int = 40) -> dict:
    """kill -9 a convert once ``after_units`` source files are journaled, rerun it: how many of the
    journaled files are reused (all of them: only the files in flight are redone)."""
    out = work / f"bundle-{layout}-kill"
    shutil.rmtree(out, ignore_errors=True)
    journal = out / ".k3bundle-convert.journal"
    p = subprocess.Popen([*K3, "convert", str(ckpt), "--target", layout, "--out", str(out)], cwd=ROOT,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    done = 0
    while p.poll() is None:
        if journal.is_file():
            done = sum('"unit"' in line for line in journal.read_text(errors="replace").splitlines())
            if done >= after_units:
                os.killpg(p.pid, 9)
                break
        time.sleep(0.05)
    p.wait()
    journaled = sum('"unit"' in line for line in journal.read_text(errors="replace").splitlines())
    t0 = time.perf_counter()
    r = subprocess.run([*K3, "convert", str(ckpt), "--target", layout, "--out", str(out), "--json"], cwd=ROOT,
                       capture_output=True, text=True)
    wall = time.perf_counter() - t0
    summary = json.loads(r.stdout) if r.returncode == 0 else {}
    shutil.rmtree(out)
    res = {"layout": layout, "journaled_at_kill": journaled, "units": summary.get("units"),
           "units_reused": summary.get("units_reused"), "rerun_wall_s": round(wall, 2), "rc": r.returncode}
    print(f"[release-scale] kill -9 after {journaled} journaled files: rerun reused {res['units_reused']} "
          f"of {res['units']}", file=sys.stderr)
    return res


def _sampled_bytes(bundle: Path, seed: int = 0) -> int:
    """Bytes ``--verify sample`` re-hashes in a command that reads no weights (its own rule)."""
    from k3bundle.provenance.verify import hashed_paths

    manifest = json.loads((bundle / "manifest.json").read_text())
    picked = hashed_paths(manifest, "sample", seed, ())
    return sum(f["size"] for f in manifest["files"] if f["path"] in picked)


def _some_device_tensor(index: dict) -> tuple[int, str]:
    """The last device tensor of the index (a deep lookup: vision or the last layer), by rank."""
    t = index["tensors"][-1]
    return t["rank"], t["key"]


if __name__ == "__main__":
    sys.exit(main())
