"""Calibrate validate's limits: every check's metric on many clean and faulted bundles.

    # record (one JSON line per case run) — seeds 0-9 set the limits, seeds 100+ measure rates
    python bench/calibrate.py run --out /tmp/cal --preset tiny:0-9 --preset tiny-trained:0-9 \\
        --layout b300-tp8 --layout gb300-dep16 --layout mi355x-tp8 --device cpu --workers 2
    # the separation table and the limits it implies (Markdown; --json for data)
    python bench/calibrate.py table /tmp/cal/records.jsonl --seeds 0-9
    # false-alarm and detection rates on held-out seeds, against the shipped tolerance files
    python bench/calibrate.py rates /tmp/cal/records.jsonl --seeds 100-149
    # each limit of a tolerance file between the clean worst and the faulted best; --write
    # records the clean worst in the file's calibration section (the sign-off report shows it)
    python bench/calibrate.py limits /tmp/cal/records.jsonl --seeds 0-9 --tolerance bf16 [--write --run TEXT]

A *job* is (preset, seed, layout, device): synth the checkpoint (``tiny``/``small``: the seed
draws the weights; ``tiny-trained``: one model, the seed draws the prompts: a greedy prompt of
corpus sentences and the long-context filler), convert it, make float32 goldens on the CPU
(``--golden-device cuda`` for ``small``, whose goldens take ~20 min on one core), then

- **clean**: validate the bundle on ``--device`` with every shipped case and record, per case,
  the worst value of every (mode, tap kind, metric) check, the greedy result, the state drift
  and whether the case passed;
- **faulted**: for each fault in ``FAULTS`` (a copy of the bundle with one planted defect) and
  ``SERVING_FAULTS`` (the clean bundle on a device whose decode-time cache handling is wrong)
  run the greedy case and record the same plus where validate located the first failure and
  where the fault was planted.

Records are appended to ``records.jsonl`` as jobs finish, so an interrupted run keeps what it
measured and ``run`` skips jobs already recorded.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import multiprocessing as mp
import random
import shutil
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from k3bundle.errors import K3Error  # noqa: E402
from k3bundle.golden.tolerances import METRICS  # noqa: E402
from k3bundle.validate.margin import check_key, ratio, show  # noqa: E402

CASES = REPO / "golden" / "cases"
EXACT_MODES = ("exact", "exact_gpu")  # the exact check's tolerance sections (validate.devices)
TOLERANCE_FOR = {"b300-tp8": "bf16", "gb300-dep16": "bf16", "h200-tp16-ep16": "bf16", "mi355x-tp8": "fp8",
                 "b200-tp8-pp2": "bf16"}


# ---------------------------------------------------------------- faults (bundle edits)
def _index(bundle: Path) -> list[dict]:
    return json.loads((bundle / "weights.index.json").read_text())["tensors"]


def _entries(bundle: Path, suffix: str, rank: int | None = None) -> list[dict]:
    return [e for e in _index(bundle) if e["key"].endswith(suffix) and (rank is None or e["rank"] == rank)]


def read_tensor(bundle: Path, e: dict) -> torch.Tensor:
    """One device tensor of a bundle, by its index entry."""
    from k3bundle.io import SafetensorsFile
    with SafetensorsFile(bundle / e["file"]) as f:
        return f.get(e["key"]).clone()


def write_tensor(bundle: Path, e: dict, new: torch.Tensor) -> None:
    """Rewrite one device tensor in place, same dtype and size: a corrupted bundle."""
    from k3bundle.io import SafetensorsFile
    with SafetensorsFile(bundle / e["file"]) as f:
        info, old = f.info(e["key"]), f.get(e["key"])
    new = new.contiguous()
    assert new.dtype == old.dtype and new.numel() == old.numel(), e["key"]
    raw = (new if new.dtype == torch.uint8 else new.view(torch.uint8)).numpy().tobytes()
    with open(bundle / e["file"], "r+b") as fh:
        fh.seek(info.abs_begin)
        fh.write(raw)


def _used(golden: dict, layer: int, case: str = "greedy") -> tuple[np.ndarray, np.ndarray]:
    return np.unique(golden[f"{case}/layers.{layer}.router_ids"], return_counts=True)


def fault_dt_bias(bundle, golden, rng):
    """KDA dt_bias negated on the last rank (a sign error in one TP shard)."""
    es = _entries(bundle, "layers.2.self_attn.dt_bias")
    e = max(es, key=lambda x: x["rank"])
    write_tensor(bundle, e, -read_tensor(bundle, e))
    return 2, "layers.2.mixer_out"


def _expert_slots(bundle: Path, layer: int, e: int, part: str) -> list[tuple[dict, int | None]]:
    """Where routed expert ``e``'s ``part`` (e.g. "w2.weight_scale") lives: (entry, stack row) per rank."""
    out = []
    for x in _index(bundle):
        k = x["key"]
        if f".layers.{layer}.block_sparse_moe.experts.{e}.{part}" in k:
            out.append((x, None))
        elif k.endswith(f".layers.{layer}.block_sparse_moe.experts.{part}"):
            a, b = x["source"]["experts"]
            if a <= e < b:
                out.append((x, e - a))
    return out


