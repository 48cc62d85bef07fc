"""The one atomic write and the one file hash (k3bundle.io.files)."""

from __future__ import annotations

import hashlib
import os
import stat

import pytest

from k3bundle.io import files
from k3bundle.io.files import atomic_output, is_temp_of, sha256_file, temp_path, write_atomic


def test_write_atomic_replaces_the_file(tmp_path):
    p = tmp_path / "a.json"
    p.write_bytes(b"old")
    write_atomic(p, b"new bytes")
    assert p.read_bytes() == b"new bytes"
    write_atomic(p, "text é\n")
    assert p.read_bytes() == "text é\n".encode("utf-8")
    assert os.listdir(tmp_path) == ["a.json"]


def test_a_failure_mid_write_leaves_the_old_file_and_no_temp(tmp_path):
    p = tmp_path / "a.json"
    p.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="disk on fire"):
        with atomic_output(p) as f:
            f.write(b"half of the new")
            raise RuntimeError("disk on fire")
    assert p.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["a.json"]


def test_a_failing_fsync_leaves_the_old_file_and_no_temp(tmp_path, monkeypatch):
    p = tmp_path / "a.json"
    p.write_bytes(b"old")

    def no_space(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(files.os, "fsync", no_space)
    with pytest.raises(OSError, match="No space"):
        write_atomic(p, b"new")
    assert p.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["a.json"]


def test_the_file_and_then_its_folder_are_fsynced(tmp_path, monkeypatch):
    synced: list[str] = []
    real = os.fsync

    def spy(fd):
        mode = os.fstat(fd).st_mode
        synced.append("dir" if stat.S_ISDIR(mode) else "file")
        if stat.S_ISDIR(mode):  # by then the new name is in place
            synced.append((tmp_path / "a.json").read_bytes().decode())
        real(fd)

    monkeypatch.setattr(files.os, "fsync", spy)
    write_atomic(tmp_path / "a.json", b"new")
    assert synced == ["file", "dir", "new"]


def test_temp_names_are_hidden_unique_and_recognised(tmp_path):
    a, b = temp_path(tmp_path / "source.json"), temp_path(tmp_path / "source.json")
    assert a != b and a.parent == tmp_path and a.name.startswith(".")
    assert is_temp_of(a.name, "source.json") and not is_temp_of(a.name, "other.json")
    assert not is_temp_of("source.json", "source.json")


@pytest.mark.parametrize("size", [0, 1, files.HASH_CHUNK + 7])
def test_sha256_file_matches_hashlib(tmp_path, size):
    data = os.urandom(size)
    (tmp_path / "x").write_bytes(data)
    assert sha256_file(tmp_path / "x") == (hashlib.sha256(data).hexdigest(), size)
