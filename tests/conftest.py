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


def run_cli(*args: str, cwd: Path | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``python -m k3bundle ARGS`` in a subprocess, capturing text output."""
    e = dict(os.environ)
    e.pop("K3BUNDLE_DEBUG", None)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "k3bundle", *args], cwd=cwd, env=e,
                          capture_output=True, text=True, timeout=600)