def _get_slot(bundle, slot) -> torch.Tensor:
    t = read_tensor(bundle, slot[0])
    return t if slot[1] is None else t[slot[1]]


def _set_slot(bundle, slot, value: torch.Tensor) -> None:
    if slot[1] is None:
        write_tensor(bundle, slot[0], value)
    else:
        t = read_tensor(bundle, slot[0])
        t[slot[1]] = value
        write_tensor(bundle, slot[0], t)


EXPERT_PARTS = ("w1.weight_packed", "w2.weight_packed", "w3.weight_packed",
                "w1.weight_scale", "w2.weight_scale", "w3.weight_scale",
                "w1.weight_global_scale", "w2.weight_global_scale", "w3.weight_global_scale")


def fault_swap_experts(bundle, golden, rng):
    """The two most-used routed experts of layer 1 exchanged (every part, every rank)."""
    vals, counts = _used(golden, 1)
    a, b = (int(v) for v in vals[np.argsort(-counts)[:2]])
    for part in EXPERT_PARTS:
        sa, sb = _expert_slots(bundle, 1, a, part), _expert_slots(bundle, 1, b, part)
        for x, y in zip(sa, sb):  # rank-ordered slices of the two experts
            ta, tb = _get_slot(bundle, x).clone(), _get_slot(bundle, y).clone()
            _set_slot(bundle, x, tb)
            _set_slot(bundle, y, ta)
    return 1, "layers.1.ffn_out"


def fault_scale_byte(bundle, golden, rng):
    """One scale byte of the most-used expert of layer 4 raised by 8 (E8M0: ×256; E4M3: ×2⁸ᐟ⁸)."""
    vals, counts = _used(golden, 4)
    ex = int(vals[counts.argmax()])
    slot = _expert_slots(bundle, 4, ex, "w2.weight_scale")[0]
    t = _get_slot(bundle, slot).clone()
    flat = (t if t.dtype == torch.uint8 else t.view(torch.uint8)).view(-1)
    i = int((flat != 0).nonzero()[0, 0])  # a byte that holds a real scale, not swizzle padding
    flat[i] = (int(flat[i]) + 8) % 256
    _set_slot(bundle, slot, t)
    return 4, "layers.4.ffn_out"


def fault_transposed_shard(bundle, golden, rng):
    """Layer 1's KDA q_proj shard on rank 0 written transposed (row-/column-major confusion;
    same bytes, so a non-square shard is transposed then read back in its own shape)."""
    e = _entries(bundle, "layers.1.self_attn.q_proj.weight", rank=0)[0]
    t = read_tensor(bundle, e)
    write_tensor(bundle, e, t.t().contiguous().reshape(t.shape))
    return 1, "layers.1.mixer_out"


def fault_router_bias(bundle, golden, rng):
    """The least-used expert of layer 2 gets +10 selection bias on every rank: misrouting."""
    vals, counts = _used(golden, 2)
    ex = int(vals[counts.argmin()])
    for e in _entries(bundle, "layers.2.block_sparse_moe.gate.e_score_correction_bias"):
        t = read_tensor(bundle, e)
        t[ex] += 10.0
        write_tensor(bundle, e, t)
    return 2, "layers.2.router_ids"


