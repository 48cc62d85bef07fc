"""Headless Chromium for page tests: the DOM after load, and a screenshot's non-white share.

Chromium is Debian's ``chromium`` package (``.ci/run`` installs it). On a developer's machine
without it the page tests skip, saying so; under CI (``CI=true``) they fail instead, so a green
CI run has always opened the pages. The PNG reader is the PNG specification's decoder for 8-bit RGB/RGBA, non-interlaced
images (the kind Chromium writes), with numpy for the row filters.
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import numpy as np
import pytest

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--disable-dev-shm-usage",
         "--no-first-run", "--disable-extensions", "--allow-file-access-from-files")


def chromium() -> str:
    exe = os.environ.get("K3BUNDLE_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("headless Chromium is not installed; CI must check the pages in a browser "
                        "(.ci/run installs Debian's chromium)")
        pytest.skip("headless Chromium is not installed (Debian: apt-get install chromium); the page is not "
                    "checked in a browser")
    return exe


def _run(args: list[str], tmp: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HOME": str(tmp)}  # a profile of its own, not the user's
    return subprocess.run([chromium(), *FLAGS, f"--user-data-dir={tmp / 'profile'}", *args], capture_output=True,
                          text=True, timeout=120, env=env)


def dump_dom(page: Path, tmp: Path) -> str:
    r = _run(["--dump-dom", page.resolve().as_uri()], tmp)
    assert r.returncode == 0 and "<html" in r.stdout, r.stderr[-2000:]
    return r.stdout


def screenshot(page: Path, out: Path, tmp: Path, size: str = "1280,2000") -> Path:
    r = _run([f"--screenshot={out}", f"--window-size={size}", page.resolve().as_uri()], tmp)
    assert r.returncode == 0 and out.is_file(), r.stderr[-2000:]
    return out


def _paeth(a: int, b: int, c: int) -> int:
    p = a + b - c
    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
    return a if pa <= pb and pa <= pc else b if pb <= pc else c


def read_png(path: Path) -> np.ndarray:
    """[height, width, channels] uint8 of an 8-bit RGB or RGBA PNG."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path}: not a PNG"
    i, idat, ihdr = 8, [], None
    while i < len(data):
        n, kind = struct.unpack(">I4s", data[i:i + 8])
        body = data[i + 8:i + 8 + n]
        if kind == b"IHDR":
            ihdr = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat.append(body)
        i += 12 + n
    w, h, depth, colour, _, _, interlace = ihdr
    assert depth == 8 and colour in (2, 6) and interlace == 0, f"{path}: unsupported PNG {ihdr}"
    bpp = 3 if colour == 2 else 4
    raw = np.frombuffer(zlib.decompress(b"".join(idat)), dtype=np.uint8).reshape(h, 1 + w * bpp)
    out = np.zeros((h, w * bpp), dtype=np.uint8)
    prev = np.zeros(w * bpp, dtype=np.int64)
    for y in range(h):
        f, line = raw[y, 0], raw[y, 1:].astype(np.int64)
        if f == 0:
            cur = line
        elif f == 1:  # Sub: running sum per channel
            cur = np.cumsum(line.reshape(w, bpp), axis=0).reshape(-1) % 256
        elif f == 2:  # Up
            cur = (line + prev) % 256
        else:  # Average, Paeth: each byte depends on the one to its left
            cur = np.zeros_like(line)
            lst, pv = line.tolist(), prev.tolist()
            res = [0] * len(lst)
            for x in range(len(lst)):
                a = res[x - bpp] if x >= bpp else 0
                res[x] = (lst[x] + ((a + pv[x]) // 2 if f == 3 else _paeth(a, pv[x], pv[x - bpp] if x >= bpp else 0))) % 256
            cur = np.array(res, dtype=np.int64)
        out[y] = cur
        prev = cur
    return out.reshape(h, w, bpp)


def ink(path: Path) -> float:
    """The share of pixels that are not (near) white."""
    px = read_png(path)[..., :3].astype(np.int32)
    return float((px.min(axis=-1) < 235).mean())
