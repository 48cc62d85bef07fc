"""Whole files, the one way every k3bundle writer and hasher does them.

An atomic write puts the bytes in a hidden temp file in the destination's own folder (a rename is
atomic only within one filesystem), fsyncs it, renames it over the destination and fsyncs the
folder so that the rename itself survives a crash. On any failure the temp file is removed and the
old destination, if any, is left untouched.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import secrets
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

HASH_CHUNK = 16 << 20
TEMP_SUFFIX = ".tmp"


def temp_path(path: str | os.PathLike) -> Path:
    """A fresh hidden name beside ``path`` for its temp file (unique, so writers never collide)."""
    path = Path(path)
    return path.with_name(f".{path.name}.{secrets.token_hex(4)}{TEMP_SUFFIX}")


def is_temp_of(name: str, final_name: str) -> bool:
    """Whether ``name`` is a temp file :func:`temp_path` makes for ``final_name``."""
    return name.startswith(f".{final_name}.") and name.endswith(TEMP_SUFFIX)


def remove_temps_of(folder: str | os.PathLike, final_names) -> list[str]:
    """Remove the temp files a killed writer left in ``folder`` for any of ``final_names`` (the
    next run of that writer cleans up after the last); the names removed. Links are never followed."""
    folder, gone = Path(folder), []
    if not folder.is_dir() or folder.is_symlink():
        return gone
    for p in sorted(folder.iterdir()):
        if any(is_temp_of(p.name, n) for n in final_names) and (p.is_symlink() or p.is_file()):
            discard(p)
            gone.append(p.name)
    return gone


def fsync_dir(directory: str | os.PathLike) -> None:
    """Make a rename in ``directory`` durable (best effort: some filesystems cannot fsync a folder)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def discard(tmp: str | os.PathLike) -> None:
    """Remove a temp file if it is there."""
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass


def publish(fd: int, tmp: str | os.PathLike, final: str | os.PathLike) -> None:
    """The finish of every atomic write: fsync the temp file's ``fd``, rename it over ``final``,
    fsync the folder. The caller still owns (and closes) ``fd``; on failure it discards ``tmp``."""
    os.fsync(fd)
    os.replace(tmp, final)
    fsync_dir(os.path.dirname(os.path.abspath(final)))


@contextmanager
def atomic_output(path: str | os.PathLike) -> Iterator[BinaryIO]:
    """A binary file that becomes ``path`` only if the ``with`` block finishes without an error."""
    tmp = temp_path(path)
    try:
        with open(tmp, "xb") as f:
            yield f
            f.flush()
            publish(f.fileno(), tmp, path)
    except BaseException:
        discard(tmp)
        raise


def write_atomic(path: str | os.PathLike, data: bytes | str) -> None:
    """Replace ``path`` with ``data`` atomically (str is written as UTF-8, newlines untranslated)."""
    with atomic_output(path) as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)


def sha256_file(path: str | os.PathLike) -> tuple[str, int]:
    """(sha256 hex, size) of a file, read once in chunks."""
    h, size = hashlib.sha256(), 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(HASH_CHUNK)
        view = memoryview(buf)
        while n := f.readinto(buf):
            h.update(view[:n])
            size += n
    return h.hexdigest(), size


def tree_digest(root: str | os.PathLike) -> str:
    """One sha256 for a folder: over (relative path, NUL, sha256 of the bytes) of every file in it,
    in path order, so two trees have the same digest exactly when they hold the same files."""
    root = Path(root)
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        if p.is_file():
            h.update(p.relative_to(root).as_posix().encode() + b"\0")
            h.update(bytes.fromhex(sha256_file(p)[0]))
    return h.hexdigest()


def link_in_path(root: str | os.PathLike, rel: str | os.PathLike) -> Path | None:
    """The first component of ``root/rel`` below ``root`` that is a symbolic link (or None).

    A writer that checks this before writing ``rel`` never writes outside ``root`` through a link
    planted inside it; ``root`` itself is the caller's choice and may be a link."""
    p = Path(root)
    for part in Path(rel).parts:
        p = p / part
        if p.is_symlink():
            return p
        if not p.exists():
            return None
    return None


_DRIVE = re.compile(r"^[A-Za-z]:")


def relpath_problem(name: object) -> str:
    """Why ``name`` is not a normalised relative POSIX path, or '' when it is one.

    The one rule for a file name read from a file (a repo's listing, a checkpoint index's
    ``weight_map``, every ``file`` of a bundle's index and manifest): ordinary components joined
    by ``/``, so that joined to the folder it is relative to, it names a file inside that folder."""
    if not isinstance(name, str) or name == "":
        return "empty file name" if name == "" else "not a string"
    if "\x00" in name:
        return "NUL byte in the name"
    if "\\" in name:
        return "backslash in the name (could be a Windows path separator)"
    if name.startswith("/") or _DRIVE.match(name):
        return "absolute path"
    parts = name.split("/")
    if ".." in parts:
        return "'..' component escapes the output directory"
    if any(p in ("", ".") for p in parts):
        return "empty or '.' path component"
    return ""


class NotRegularFile(OSError):
    """A FIFO, directory, device or socket where a regular file was expected."""


def file_kind(mode: int) -> str:
    """What an ``st_mode`` is, in words ("a FIFO", "a directory", ...)."""
    for test, kind in ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return kind
    return "not a regular file"


def open_regular(path: str | os.PathLike) -> int:
    """A read-only descriptor of ``path``, refusing anything but a regular file. Opened non-blocking
    so that a FIFO cannot hang the reader; the descriptor returned is blocking again."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise NotRegularFile(errno.EINVAL, f"is {file_kind(mode)}, not a regular file", os.fspath(path))
    os.set_blocking(fd, True)
    return fd