def _perturb_layer(scale: float):
    def fault(bundle, golden, rng):
        base = rng.randrange(1 << 30)
        for e in _index(bundle):
            if ".layers.5.self_attn." in e["key"] and e["dtype"] in ("BF16", "F32"):
                # seeded by the key: a replicated tensor gets the same perturbation on every rank
                gen = torch.Generator().manual_seed(base ^ zlib.crc32(e["key"].encode()))
                t = read_tensor(bundle, e)
                write_tensor(bundle, e, (t.double() * (1 + scale * torch.randn(t.shape, generator=gen,
                                                                          dtype=torch.float64))).to(t.dtype))
        return 5, "layers.5.mixer_out"
    fault.__doc__ = f"Every BF16/F32 tensor of layer 5's KDA mixer × (1 + {scale:g}·N(0,1)) on every rank."
    return fault


# ---------------------------------------------------------------- faults (serving path)
# A serving engine's cache handling between decode steps, planted through the device's
# ``after_step`` hook on a clean bundle: the weights are right, the decode path is not.
SERVING_STEP = 4  # planted after this decode step (0-based); the greedy case decodes 16


def fault_kda_state_late(text):
    """A KDA layer's state (recurrent and conv) restored one step late: after decode step
    SERVING_STEP the engine puts back the state it had saved one step earlier."""
    layer = next(l for l in text.kda_layers if l >= 4)
    saved = {}

    def after_step(step, cache):
        s = cache.layers[layer]
        if step == SERVING_STEP - 1:
            saved["s"] = s.clone()
        elif step == SERVING_STEP:
            s.recurrent_HKV.copy_(saved["s"].recurrent_HKV)
            s.conv_3WP.copy_(saved["s"].conv_3WP)
    return after_step, (layer, f"decode.layers.{layer}.mixer_out")


def fault_mla_row_dropped(text):
    """One row of an MLA layer's latent cache lost (a page slot skipped): after decode step
    SERVING_STEP the row of the middle prompt token is gone and later steps attend without it."""
    layer = text.mla_layers[0]

    def after_step(step, cache):
        if step == SERVING_STEP:
            s = cache.layers[layer]
            j = s.length // 2
            kept = torch.cat([s.latent_SC[:j], s.latent_SC[j + 1:]]).clone()
            s.buffer_SC[: s.length - 1] = kept
            s.length -= 1
    return after_step, (layer, f"decode.layers.{layer}.mixer_out")


SERVING_FAULTS = {"kda_state_late": fault_kda_state_late, "mla_row_dropped": fault_mla_row_dropped}


FAULTS = {"dt_bias": fault_dt_bias, "swap_experts": fault_swap_experts, "scale_byte": fault_scale_byte,
          "transposed_shard": fault_transposed_shard, "router_bias": fault_router_bias,
          "weight_1e-3": _perturb_layer(1e-3), "weight_1e-2": _perturb_layer(1e-2),
          "weight_1e-1": _perturb_layer(1e-1)}
ALL_FAULTS = [*FAULTS, *SERVING_FAULTS]


# ---------------------------------------------------------------- one job
def _cases_for(preset: str, seed: int, root: Path) -> Path:
    """The shipped cases; for a trained preset and seed > 0, seeded prompts."""
    d = root / f"cases-{preset}-{seed}"
    if d.exists():
        return d
    d.mkdir(parents=True)
    for f in CASES.glob("*.yaml"):
        shutil.copy(f, d)
    if preset == "tiny-trained" and seed:
        from k3bundle.synth.tokenizer import load_corpus
        rng = random.Random(seed)
        sents = [s.strip() + "." for s in load_corpus().replace("\n", " ").split(". ") if 40 < len(s) < 200]
        g = yaml.safe_load((d / "greedy.yaml").read_text())
        i = rng.randrange(len(sents) - 2)
        g["prompt"] = " ".join(sents[i:i + 2])
        (d / "greedy.yaml").write_text(yaml.safe_dump(g))
        lc = yaml.safe_load((d / "long_context.yaml").read_text())
        lc["long_context"]["filler_seed"] = seed
        (d / "long_context.yaml").write_text(yaml.safe_dump(lc))
    return d


