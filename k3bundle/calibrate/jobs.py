"""Calibration jobs: one (preset, seed, layout, device) each, run alone or in a pool.

A job synthesises the checkpoint (``tiny``/``small``: the seed draws the weights;
``tiny-trained``: one model, the seed draws the prompts: a greedy prompt of corpus sentences and
the long-context filler), converts it, makes float32 goldens (``golden_device``), then

- **clean**: judges the bundle on the device with every case and records, per case, the worst
  value of every check, the greedy result, the state drift and the verdict;
- **faulted**: for each fault of the catalogue (``faults.FAULTS``) judges its case on a copy of
  the bundle with the defect (a bundle fault) or on the clean bundle run wrongly (a device
  fault), and records the same plus where validate located the first failure and where the
  fault was planted.

The device may run a kernel backend (``kernels.backend.load``): then every run, clean and
faulted, is that backend's. Records are appended to ``records.jsonl`` as they are made (the clean
cases together, then each fault), so an interrupted run keeps what it measured and a rerun runs
only what is not recorded yet (a full-depth job judges 16 faults for most of an hour).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
import yaml

from k3bundle.calibrate.faults import fault as catalogue_fault
from k3bundle.calibrate.planted import DeviceSide
from k3bundle.calibrate.records import JOB_KEYS, added_noise_ratio, summarise
from k3bundle.calibrate.tolerance_for import tolerance_for
from k3bundle.errors import K3Error
from k3bundle.ops.contract import REFERENCE, Backend

RECORDS = "records.jsonl"
Log = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


def cases_for(preset: str, seed: int, root: Path) -> Path:
    """The shipped cases; for a trained preset and seed > 0, seeded prompts."""
    from k3bundle.golden.cases import default_cases_dir

    d = root / f"cases-{preset}-{seed}"
    if d.exists():
        return d
    d.mkdir(parents=True)
    for f in default_cases_dir().glob("*.yaml"):
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


def judge(bundle: Path, device: str, cases: list[str] | None, backend: str | None = None,
          side: DeviceSide | None = None):
    """Judge ``cases`` (None: every case) of ``bundle``'s goldens on the built-in device (with
    ``backend``'s kernels, and ``side``'s faults). Returns (case reports, the goldens' intermediates)."""
    from k3bundle.kernels.backend import load
    from k3bundle.validate.device_options import backend_label, weights_for, with_backend
    from k3bundle.validate.devices import InProcess
    from k3bundle.validate.run import _case_arrays, judge_case, load_goldens

    inputs, inter, meta, tol = load_goldens(bundle / "validation")
    kern = None
    if backend is not None:
        kern = load(backend)
        kern.setup(device)
    factory = weights_for(bundle, device)
    run = faulted_kernels(kern, side)
    if run is not None:
        factory = with_backend(factory, run)
    dev = InProcess(factory, backend_label(device, kern), after_step=side and side.after_step, source=bundle)
    names = [e["name"] for e in meta["cases"] if e.get("status") == "ok" and (cases is None or e["name"] in cases)]
    dev.prepare(bundle / "validation", names)
    kinds = {e["name"]: e["kind"] for e in meta["cases"]}
    reps = []
    for n in names:
        golden = _case_arrays(inter, n)
        reps.append(judge_case(n, kinds[n], golden, dev.case(n, golden, inputs[f"{n}/ids"]), tol))
    return reps, inter


def faulted_kernels(kern: Backend | None, side: DeviceSide | None) -> Backend | None:
    """The kernels the device runs: ``kern`` (None: the reference), with the layers a device
    fault gets wrong running its ops over ``kern``'s (None: the reference, no fault)."""
    if side is None or not side.kernels:
        return kern
    base = kern or REFERENCE
    return replace(base, layers={l: Backend(f"{base.name}, planted fault", {**base.ops, **ops})
                                 for l, ops in side.kernels.items()})


def _located(rec: dict) -> str:
    ff, planted = rec.get("first_failure") or {}, (rec.get("planted") or {}).get("tap")
    said = f"{rec.get('status')}, first failure {ff.get('tap')} ({ff.get('mode')})" if ff else rec.get("status", "")
    return f"planted {planted}; {said}" if planted else said


def run_job(job: dict, log: Log = _quiet, emit: Callable[[list[dict]], None] | None = None) -> list[dict]:
    """One job's records (see the module docstring for the keys of ``job``); ``emit`` is handed
    each batch of them as it is made (the clean cases, then each fault's)."""
    from k3bundle.convert import convert
    from k3bundle.golden.generate import generate_goldens
    from k3bundle.synth import write_synthetic
    from k3bundle.validate.run import _case_arrays

    torch.set_num_threads(job["threads"])
    root, preset, seed, layout = Path(job["root"]), job["preset"], job["seed"], job["layout"]
    backend = job.get("backend")
    t0 = time.time()
    trained = preset == "tiny-trained"
    ckpt = root / f"ckpt-{preset}-{0 if trained else seed}-{job['worker']}"
    if not ckpt.exists():
        log("synth")
        write_synthetic(ckpt, preset=preset, seed=0 if trained else seed, force=True)
    bundle = root / f"bundle-{preset}-{seed}-{layout}-{job['worker']}"
    shutil.rmtree(bundle, ignore_errors=True)
    log(f"convert {layout}")
    convert(ckpt, layout, bundle, workers=1)
    log("golden")
    generate_goldens(bundle, cases_dir=job.get("cases_dir") or cases_for(preset, seed, root / f"w{job['worker']}"),
                     tolerance=job.get("tolerance") or tolerance_for(layout), long_tokens=job["long_tokens"],
                     device=job.get("golden_device", "cpu"))
    base = {k: job[k] for k in JOB_KEYS}
    if job.get("golden_device", "cpu") != "cpu":
        base["golden_device"] = job["golden_device"]
    if backend is not None:
        base["backend"] = backend
    records = []

    def made(recs: list[dict]) -> None:
        for r in recs:
            r["seconds"] = round(time.time() - t0, 1)  # since the job started
        records.extend(recs)
        if emit is not None:
            emit(recs)

    log(f"goldens made in {time.time() - t0:.0f} s")
    if job["clean"]:
        log("clean: every case")
        reps, inter = judge(bundle, job["device"], None, backend)
        made([{**base, "fault": None, **summarise(r),
               "added_noise_ratio": added_noise_ratio(r, _case_arrays(inter, r.name))} for r in reps])
        log("clean: " + ", ".join(f"{r['case']} {r['status']}" for r in records))
    else:
        from k3bundle.golden.store import read_npz
        inter = read_npz(bundle / "validation" / "golden_intermediates.npz")
    for name in job["faults"]:
        recs = judge_fault(bundle, inter, name, job["device"], backend, root / f"fault-{job['worker']}", seed)
        made([{**base, **r} for r in recs])
        log(f"fault {name}: {_located(records[-1])}")
    shutil.rmtree(bundle, ignore_errors=True)
    if not job.get("keep_checkpoint"):
        shutil.rmtree(ckpt, ignore_errors=True)
    return records


def judge_fault(bundle: Path, inter: dict, name: str, device: str, backend: str | None, work: Path,
                seed: int) -> list[dict]:
    """Fault ``name`` of the catalogue judged on its case: on a copy of the clean ``bundle`` at
    ``work`` with the defect (a bundle fault; ``inter``: the goldens' intermediates, ``seed``
    seeds its draw) or on ``bundle`` run wrongly (a device fault). Returns its records, without
    the job's keys: the case's ``summarise`` with every check's values and where the fault was
    planted; ``status`` "n/a" where the goldens lack its case or the layout the tensor,
    "refused" where validate refused the bundle before any arithmetic (named, as exit 2 would)."""
    f = catalogue_fault(name)
    if f.case not in _case_names(bundle):
        return [{"fault": name, "case": f.case, "status": "n/a", "reason": f"the goldens have no case {f.case!r}"}]
    if f.kind == "device":
        from k3bundle.config import load_config
        side, where = f.plant(load_config(bundle).text)
        reps, _ = judge(bundle, device, [f.case], backend, side)
        return [{"fault": name, "planted": {"layer": where.layer, "tap": where.tap}, **summarise(r, taps=True)}
                for r in reps]
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(bundle, work)
    try:
        where = f.plant(work, inter, random.Random(seed))
        if where is None:
            return [{"fault": name, "case": f.case, "status": "n/a", "reason": "no such tensor in this layout"}]
        planted = {"layer": where.layer, "tap": where.tap}
        try:
            reps, _ = judge(work, device, [f.case], backend)
        except K3Error as e:  # refused before any arithmetic (e.g. replicas that differ): named, exit 2
            from k3bundle.executor.taps import layer_of
            return [{"fault": name, "planted": planted, "case": f.case, "status": "refused",
                     "first_failure": {"layer": layer_of(str(e)), "tap": None, "mode": "refused"}, "reason": str(e)}]
        return [{"fault": name, "planted": planted, **summarise(r, taps=True)} for r in reps]
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _case_names(bundle: Path) -> list[str]:
    from k3bundle.golden.store import read_meta, read_npz

    meta = read_meta(read_npz(bundle / "validation" / "golden_intermediates.npz"))
    return [e["name"] for e in meta.get("cases", []) if e.get("status") == "ok"]


def _job_id(job: dict) -> str:
    return f"{job['preset']}:{job['seed']} {job['layout']} {job['device']}"


def _append(out: Path, recs: list[dict]) -> None:
    with open(out, "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in recs))


def _worker(args):
    job, out, progress = args
    log = _quiet if progress is None else (lambda s: progress(f"  {_job_id(job)}: {s}"))
    try:
        recs = run_job(job, log, emit=lambda batch: _append(out, batch))
    except Exception as e:  # one failed job is recorded, not fatal to the run; what it made is kept
        recs = [{**{k: job[k] for k in JOB_KEYS}, "fault": None, "status": "error",
                 "reason": f"{type(e).__name__}: {e}"}]
        _append(out, recs)
    return job, recs


def recorded(records: Path) -> dict[tuple, set]:
    """Per (preset, seed, layout, device): what ``records`` already holds of that job — None for
    its clean cases, a fault's name for that fault. A job that ended in an error is run again
    from where its records stop."""
    done: dict[tuple, set] = {}
    if records.exists():
        for line in records.read_text().splitlines():
            r = json.loads(line)
            if r.get("status") != "error":
                done.setdefault(tuple(r[k] for k in JOB_KEYS), set()).add(r["fault"])
    return done


def make_jobs(out: Path, presets: list[tuple[str, list[int]]], layouts: list[str], device: str, faults: list[str],
              clean: bool = True, **options) -> list[dict]:
    """The jobs of a run, each with only what ``out/records.jsonl`` does not hold yet (its clean
    cases, its faults); ``options``: long_tokens, threads, golden_device, backend, tolerance,
    cases_dir (job keys)."""
    done = recorded(out / RECORDS)
    jobs = []
    for preset, seeds in presets:
        for seed in seeds:
            for layout in layouts:
                have = done.get((preset, seed, layout, device), set())
                todo, judge_clean = [f for f in faults if f not in have], clean and None not in have
                if not todo and not judge_clean:
                    continue
                job = {"root": str(out), "preset": preset, "seed": seed, "layout": layout, "device": device,
                       "clean": judge_clean, "faults": todo, "long_tokens": 512, "threads": 2, **options}
                job["worker"] = f"{preset}-{seed}-{layout}-{device.replace(':', '')}"  # unique dirs
                jobs.append(job)
    return jobs


def run_jobs(jobs: list[dict], out: Path, workers: int = 1, progress: Log = print) -> int:
    """Run ``jobs``, appending their records to ``out/records.jsonl``; one progress line per job
    (and per step of it with one worker). Returns the number of records written."""
    out.mkdir(parents=True, exist_ok=True)
    rec, t0, n = out / RECORDS, time.time(), 0
    progress(f"{len(jobs)} job(s), {workers} worker(s); records: {rec}")
    args = [(j, rec, progress if workers <= 1 else None) for j in jobs]  # steps: in this process only
    if workers <= 1:
        results = map(_worker, args)
    else:
        pool = mp.get_context("spawn").Pool(workers)
        results = pool.imap_unordered(_worker, args)
    for k, (job, recs) in enumerate(results, 1):
        n += len(recs)
        errors = [r["reason"] for r in recs if r.get("status") == "error"]
        progress(f"[{time.time() - t0:6.0f} s] {k}/{len(jobs)} {_job_id(job)}: {len(recs)} records"
                 + (f"; error: {errors[0]}" if errors else ""))
    if workers > 1:
        pool.close()
        pool.join()
    return n
