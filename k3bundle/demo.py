"""``k3bundle demo``: the whole chain on the embedded tiny model, in well under a minute.

synth tiny-trained → pull (local, hash every file) → plan b300-tp8 → convert → verify --source →
golden → validate (cpu) → checklist (when the command exists). Every step is the same library
call the command of that name makes; the demo only wires them and reports where each
artifact is. The long-context case is shortened (``long_tokens``) to keep the run short; the
test suite runs it at its full 8,192 tokens.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from k3bundle.provenance.verify import verify
from k3bundle.checklist import write_checklist
from k3bundle.convert import convert
from k3bundle.errors import K3Error
from k3bundle.file_names import (CHECKLIST, GOLDEN_INPUTS, MANIFEST, SIGNOFF_NAMES, SOURCE_RECORD, VALIDATION_DIR,
                                  signoff_run_dir)
from k3bundle.golden.generate import generate_goldens
from k3bundle.plan.report import plan_from
from k3bundle.pull import pull
from k3bundle.synth import write_synthetic
from k3bundle.tokenizer import load_tiktoken
from k3bundle.validate.report import discard_reports, publish_reports, run_key, start_run
from k3bundle.validate.run import validate
from k3bundle.validate.device_options import open_device

TARGET = "b300-tp8"
PRESET = "tiny-trained"  # a trained model: realistic numerics, and a continuation worth reading


@dataclass
class DemoStep:
    name: str
    seconds: float
    artifact: str
    detail: str


@dataclass
class DemoResult:
    out: Path
    steps: list[DemoStep] = field(default_factory=list)
    passed: bool = False
    continuation: str = ""  # the greedy case's float32 continuation, decoded


def greedy_continuation(golden_dir: Path, checkpoint: Path, case: str = "greedy") -> str:
    """The tokens the golden run chose after the ``case`` prompt, as text."""
    with np.load(golden_dir / GOLDEN_INPUTS, allow_pickle=False) as z:
        key = f"{case}/greedy_tokens"
        tokens = z[key].tolist() if key in z.files else []
    return load_tiktoken(checkpoint).decode(tokens)


def run_demo(out: str | Path, long_tokens: int = 1024, force: bool = False,
             say: Callable[[DemoStep], None] | None = None, device: str = "cpu") -> DemoResult:
    out = Path(out)
    if out.exists():
        if not force and any(out.iterdir()):
            raise K3Error(f"{out}: already exists and is not empty (pass --force to replace it)")
        shutil.rmtree(out)
    out.mkdir(parents=True)
    res = DemoResult(out)

    def step(name: str, artifact: Path | str, fn):
        t = time.monotonic()
        detail = fn()
        s = DemoStep(name, time.monotonic() - t, str(artifact), detail)
        res.steps.append(s)
        if say:
            say(s)

    synth, pulled, bundle = out / f"synth-{PRESET}", out / "checkpoint", out / f"bundle-{TARGET}"
    step("synth", synth, lambda: f"{write_synthetic(synth, preset=PRESET).tensors} tensors ({PRESET})")
    step("pull", pulled / SOURCE_RECORD,
         lambda: f"{len(pull(synth, pulled, workers=2).record.files)} files hashed once, {SOURCE_RECORD} written")
    step("plan", TARGET, lambda: f"{plan_from(TARGET, source=pulled).layout.parallel.tp} ranks of TP")
    step("convert", bundle, lambda: f"{convert(pulled, TARGET, bundle).files} files")
    def _verify():
        r = verify(bundle, source=pulled)
        if not r.ok:
            raise K3Error(f"{bundle}: verify failed: {r.problems[0]}")
        return f"{r.files} files re-hashed, {r.rederived_files} re-derived from the source, " \
               f"{r.reassembled_tensors} tensors reassembled byte for byte"

    step("verify", bundle / MANIFEST, _verify)
    def _golden():
        r = generate_goldens(bundle, long_tokens=long_tokens, device=device)
        res.continuation = greedy_continuation(r.out, pulled)
        return f"content hash {r.content_hash[:16]}; the greedy case continues: {res.continuation!r}"

    step("golden", bundle / VALIDATION_DIR, _golden)

    def _validate():
        run = start_run(bundle, device=device)
        try:
            rep = validate(bundle, open_device(bundle, device=device))
            files = publish_reports(rep, run, bundle)
        except BaseException:
            discard_reports(run.reports)  # as validate's command: no verdict outlives a failed run
            raise
        res.passed = rep.passed
        return ("PASS" if rep.passed else "FAIL") + f" ({files[1].name})"

    step("validate", bundle / signoff_run_dir(run_key(device)) / SIGNOFF_NAMES[1], _validate)
    step("checklist", bundle / CHECKLIST, lambda: write_checklist(TARGET, bundle=bundle, out=bundle / CHECKLIST))
    return res