def worse(metric: str, v: float, than: float | None) -> bool:
    """Is ``v`` a worse value of ``metric`` than ``than`` (None: nothing yet)? (METRICS direction)"""
    return than is None or (v > than if METRICS.get(metric, "max") == "max" else v < than)


def summarise(rep, tol, taps: bool = False) -> dict:
    """Worst value per check key (mode/kind/metric) of one case report, and its verdict."""
    worst: dict[str, float] = {}
    for r in rep.results:
        for metric, v in r.values.items():
            if metric not in METRICS or not isinstance(v, float) or math.isnan(v):
                continue
            key = check_key(r.mode, r.tap, metric)
            if worse(metric, v, worst.get(key)):
                worst[key] = v
    for name, vals in rep.drift.items():
        key = check_key("state", name, "drift_nmse")
        if vals and worse("drift_nmse", max(vals), worst.get(key)):
            worst[key] = max(vals)
    ff = rep.first_failure
    out = {"case": rep.name, "status": rep.status, "checks": worst,
           "first_failure": None if ff is None else {"layer": ff.layer, "tap": ff.tap, "mode": ff.mode,
                                                     "metrics": sorted(ff.min_required)},
           "greedy": None if rep.greedy is None else {"matched": rep.greedy.matched, "total": rep.greedy.total,
                                                      "passed": rep.greedy.passed},
           "reason": rep.reason}
    if taps:  # every check's values, so a faulted run can be re-judged under other limits
        out["taps"] = [[r.mode, r.tap, {k: v for k, v in r.values.items() if isinstance(v, float)}]
                       for r in rep.results]
    return out


def added_noise_ratio(rep, golden: dict) -> float | None:
    """The worst ratio of a clean case's added NMSE to the goldens' own teacher-forced BF16 noise
    at the same tap (golden/noise.py): how far above the reference's rounding a device's
    teacher-forced arithmetic lands, what ``noise.added_factor`` must cover (None: no noise)."""
    from k3bundle.golden.noise import ADDED, noise_key
    worst = None
    for r in rep.results:
        ref = golden.get(noise_key("nmse", ADDED + r.tap)) if r.mode == "added" else None
        v = r.values.get("nmse")
        if ref is None or not isinstance(v, float) or float(np.asarray(ref).reshape(-1)[0]) <= 0:
            continue
        q = v / float(np.asarray(ref).reshape(-1)[0])
        worst = q if worst is None or q > worst else worst
    return worst


def _judge(bundle: Path, device: str, only: list[str] | None, after_step=None):
    from k3bundle.validate.devices import InProcess
    from k3bundle.validate.run import _case_arrays, judge_case, load_goldens
    from k3bundle.validate.device_options import open_device, weights_for
    inputs, inter, meta, tol = load_goldens(bundle / "validation")
    dev = open_device(bundle, device=device) if after_step is None else \
        InProcess(weights_for(bundle, device), device, after_step=after_step, source=bundle)
    names = [e["name"] for e in meta["cases"] if e.get("status") == "ok" and (only is None or e["name"] in only)]
    dev.prepare(bundle / "validation", names)
    kinds = {e["name"]: e["kind"] for e in meta["cases"]}
    reps = []
    for n in names:
        golden = _case_arrays(inter, n)
        reps.append(judge_case(n, kinds[n], golden, dev.case(n, golden, inputs[f"{n}/ids"]), tol))
    return reps, tol, inter


