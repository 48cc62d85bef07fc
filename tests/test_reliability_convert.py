"""convert and pull under faults: a second run, links, a full disk at every step, kills, --force."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from k3bundle.convert import ConvertError, convert
from k3bundle.convert.journal import JOURNAL
from tests._bundles import bundle_for, file_hashes
from tests.faults import disk_full, run_cli_faulted

LAYOUT = "b300-tp8"
ENV = {**os.environ, "K3BUNDLE_SKIP_SPACE_CHECK": ""}
ENV.pop("K3BUNDLE_DEBUG", None)


@pytest.fixture(scope="module")
def reference(tiny_ckpt, tmp_path_factory) -> dict[str, str]:
    return file_hashes(bundle_for(LAYOUT, tiny_ckpt, tmp_path_factory))


def _slow_convert(tiny_ckpt, out: Path, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "k3bundle", "convert", str(tiny_ckpt), "--target", LAYOUT, "--out", str(out), *extra]
    return subprocess.Popen(cmd, env={**ENV, "K3BUNDLE_CONVERT_THROTTLE_S": "0.5"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _wait_for_units(out: Path, n: int) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if (out / JOURNAL).exists() and len((out / JOURNAL).read_text().splitlines()) > n:
            return
        time.sleep(0.05)
    raise AssertionError("the convert did not get going")


def _children(pid: int) -> list[int]:
    kids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    kids.append(int(d.name))
            except (OSError, IndexError, ValueError):
                pass
    return kids


def _gone(pids: list[int], within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not any(Path(f"/proc/{p}").exists() and "Z" not in Path(f"/proc/{p}/stat").read_text().split(")")[1][:3]
                   for p in pids):
            return True
        time.sleep(0.1)
    return False


def test_a_second_convert_is_refused_before_it_touches_anything(tiny_ckpt, tmp_path, reference):
    out = tmp_path / "out"
    first = _slow_convert(tiny_ckpt, out)
    try:
        _wait_for_units(out, 1)
        for force in (False, True):
            with pytest.raises(ConvertError, match="another k3bundle convert is writing this bundle"):
                convert(tiny_ckpt, LAYOUT, out, force=force)
        assert first.wait(timeout=300) == 0, first.stderr.read()
    finally:
        first.kill()
    assert file_hashes(out) == reference  # nothing of the first run was removed under it


def test_resume_never_writes_through_a_link(tiny_ckpt, tmp_path, reference):
    out = tmp_path / "out"
    r = run_cli_faulted(["convert", str(tiny_ckpt), "--target", LAYOUT, "--out", str(out)],
                        kill_at="k3bundle.convert.journal:Journal.record", when="after", nth=2)
    assert r.returncode == -signal.SIGKILL
    rank = out / "device_weights" / "rank-000"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "precious.safetensors").write_bytes(b"mine")
    shutil.rmtree(rank)
    rank.symlink_to(elsewhere)
    with pytest.raises(ConvertError, match="symbolic link"):
        convert(tiny_ckpt, LAYOUT, out)
    assert [p.name for p in elsewhere.iterdir()] == ["precious.safetensors"]
    assert (elsewhere / "precious.safetensors").read_bytes() == b"mine"
    rank.unlink()
    convert(tiny_ckpt, LAYOUT, out)
    assert file_hashes(out) == reference


@pytest.mark.parametrize("point,when", [("k3bundle.convert.journal:Journal.remove", "before"),
                                        ("k3bundle.convert.run:_write_final", "before")])
def test_a_kill_at_the_last_steps_leaves_a_resumable_bundle(tiny_ckpt, tmp_path, reference, point, when):
    out = tmp_path / "out"
    args = ["convert", str(tiny_ckpt), "--target", LAYOUT, "--out", str(out)]
    r = run_cli_faulted(args, kill_at=point, when=when)
    assert r.returncode == -signal.SIGKILL
    v = subprocess.run([sys.executable, "-m", "k3bundle", "verify", str(out)], env=ENV, capture_output=True,
                       text=True, timeout=300)
    assert v.returncode != 0 and "rerun the same convert command" in v.stdout + v.stderr
    r = run_cli_faulted(args)
    assert r.returncode == 0, r.stderr
    assert not (out / JOURNAL).exists() and file_hashes(out) == reference


def test_a_full_disk_at_any_write_is_one_line_and_resumable(tiny_ckpt, tmp_path, reference):
    out = tmp_path / "count"
    with disk_full(out, nth=None) as writes:
        convert(tiny_ckpt, LAYOUT, out)
    assert file_hashes(out) == reference
    total = writes.count
    for nth in sorted({1, 2, total // 2, total - 1, total}):  # the journal, a unit, the index, the manifest
        out = tmp_path / f"full-{nth}"
        with disk_full(out, nth=nth), pytest.raises(ConvertError, match="No space left on device"):
            convert(tiny_ckpt, LAYOUT, out)
        assert not (out / "manifest.json").exists()
        convert(tiny_ckpt, LAYOUT, out)  # space freed: the same command finishes
        assert file_hashes(out) == reference, nth
    r = run_cli_faulted(["convert", str(tiny_ckpt), "--target", LAYOUT, "--out", str(tmp_path / "cli")],
                        enospc_at=total, under=tmp_path / "cli")  # the manifest, through the CLI
    assert r.returncode == 2 and r.stderr.startswith("error: manifest.json: No space left"), r.stderr


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_workers_die_with_their_parent(tiny_ckpt, tmp_path, reference, sig):
    out = tmp_path / "out"
    p = _slow_convert(tiny_ckpt, out, "--workers", "2")
    try:
        _wait_for_units(out, 1)
        workers = _children(p.pid)
        assert workers
        os.kill(p.pid, sig)
        rc = p.wait(timeout=60)
        assert _gone(workers), "a worker outlived the convert"
        if sig == signal.SIGTERM:
            assert rc == 128 + signal.SIGTERM and "stopped by SIGTERM" in p.stderr.read()
            assert not list(out.rglob("*.k3tmp"))
    finally:
        p.kill()
    convert(tiny_ckpt, LAYOUT, out)  # not refused: no orphan holds the lock
    assert file_hashes(out) == reference


@pytest.mark.parametrize("nofile", [12, 16])
def test_workers_out_of_file_descriptors_end_the_run_in_one_line(tiny_ckpt, tmp_path, reference, nofile):
    """``ulimit -n 16`` and ``--workers 2``: EMFILE while the pool starts its workers or while they
    write; the run ends (no hang), one line, exit 2, the lock released, and a rerun resumes."""
    import resource

    out = tmp_path / "out"

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    r = subprocess.run([sys.executable, "-m", "k3bundle", "convert", str(tiny_ckpt), "--target", LAYOUT, "--out",
                        str(out), "--workers", "2"], env=ENV, capture_output=True, text=True, timeout=120,
                       preexec_fn=limit)
    assert r.returncode == 2, r.stderr
    assert "Too many open files" in r.stderr and r.stderr.strip().count("\n") == 0, r.stderr
    assert not (out / "manifest.json").exists()
    convert(tiny_ckpt, LAYOUT, out, workers=2)  # not refused: the lock was released
    assert file_hashes(out) == reference


def test_force_removes_only_what_the_bundle_lists(tiny_ckpt, tmp_path, tmp_path_factory, reference):
    out = tmp_path / "out"
    shutil.copytree(bundle_for(LAYOUT, tiny_ckpt, tmp_path_factory), out)
    (out / "notes.txt").write_text("mine")
    (out / "validation").mkdir()
    (out / "validation" / "hand-made.npz").write_bytes(b"golden")
    (out / "device_weights" / "my-extra").mkdir()
    convert(tiny_ckpt, LAYOUT, out, force=True)
    assert (out / "notes.txt").read_text() == "mine"
    assert (out / "validation" / "hand-made.npz").read_bytes() == b"golden"
    assert (out / "device_weights" / "my-extra").is_dir()
    mine = {"notes.txt", "validation/hand-made.npz"}
    assert {k: v for k, v in file_hashes(out).items() if k not in mine} == reference
    # a file of the user's where the new bundle would write is named, not overwritten
    (out / "manifest.json").unlink()
    (out / "config.json").write_text("my own config")
    for p in out.rglob("*.safetensors"):
        p.unlink()
    with pytest.raises(ConvertError, match="not empty and not a k3bundle bundle"):
        convert(tiny_ckpt, LAYOUT, out, force=True)
    assert (out / "config.json").read_text() == "my own config"


def _pulled(out: Path) -> dict[str, str]:
    """The pulled files and source.json (the pull's own state file records where it ran)."""
    from k3bundle.pull.paths import STATE_FILE

    return {k: v for k, v in file_hashes(out).items() if k != STATE_FILE}


def test_pull_under_a_full_disk_is_one_line_and_resumable(tiny_ckpt, tmp_path):
    from k3bundle.errors import K3Error
    from k3bundle.pull import pull

    clean = tmp_path / "clean"
    with disk_full(clean, nth=None) as writes:
        pull(str(tiny_ckpt), clean)
    for nth in sorted({1, writes.count // 2, writes.count}):
        out = tmp_path / f"full-{nth}"
        with disk_full(out, nth=nth), pytest.raises(K3Error, match="No space left"):
            pull(str(tiny_ckpt), out)
        pull(str(tiny_ckpt), out)
        assert _pulled(out) == _pulled(clean), nth
