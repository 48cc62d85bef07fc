"""Detection against defect size: one weight tensor perturbed by a relative magnitude, validate's
verdict and where it puts the fault (docs/validation.md "Sensitivity").

For each weight class (a role of the schema, ``CLASSES``), each magnitude ε (``--eps``) and each
trial, a copy of the checkpoint gets, in one layer drawn for the trial,

    W ← round_to_stored_dtype(W + ε · rms(W) · N(0, 1))

and is judged against the *clean* checkpoint's goldens under the shipped rules, in process (the
built-in device, BF16). The goldens are another checkpoint's, so the exact check does not apply —
the situation of a converted bundle judged against goldens made from its source — and the
verdict rests on the device-precision checks, which is what this measures. Recorded per run:
the achieved relative change ‖W' − W‖ / ‖W‖ (a BF16 tensor cannot carry a change below its
rounding: at small ε most elements round back), the verdict, and the first failure (mode, tap).
*Detected*: FAIL. *Located*: the first failure is a teacher-forced check of the planted layer.

``--exact``: the goldens' own checkpoint is perturbed in place instead (its shard restored after
each run), so the exact check — the teacher-forced run in float32 on the weights the goldens
were made from, judged to the float32 floor — applies as it does to a bundle whose bytes change
after its goldens were made (a device's load path, a corrupted copy).

Routed experts are not in the classes: an MXFP4 code cannot carry a small relative change (the
fault catalogue plants expert faults: swapped experts, a scale byte, a transposed shard).

    python bench/sensitivity.py run --preset tiny-trained --out OUT [--eps 1e-4 ...] [--trials 3]
    python bench/sensitivity.py run --exact ...     # the same with the exact check applying
    python bench/sensitivity.py table OUT|RECORDS  # the Markdown table of docs/validation.md
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from k3bundle.config import load_config  # noqa: E402
from k3bundle.schema import Schema  # noqa: E402

# weight classes: schema roles, one representative of each part of a layer
CLASSES = ("kda.q_proj", "kda.k_proj", "kda.v_proj", "kda.o_proj", "kda.f_b_proj", "kda.g_proj",
           "kda.q_conv", "kda.dt_bias", "mla.q_b_proj", "mla.kv_a_proj", "mla.kv_b_proj", "mla.o_proj",
           "input_norm", "post_attn_norm", "attn_res.proj", "moe.router", "moe.latent_up",
           "moe.shared.down_proj")
EPS = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1)
INDEX = "model.safetensors.index.json"


def k3(*args: str) -> None:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    subprocess.run([sys.executable, "-m", "k3bundle", *args], check=True, env=env, stdout=subprocess.DEVNULL)


def prepare(out: Path, preset: str, seed: int, steps: int, cases: list[str]) -> Path:
    """The clean checkpoint and its goldens (``cases`` with ``steps`` decode steps)."""
    ckpt = out / "clean"
    if (ckpt / "validation").is_dir():
        return ckpt
    k3("synth", "--preset", preset, "--seed", str(seed), "--out", str(ckpt), "--force")
    cdir = out / "cases"
    cdir.mkdir(parents=True, exist_ok=True)
    for c in cases:
        text = (ROOT / "golden" / "cases" / f"{c}.yaml").read_text()
        (cdir / f"{c}.yaml").write_text(text.replace("steps: 16", f"steps: {steps}"))
    k3("golden", str(ckpt), "--cases", str(cdir), "--out", str(ckpt / "validation"))
    return ckpt


def candidates(schema: Schema, role: str) -> list[int]:
    """The layers that hold ``role``."""
    return [l for l in range(schema.n_layers) if any(r.role == role for r in schema.layer_roles(l))]


def tensor_name(schema: Schema, role: str, layer: int) -> str:
    return next(t.name for t in schema.layer_tensors(layer, experts=()) if t.role.role == role)


def perturbed(clean: Path, name: str, eps: float, rng: torch.Generator) -> tuple[str, dict, float]:
    """Tensor ``name``'s shard of ``clean`` with that tensor perturbed: (shard file, its tensors,
    the achieved relative change)."""
    shard = json.loads((clean / INDEX).read_text())["weight_map"][name]
    with safe_open(clean / shard, "pt") as f:
        tensors, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    w = tensors[name]
    w64 = w.double()
    noise = torch.randn(w.shape, generator=rng, dtype=torch.float64)
    tensors[name] = new = (w64 + eps * w64.pow(2).mean().sqrt() * noise).to(w.dtype)
    return shard, {"tensors": tensors, "metadata": meta}, float((new.double() - w64).norm() / w64.norm())


def perturbed_copy(clean: Path, dst: Path, name: str, eps: float, rng: torch.Generator) -> float:
    """``dst``: ``clean`` with tensor ``name`` perturbed (files hard-linked but the one rewritten);
    returns the achieved relative change."""
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    shard, data, achieved = perturbed(clean, name, eps, rng)
    for f in clean.iterdir():
        if f.is_file() and f.name != shard:
            os.link(f, dst / f.name)
    save_file(data["tensors"], dst / shard, metadata=data["metadata"])
    return achieved


@contextlib.contextmanager
def perturbed_in_place(clean: Path, name: str, eps: float, rng: torch.Generator):
    """``clean`` itself with tensor ``name`` perturbed while the block runs, its shard restored
    after (the goldens are then this checkpoint's own, so the exact check applies)."""
    shard, data, achieved = perturbed(clean, name, eps, rng)
    keep, tmp = clean.parent / f"{shard}.clean", clean.parent / f"{shard}.perturbed"
    save_file(data["tensors"], tmp, metadata=data["metadata"])
    os.link(clean / shard, keep)
    os.replace(tmp, clean / shard)
    try:
        yield achieved
    finally:
        os.replace(keep, clean / shard)


def judge(path: Path, goldens: Path) -> list[dict]:
    from k3bundle.validate.device_options import open_device
    from k3bundle.validate.run import validate

    rep = validate(path, open_device(path, device="cpu"), validation=goldens, verify_level="manifest")
    out = []
    for c in rep.cases:
        ff = c.first_failure
        out.append({"case": c.name, "status": c.status,
                    "first": None if ff is None else {"mode": ff.mode, "tap": ff.tap, "layer": ff.layer}})
    return out


def cmd_run(a) -> None:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    clean = prepare(out, a.preset, a.seed, a.steps, a.cases)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so an in-place shard is restored
    for kept in out.glob("*.clean"):  # a run killed harder than that left a perturbed shard
        os.replace(kept, clean / kept.stem)
    schema = Schema(load_config(clean), vision=False)
    records = out / "records.jsonl"
    done = set()
    if records.exists():
        done = {(r["class"], r["eps"], r["trial"]) for r in map(json.loads, records.read_text().splitlines())}
    t0 = time.time()
    base = judge(clean, clean / "validation")  # the clean copy itself must pass
    bad = [c["case"] for c in base if c["status"] != "pass"]
    if bad:
        sys.exit(f"the clean checkpoint fails its own goldens ({', '.join(bad)}): nothing to measure")
    for cls in a.classes:
        layers = candidates(schema, cls)
        if not layers:
            print(f"{cls}: no layer holds it in {a.preset}", file=sys.stderr)
            continue
        for eps in a.eps:
            for trial in range(a.trials):
                if (cls, eps, trial) in done:
                    continue
                pick = random.Random(f"{cls}/{trial}").choice(layers)
                name = tensor_name(schema, cls, pick)
                g = torch.Generator().manual_seed(zlib.crc32(f"{cls}/{eps}/{trial}".encode()))
                t = time.time()
                if a.exact:
                    with perturbed_in_place(clean, name, eps, g) as achieved:
                        cases = judge(clean, clean / "validation")
                else:
                    achieved = perturbed_copy(clean, out / "work", name, eps, g)
                    cases = judge(out / "work", clean / "validation")
                rec = {"preset": a.preset, "seed": a.seed, "exact": a.exact, "class": cls, "eps": eps, "trial": trial, "layer": pick,
                       "tensor": name, "achieved": achieved, "cases": cases, "seconds": round(time.time() - t, 1)}
                with records.open("a") as f:
                    f.write(json.dumps(rec) + "\n")
                verdict = "FAIL" if any(c["status"] == "fail" for c in cases) else "pass"
                print(f"{cls} eps={eps:g} trial={trial} layer={pick} achieved={achieved:.2e} {verdict} "
                      f"{located(rec)} ({time.time() - t0:.0f} s)", flush=True)
    shutil.rmtree(out / "work", ignore_errors=True)


def _firsts(rec: dict) -> list[dict]:
    """The first failure of each failing case."""
    return [c["first"] for c in rec["cases"] if c["status"] == "fail" and c["first"]]


def located(rec: dict) -> bool:
    """Some failing case's first failure is a teacher-forced check of the planted layer."""
    from k3bundle.validate.findings import TEACHER_FORCED
    return any(f["mode"] in TEACHER_FORCED and f["layer"] == rec["layer"] for f in _firsts(rec))


def detected(rec: dict) -> bool:
    return any(c["status"] == "fail" for c in rec["cases"])


def mislocated(rec: dict) -> bool:
    """A teacher-forced first failure names another layer (and none names the planted one)."""
    from k3bundle.validate.findings import TEACHER_FORCED
    return not located(rec) and any(f["mode"] in TEACHER_FORCED for f in _firsts(rec))


def end_to_end_only(rec: dict) -> bool:
    """Failed, but only free-running checks did (the logits, a decode state): seen, not located."""
    return detected(rec) and not located(rec) and not mislocated(rec)


def _records(path: Path) -> str:
    """A run's records: OUT (its records.jsonl) or a committed records file (.jsonl or .jsonl.gz)."""
    if path.is_dir():
        path = path / "records.jsonl"
    return gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()


def cmd_table(a) -> None:
    recs = [json.loads(l) for p in a.out for l in _records(Path(p)).splitlines()]
    eps = sorted({r["eps"] for r in recs} & set(a.eps or [r["eps"] for r in recs]))
    print("| weight class | " + " | ".join(f"ε {e:g}" for e in eps) + " | smallest ε located in every trial |")
    print("|---|" + "---|" * (len(eps) + 1))
    for cls in dict.fromkeys(r["class"] for r in recs):
        cells, smallest = [], None
        for e in eps:
            rs = [r for r in recs if r["class"] == cls and r["eps"] == e]
            if not rs:
                cells.append("–")
                continue
            if not any(r["achieved"] for r in rs):  # every element rounded back: no fault planted
                cells.append("no change")
                continue
            rs = [r for r in rs if r["achieved"]]
            loc, e2e, wrong = sum(map(located, rs)), sum(map(end_to_end_only, rs)), sum(map(mislocated, rs))
            cells.append(f"{loc}/{len(rs)}" + (f" +{e2e}e" if e2e else "") + (f" +{wrong}w" if wrong else ""))
            if loc == len(rs) and smallest is None:
                smallest = e
        print(f"| `{cls}` | " + " | ".join(cells) + f" | {'–' if smallest is None else f'{smallest:g}'} |")
    ach = {}
    for r in recs:
        if r["eps"] in eps:
            ach.setdefault(r["eps"], []).append(r["achieved"])
    print("\nachieved relative change (median over classes and trials): " +
          ", ".join(f"ε {e:g}: {float(np.median(v)):.1e}" for e, v in sorted(ach.items())))
    secs = [r["seconds"] for r in recs]
    print("\nA cell: located in L of N trials; +Ke: K more failed on free-running checks only (seen end to end, "
          "not located); +Kw: K more whose first teacher-forced failure named another layer; no change: the "
          "perturbation rounded back to the stored values in every trial (a trial that changed nothing is not counted).")
    print(f"{len(recs)} runs, median {float(np.median(secs)):.1f} s per validate")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--preset", default="tiny-trained")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--out", required=True)
    r.add_argument("--eps", type=float, nargs="+", default=list(EPS))
    r.add_argument("--trials", type=int, default=3)
    r.add_argument("--steps", type=int, default=4, help="decode steps of each case")
    r.add_argument("--cases", nargs="+", default=["greedy"])
    r.add_argument("--classes", nargs="+", default=list(CLASSES))
    r.add_argument("--exact", action="store_true",
                   help="perturb the goldens' own checkpoint in place (restored after each run), so the exact check applies")
    t = sub.add_parser("table")
    t.add_argument("out", nargs="+")
    t.add_argument("--eps", type=float, nargs="+", help="only these columns")
    a = p.parse_args()
    cmd_run(a) if a.cmd == "run" else cmd_table(a)


if __name__ == "__main__":
    main()