def run_job(job: dict) -> list[dict]:
    from k3bundle.convert import convert
    from k3bundle.golden.generate import generate_goldens
    from k3bundle.synth import write_synthetic
    torch.set_num_threads(job["threads"])
    root, preset, seed, layout = Path(job["root"]), job["preset"], job["seed"], job["layout"]
    t0 = time.time()
    ckpt = root / f"ckpt-{preset}-{0 if preset == 'tiny-trained' else seed}-{job['worker']}"
    if not ckpt.exists():
        write_synthetic(ckpt, preset=preset, seed=0 if preset == "tiny-trained" else seed, force=True)
    bundle = root / f"bundle-{preset}-{seed}-{layout}-{job['worker']}"
    shutil.rmtree(bundle, ignore_errors=True)
    convert(ckpt, layout, bundle, workers=1)
    generate_goldens(bundle, cases_dir=_cases_for(preset, seed, root / f"w{job['worker']}"),
                     tolerance=TOLERANCE_FOR.get(layout, "bf16"), long_tokens=job["long_tokens"],
                     device=job.get("golden_device", "cpu"))
    base = {k: job[k] for k in ("preset", "seed", "layout", "device")}
    if job.get("golden_device", "cpu") != "cpu":
        base["golden_device"] = job["golden_device"]
    records = []
    if job["clean"]:
        from k3bundle.validate.run import _case_arrays
        reps, tol, inter = _judge(bundle, job["device"], None)
        records += [{**base, "fault": None, **summarise(r, tol),
                     "added_noise_ratio": added_noise_ratio(r, _case_arrays(inter, r.name))} for r in reps]
    else:
        from k3bundle.golden.store import read_npz
        inter = read_npz(bundle / "validation" / "golden_intermediates.npz")
    for name in job["faults"]:
        if name in SERVING_FAULTS:
            from k3bundle.config import load_config
            hook, where = SERVING_FAULTS[name](load_config(bundle).text)
            reps, tol, _ = _judge(bundle, job["device"], ["greedy"], after_step=hook)
            records += [{**base, "fault": name, "planted": {"layer": where[0], "tap": where[1]},
                         **summarise(r, tol, taps=True)} for r in reps]
            continue
        fb = root / f"fault-{job['worker']}"
        shutil.rmtree(fb, ignore_errors=True)
        shutil.copytree(bundle, fb)
        where = FAULTS[name](fb, inter, random.Random(seed))
        if where is None:
            records.append({**base, "fault": name, "case": "greedy", "status": "n/a",
                            "reason": "no such tensor in this layout"})
            continue
        planted = {"layer": where[0], "tap": where[1]}
        try:
            reps, tol, _ = _judge(fb, job["device"], ["greedy"])
        except K3Error as e:  # refused before any arithmetic (e.g. replicas that differ): named, exit 2
            from k3bundle.executor.taps import layer_of
            records.append({**base, "fault": name, "planted": planted, "case": "greedy", "status": "refused",
                            "first_failure": {"layer": layer_of(str(e)), "tap": None, "mode": "refused"},
                            "reason": str(e)})
        else:
            records += [{**base, "fault": name, "planted": planted, **summarise(r, tol, taps=True)} for r in reps]
        shutil.rmtree(fb, ignore_errors=True)
    shutil.rmtree(bundle, ignore_errors=True)
    shutil.rmtree(ckpt, ignore_errors=True)
    for r in records:
        r["seconds"] = round(time.time() - t0, 1)
    return records


def _worker(args):
    job, out = args
    try:
        recs = run_job(job)
    except Exception as e:  # one failed job is recorded, not fatal to the run
        recs = [{**{k: job[k] for k in ("preset", "seed", "layout", "device")}, "fault": None,
                 "status": "error", "reason": f"{type(e).__name__}: {e}"}]
    with open(out, "a") as f:
        for r in recs:
            f.write(json.dumps(r) + "\n")
    return job, len(recs)


def _seeds(spec: str) -> list[int]:
    out = []
    for part in spec.split(","):
        a, _, b = part.partition("-")
        out += list(range(int(a), int(b or a) + 1))
    return out


