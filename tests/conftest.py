"""Shared fixtures: the released config and one synthetic tiny checkpoint per session."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from k3bundle.config import load_config, release_config_path

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def release_config():
    return load_config(release_config_path())


@pytest.fixture(scope="session")
def release_config_dict():
    return json.loads(release_config_path().read_text())


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    """A synth tiny checkpoint, seed 0, written once per test session."""
    from k3bundle.synth import write_synthetic

    out = tmp_path_factory.mktemp("ckpt") / "tiny"
    write_synthetic(out, preset="tiny", seed=0)
    return out


@pytest.fixture(scope="session")
def tiny_trained_ckpt(tmp_path_factory) -> Path:
    """``synth --preset tiny-trained`` (the shipped trained model), written once per test session."""
    from k3bundle.synth import write_synthetic

    out = tmp_path_factory.mktemp("ckpt") / "tiny-trained"
    write_synthetic(out, preset="tiny-trained")
    return out


@pytest.fixture(scope="session")
def multi_turn_goldens(tmp_path_factory, tiny_trained_ckpt) -> dict:
    """Goldens of the multi-turn case (turn boundaries, 100+ tokens: a chunk boundary inside) on a
    copy of the trained tiny checkpoint, made once per session for the serving-path tests:
    ``src`` (the checkpoint with ``validation/``), ``golden`` (the case's arrays), ``ids``."""
    import shutil

    from k3bundle.file_names import GOLDEN_INPUTS, GOLDEN_INTERMEDIATES
    from k3bundle.golden.generate import generate_goldens
    from k3bundle.golden.store import read_npz

    root = tmp_path_factory.mktemp("multi-turn")
    (root / "cases").mkdir()
    shutil.copy(REPO / "golden" / "cases" / "multi_turn.yaml", root / "cases")
    src = root / "ckpt"
    shutil.copytree(tiny_trained_ckpt, src)
    generate_goldens(src, cases_dir=root / "cases", noise=False)
    inter = read_npz(src / "validation" / GOLDEN_INTERMEDIATES)
    golden = {k.split("/", 1)[1]: v for k, v in inter.items() if k.startswith("multi_turn/")}
    ids = [int(i) for i in read_npz(src / "validation" / GOLDEN_INPUTS)["multi_turn/ids"]]
    return {"src": src, "golden": golden, "ids": ids}


def run_cli(*args: str, cwd: Path | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``python -m k3bundle ARGS`` in a subprocess, capturing text output."""
    e = dict(os.environ)
    e.pop("K3BUNDLE_DEBUG", None)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "k3bundle", *args], cwd=cwd, env=e,
                          capture_output=True, text=True, timeout=600)
