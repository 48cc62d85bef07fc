"""The command line's CPU policy (k3bundle/runtime.py): passive OpenMP wait, thread count, user wins."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from k3bundle import runtime
from k3bundle.errors import K3Error
from tests.conftest import REPO

POLICY_VARS = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME", "K3BUNDLE_THREADS")

# The CLI entry point exactly as the console script runs it, then what this process ended up with.
CLI_THEN_REPORT = r"""
import json, os, sys
sys.argv = ["k3bundle", "--version"]
from k3bundle.cli.app import main
try:
    main()
except SystemExit as e:
    assert not e.code, e.code
import torch
print(json.dumps({"threads": torch.get_num_threads(), "env": {k: os.environ.get(k) for k in %r}}))
""" % (POLICY_VARS,)


def _env(**set_vars: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in POLICY_VARS}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return {**env, **set_vars}


def _python(code_or_args: list[str], **set_vars: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *code_or_args], env=_env(**set_vars), capture_output=True, text=True,
                          timeout=120)


def _libgomp_display(stderr: str) -> dict[str, str]:
    """libgomp's own account of the settings it read when it was loaded (OMP_DISPLAY_ENV=VERBOSE)."""
    if "OPENMP DISPLAY ENVIRONMENT" not in stderr:
        pytest.skip("torch here does not run on libgomp")
    pairs = (line.strip().split(" = ", 1) for line in stderr.splitlines() if " = '" in line)
    return {k: v.strip("'") for k, v in pairs}


def test_wait_policy_is_set_when_the_user_set_none():
    env: dict[str, str] = {}
    runtime.prepare_environment(env)
    assert env == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "0", "KMP_BLOCKTIME": "0"}


@pytest.mark.parametrize("var,value", [("OMP_WAIT_POLICY", "ACTIVE"), ("GOMP_SPINCOUNT", "300000"),
                                       ("KMP_BLOCKTIME", "200")])
def test_a_wait_variable_the_user_set_leaves_all_of_them_alone(var, value):
    env = {var: value}
    runtime.prepare_environment(env)
    assert env == {var: value}


def test_thread_count_prefers_k3bundle_threads_then_omp_num_threads_then_the_cpus():
    assert runtime.choose_threads({"K3BUNDLE_THREADS": "3", "OMP_NUM_THREADS": "1"}, cpus=2) == (3, "K3BUNDLE_THREADS")
    assert runtime.choose_threads({"OMP_NUM_THREADS": "4"}, cpus=2) == (None, "OMP_NUM_THREADS")
    assert runtime.choose_threads({}, cpus=1) == (1, "available CPUs")
    assert runtime.choose_threads({}, cpus=2) == (2, "available CPUs")
    assert runtime.choose_threads({"K3BUNDLE_THREADS": " "}, cpus=1) == (1, "available CPUs")  # blank = unset


@pytest.mark.parametrize("bad", ["0", "-1", "two", "1.5"])
def test_a_bad_k3bundle_threads_is_one_line_error(bad):
    with pytest.raises(K3Error, match="K3BUNDLE_THREADS"):
        runtime.choose_threads({"K3BUNDLE_THREADS": bad}, cpus=2)
    r = _python(["-m", "k3bundle", "--version"], K3BUNDLE_THREADS=bad)
    assert r.returncode == 2 and r.stderr.startswith("error: K3BUNDLE_THREADS=") and r.stderr.count("\n") == 1


def test_available_cpus_is_within_the_affinity_mask():
    assert 1 <= runtime.available_cpus() <= len(os.sched_getaffinity(0))


@pytest.mark.parametrize("files,quota", [
    ({"cpu.max": "max 100000\n"}, None),
    ({"cpu.max": "150000 100000\n"}, 1.5),
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
    ({"cpu/cpu.cfs_quota_us": "200000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 2.0),
    ({}, None),
])
def test_cgroup_quota_v1_and_v2(tmp_path, files, quota):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert runtime.cgroup_cpu_quota(tmp_path) == quota


def test_cli_sets_passive_wait_before_openmp_is_loaded():
    r = _python(["-m", "k3bundle", "--version"], OMP_DISPLAY_ENV="VERBOSE")
    assert r.returncode == 0, r.stderr
    gomp = _libgomp_display(r.stderr)
    assert gomp["GOMP_SPINCOUNT"] == "0", gomp  # libgomp's default is 300000
    # the same interpreter without the command line keeps libgomp's default spinning
    plain = _libgomp_display(_python(["-c", "import k3bundle.executor"], OMP_DISPLAY_ENV="VERBOSE").stderr)
    assert plain["GOMP_SPINCOUNT"] == "300000", plain


def test_cli_keeps_the_users_wait_policy():
    r = _python(["-m", "k3bundle", "--version"], OMP_DISPLAY_ENV="VERBOSE", OMP_WAIT_POLICY="ACTIVE")
    gomp = _libgomp_display(r.stderr)
    assert gomp["OMP_WAIT_POLICY"] == "ACTIVE" and gomp["GOMP_SPINCOUNT"] != "0", gomp


def _cli_report(**set_vars: str) -> dict:
    import json

    r = _python(["-c", CLI_THEN_REPORT], **set_vars)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.splitlines()[-1])


def test_cli_thread_count_and_environment():
    got = _cli_report()
    assert got["threads"] == runtime.available_cpus() >= 1
    assert got["env"]["OMP_WAIT_POLICY"] == "PASSIVE" and got["env"]["OMP_NUM_THREADS"] is None  # children: own pick
    assert _cli_report(K3BUNDLE_THREADS="3")["threads"] == 3
    torch_reading = _python(["-c", "import torch; print(torch.get_num_threads())"], OMP_NUM_THREADS="1").stdout
    assert _cli_report(OMP_NUM_THREADS="1")["threads"] == int(torch_reading) == 1  # the user's value, untouched


def test_library_callers_keep_torchs_defaults():
    r = _python(["-c", "import os, torch, k3bundle.executor, k3bundle.validate.run; "
                       "print(torch.get_num_threads(), [k for k in %r if k in os.environ])" % (POLICY_VARS,)])
    assert r.returncode == 0, r.stderr
    default = _python(["-c", "import torch; print(torch.get_num_threads())"]).stdout.split()[0]
    assert r.stdout.split(" ", 1) == [default, "[]\n"]