def cmd_run(args) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    rec = args.out / "records.jsonl"
    done = set()
    if rec.exists():
        for line in rec.read_text().splitlines():
            r = json.loads(line)
            done.add((r["preset"], r["seed"], r["layout"], r["device"]))
    jobs = []
    for spec in args.preset:
        preset, _, seeds = spec.partition(":")
        for seed in _seeds(seeds or "0"):
            for layout in args.layout:
                if (preset, seed, layout, args.device) in done:
                    continue
                jobs.append({"root": str(args.out), "preset": preset, "seed": seed, "layout": layout,
                             "device": args.device, "long_tokens": args.long_tokens, "threads": args.threads,
                             "golden_device": args.golden_device,
                             "clean": not args.faults_only,
                             "faults": [] if args.no_faults else args.fault or ALL_FAULTS})
    for i, j in enumerate(jobs):
        j["worker"] = f"{j['preset']}-{j['seed']}-{j['layout']}-{j['device'].replace(':', '')}"  # unique dirs
    t0 = time.time()
    print(f"{len(jobs)} jobs, {args.workers} workers", flush=True)
    if args.workers <= 1:
        results = map(_worker, [(j, rec) for j in jobs])
    else:
        pool = mp.get_context("spawn").Pool(args.workers)
        results = pool.imap_unordered(_worker, [(j, rec) for j in jobs])
    for k, (job, n) in enumerate(results, 1):
        print(f"[{time.time() - t0:6.0f} s] {k}/{len(jobs)} {job['preset']}:{job['seed']} {job['layout']} "
              f"{job['device']}: {n} records", flush=True)


# ---------------------------------------------------------------- analysis
def load_records(paths: list[Path], seeds: list[int] | None) -> list[dict]:
    out = []
    for p in paths:  # plain or gzip (the committed records under tolerances/calibration/)
        raw = Path(p).read_bytes()
        for line in (gzip.decompress(raw) if str(p).endswith(".gz") else raw).decode().splitlines():
            r = json.loads(line)
            # records before 2026-12-01's serving-path run pooled every state's drift in one key
            r.get("checks", {}).pop("state/drift/drift_nmse", None)
            if seeds is None or r["seed"] in seeds:
                out.append(r)
    return out


def separation(records: list[dict]) -> dict[str, dict]:
    """Per check key: the clean worst (with the preset/device that set it) and, over faulted runs
    whose first failure is at the planted tap, the faulted best value of that check."""
    table: dict[str, dict] = {}
    for r in records:
        if r.get("status") in ("error", "n/a"):
            continue
        for key, v in r.get("checks", {}).items():
            metric = key.rsplit("/", 1)[1]
            t = table.setdefault(key, {"direction": METRICS.get(metric, "max"), "clean_worst": None,
                                       "clean_by": None, "clean_n": 0, "fault_best": None, "fault_by": None})
            if r["fault"] is None:
                t["clean_n"] += 1
                if worse(metric, v, t["clean_worst"]):
                    t["clean_worst"], t["clean_by"] = v, f"{r['preset']}:{r['seed']} {r['layout']} {r['device']} {r['case']}"
    for r in records:  # faulted runs located at the planted tap: every check's value there
        if r["fault"] is None or r.get("status") != "fail" or not r.get("first_failure"):
            continue
        if r["first_failure"]["tap"] != r["planted"]["tap"]:
            continue
        exact_only = r["first_failure"].get("mode") in EXACT_MODES
        for mode, tap, values in r.get("taps", []):
            # a fault only the exact check sees is below the device-precision checks' reach: it
            # says nothing about where their limits separate clean from faulted
            if tap != r["planted"]["tap"] or (exact_only and mode not in EXACT_MODES):
                continue
            for metric, v in values.items():
                t = table.get(check_key(mode, tap, metric))
                if t is None or metric not in METRICS:
                    continue
                if t["fault_best"] is None or worse(metric, t["fault_best"], v):  # the least severe
                    t["fault_best"], t["fault_by"] = v, f"{r['fault']} {r['preset']}:{r['seed']} {r['layout']}"
    return table


def rates(records: list[dict], tol_of) -> dict:
    clean = [r for r in records if r["fault"] is None and r.get("status") in ("pass", "fail")]
    faulted = [r for r in records if r["fault"] is not None and r.get("status") in ("pass", "fail", "refused")]
    # located: the first failure is the planted layer and tap; a refusal names the tensor, so its layer
    located = [r for r in faulted if r["status"] in ("fail", "refused") and r.get("first_failure")
               and r["first_failure"]["layer"] == r["planted"]["layer"]
               and r["first_failure"]["tap"] in (r["planted"]["tap"], None if r["status"] == "refused" else "")]
    bundles = {(r["preset"], r["seed"], r["layout"], r["device"]) for r in clean}
    failed_bundles = {(r["preset"], r["seed"], r["layout"], r["device"]) for r in clean if r["status"] == "fail"}
    by_fault: dict[str, list[int]] = {}
    for r in faulted:
        d = by_fault.setdefault(r["fault"], [0, 0, 0])
        d[0] += 1
        d[1] += r["status"] in ("fail", "refused")
        d[2] += r in located
    ratios = [r["added_noise_ratio"] for r in clean if r.get("added_noise_ratio") is not None]
    return {"clean_cases": len(clean), "clean_case_failures": sum(r["status"] == "fail" for r in clean),
            "added_noise_ratio_worst": max(ratios, default=None),
            "clean_bundles": len(bundles), "clean_bundle_failures": len(failed_bundles),
            "false_alarms": [f"{r['preset']}:{r['seed']} {r['layout']} {r['device']} {r['case']}: "
                             f"{(r.get('first_failure') or {}).get('tap')} {r.get('reason', '')}"
                             for r in clean if r["status"] == "fail"],
            "faults": {k: {"runs": v[0], "detected": v[1], "located": v[2]} for k, v in by_fault.items()}}


def cmd_table(args) -> None:
    recs = load_records(args.records, _seeds(args.seeds) if args.seeds else None)
    table = separation(recs)
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=1, sort_keys=True))
    print("| check (mode/tap kind/metric) | clean runs | clean worst | set by | faulted best (located there) | margin |")
    print("|---|---|---|---|---|---|")
    for key in sorted(table):
        t = table[key]
        cw, fb = t["clean_worst"], t["fault_best"]
        if cw is None:
            continue
        if fb is None:
            margin = "–"
        elif t["direction"] == "max":
            margin = f"{fb / cw:.3g}×" if cw > 0 else "∞"
        else:
            margin = f"{(1 - fb) / (1 - cw):.3g}×" if cw < 1 else "∞"
        fbs = "–" if fb is None else f"{fb:.3g} ({t['fault_by']})"
        print(f"| {key} | {t['clean_n']} | {cw:.3g} | {t['clean_by']} | {fbs} | {margin} |")


def cmd_rates(args) -> None:
    recs = load_records(args.records, _seeds(args.seeds) if args.seeds else None)
    out = {}
    for device in sorted({r["device"] for r in recs}):
        out[device] = rates([r for r in recs if r["device"] == device], None)
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


GATED = ("nmse", "cosine", "kld_mean", "kld_p99", "top1", "expert_set", "drift_nmse")  # metrics with limits


def limit_of(tol, key: str) -> float | None:
    """The tolerance file's (fixed) limit for a check key, None where it has none."""
    mode, kind, metric = key.split("/")
    if mode in ("added", "inherited", "emulation", *EXACT_MODES):
        return tol.limits(mode, kind).get(metric)
    section = {"distribution": tol.logits, "router": tol.router, "state": tol.state}.get(mode, {})
    return section.get(metric)


def limit_rows(table: dict, tol) -> list[dict]:
    """Per gated check: the limit against the calibrated clean worst and the faulted best."""
    rows = []
    for key in sorted(table):
        t, metric = table[key], key.rsplit("/", 1)[1]
        limit = limit_of(tol, key)
        if metric not in GATED or limit is None or t["clean_worst"] is None:
            continue
        cw, fb = t["clean_worst"], t["fault_best"]
        clean_ok = not worse(metric, cw, limit) and cw != limit
        fault_ok = fb is None or worse(metric, fb, limit)
        # a free-running limit is a floor: validate widens it per golden with the reference's own
        # BF16 noise (golden/noise.py), so its evidence is the held-out false-alarm rate; so is an
        # added one, with the reference's own teacher-forced BF16 noise
        mode = key.split("/")[0]
        floor = ((mode in ("inherited", "distribution", "state") and tol.noise.get("factor", 0) > 0)
                 or (mode == "added" and tol.noise.get("added_factor", 0) > 0))
        rows.append({"key": key, "limit": limit, "clean_worst": cw, "clean_by": t["clean_by"], "fault_best": fb,
                     "fault_by": t["fault_by"], "between": clean_ok and fault_ok, "floor": floor,
                     "safety": ratio(metric, limit, cw), "headroom": None if fb is None else ratio(metric, fb, limit)})
    return rows


def calibration_yaml(table: dict, run: str) -> str:
    """The tolerance file's ``calibration`` section: the run, and each gated check's clean worst."""
    lines = ["calibration:                 # written by bench/calibrate.py limits --write: evidence, not limits",
             f"  run: {json.dumps(run)}", "  clean_worst:"]
    for key in sorted(table):
        cw = table[key]["clean_worst"]
        if key.rsplit("/", 1)[1] in GATED and cw is not None:
            lines.append(f"    {key}: {cw:.8g}")
    return "\n".join(lines) + "\n"


def cmd_limits(args) -> None:
    from k3bundle.golden.tolerances import load_tolerances, tolerance_path
    recs = load_records(args.records, _seeds(args.seeds) if args.seeds else None)
    path = tolerance_path(args.tolerance)
    layouts = [k for k, v in TOLERANCE_FOR.items() if v == path.stem]
    table = separation([r for r in recs if r["layout"] in layouts])
    tol = load_tolerances(path)
    print(f"{path} (layouts {', '.join(layouts)}; {len(recs)} records)\n")
    print("| check | limit | calibrated clean worst | limit / clean (safety) | faulted best | fault / limit | |")
    print("|---|---|---|---|---|---|---|")
    for r in limit_rows(table, tol):
        m = r["key"].rsplit("/", 1)[1]
        fb = "–" if r["fault_best"] is None else f"{show(m, r['fault_best'])} ({r['fault_by']})"
        hr = "–" if r["headroom"] is None else f"{r['headroom']:.3g}×"
        print(f"| {r['key']} | {show(m, r['limit'])} | {show(m, r['clean_worst'])} ({r['clean_by']}) | {r['safety']:.3g}× | "
              f"{fb} | {hr} | {'between' if r['between'] else 'floor, widened per golden' if r['floor'] else '**not between**'} |")
    if args.write:
        text = path.read_text()
        head = text.split("\ncalibration:", 1)[0].rstrip("\n") + "\n"
        path.write_text(head + calibration_yaml(table, args.run or "see tolerances/calibration/"))
        load_tolerances(path)  # what was written reads back
        print(f"\nwrote the calibration section of {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--preset", action="append", required=True, help="PRESET:SEEDS, e.g. tiny:0-9")
    r.add_argument("--layout", action="append", required=True)
    r.add_argument("--device", default="cpu")
    r.add_argument("--workers", type=int, default=1)
    r.add_argument("--threads", type=int, default=2, help="torch threads per worker")
    r.add_argument("--long-tokens", type=int, default=512)
    r.add_argument("--golden-device", default="cpu",
                   help="where the float32 goldens are made (cuda: for presets too slow for one CPU core)")
    r.add_argument("--no-faults", action="store_true")
    r.add_argument("--faults-only", action="store_true")
    r.add_argument("--fault", action="append", choices=ALL_FAULTS, help="only these faults (default: all)")
    r.set_defaults(fn=cmd_run)
    for name, fn in (("table", cmd_table), ("rates", cmd_rates)):
        t = sub.add_parser(name)
        t.add_argument("records", type=Path, nargs="+")
        t.add_argument("--seeds")
        t.add_argument("--json")
        t.set_defaults(fn=fn)
    lim = sub.add_parser("limits", help="each limit of a tolerance file against the calibrated clean worst and "
                                        "faulted best; --write records the clean worst in the file")
    lim.add_argument("records", type=Path, nargs="+")
    lim.add_argument("--tolerance", required=True, help="bf16, fp8 or a file")
    lim.add_argument("--seeds")
    lim.add_argument("--write", action="store_true")
    lim.add_argument("--run", help="the citation written into the file (seeds, presets, devices, date)")
    lim.set_defaults(fn=cmd_limits)
    args = ap.parse_args()
    args.fn(args)


if __name__ == "__main__":
    main()
