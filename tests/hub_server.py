"""A small Hugging Face Hub look-alike for tests and benchmarks: 127.0.0.1, random port, no network.

It serves one directory as the model repo ``REPO_ID`` with one commit, reachable as the branch
``main``, the tag ``v1.0`` or its 40-hex sha, and implements just what ``huggingface_hub`` and
``k3bundle pull`` call (read from huggingface_hub 2.4's ``hf_api.py`` / ``file_download.py``):

* ``GET /api/models/{repo}`` and ``/api/models/{repo}/revision/{rev}``: ``id``, ``sha``,
  ``siblings`` (with ``size``/``blobId``/``lfs`` when ``?blobs=True``), ``cardData`` (README
  front matter), ``tags``; unknown repo/revision answer 404 with ``X-Error-Code``
  ``RepoNotFound`` / ``RevisionNotFound`` as the Hub does.
* ``GET /api/models/{repo}/tree/{rev}[/{path}]?recursive=&expand=``: entries
  ``{"type": "file", "path", "size", "oid": git blob sha1, "lfs": {"oid": sha256, "size",
  "pointerSize"}}`` (``lfs`` for ``*.safetensors``; their ``oid`` is the pointer file's blob id,
  as on the Hub) and ``{"type": "directory", ...}``; paginated with a ``Link: <…>; rel="next"``
  header when ``Faults.page_size`` is set.
* ``HEAD``/``GET /{repo}/resolve/{rev}/{path}``: plain files answer 200 with ``X-Repo-Commit``,
  ``ETag`` = blob sha1; LFS files answer 302 to ``http://localhost:PORT/cdn/{sha256}/{path}`` (another host,
  like the Hub's CDN) with ``X-Repo-Commit``,
  ``X-Linked-Etag`` = sha256 and ``X-Linked-Size``, like the Hub's redirect to its CDN.
  Both honour ``Range: bytes=a-[b]`` (206 + ``Content-Range``; 416 past the end).

``Faults`` (mutable at any time, read per request) injects what the tests need: a flipped byte
(same size), a persistent truncation, dropped connections, a short ``Content-Length``, a
throttle, an ignored ``Range``, error statuses, a wrong ``X-Repo-Commit``, and extra (hostile)
tree entries. ``requests`` logs every
request as ``(method, path, range)``.

Run it standalone (the benchmark does) with
``python -m tests.hub_server DIR [--repo-id ORG/NAME] [--port P]``; it prints its URL.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import socket
import socketserver
import sys
import threading
import time
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlsplit

REPO_ID = "moonshotai/Kimi-K3-synth"
TAG = "v1.0"


@dataclass
class Faults:
    flip: dict[str, int] = field(default_factory=dict)        # path -> offset whose byte is inverted
    truncate: dict[str, int] = field(default_factory=dict)    # path -> every response stops at this offset, then closes
    drop: dict[str, list] = field(default_factory=dict)       # path -> [body bytes, times]: close after that many bytes, `times` times
    short_length: dict[str, int] = field(default_factory=dict)  # path -> served as if it had this many bytes
    throttle: float | None = None                             # bytes/s per response (None: full speed)
    throttle_paths: tuple[str, ...] | None = None             # only these paths (None: all)
    ignore_range: bool = False                                # answer 200 with the whole file to a Range request
    extra_tree: list[dict] = field(default_factory=list)      # appended to tree listings
    page_size: int | None = None                              # tree pagination
    fail: dict[str, list] = field(default_factory=dict)       # path -> [HTTP status, times] on resolve
    commit_header: str | None = None                          # lie in X-Repo-Commit


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\x00" % len(data) + data).hexdigest()


@dataclass
class _File:
    path: str
    abspath: Path
    size: int
    sha256: str
    blob: str          # git blob id of the content (plain files) or of the LFS pointer (LFS files)
    lfs: bool
    pointer_size: int = 0


class HubRepo:
    """The files of one commit, hashed once at start (sha256, and git blob sha1 or LFS pointer)."""

    def __init__(self, directory: Path, repo_id: str = REPO_ID, lfs_globs: tuple[str, ...] = ("*.safetensors",)):
        self.dir = Path(directory)
        self.repo_id = repo_id
        self.files: dict[str, _File] = {}
        for p in sorted(self.dir.rglob("*")):
            if not p.is_file():
                continue
            rel = p.relative_to(self.dir).as_posix()
            h256, h1 = hashlib.sha256(), None
            lfs = any(fnmatchcase(rel, g) for g in lfs_globs)
            size = p.stat().st_size
            if not lfs:
                h1 = hashlib.sha1(b"blob %d\x00" % size)
            with open(p, "rb") as f:
                while b := f.read(1 << 20):
                    h256.update(b)
                    if h1:
                        h1.update(b)
            sha = h256.hexdigest()
            if lfs:
                pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha}\nsize {size}\n".encode()
                self.files[rel] = _File(rel, p, size, sha, git_blob_sha1(pointer), True, len(pointer))
            else:
                self.files[rel] = _File(rel, p, size, sha, h1.hexdigest(), False)
        listing = "".join(f"{f.path}\0{f.blob}\n" for f in self.files.values())
        self.commit = hashlib.sha1(listing.encode()).hexdigest()
        self.refs = {"main": self.commit, TAG: self.commit, self.commit: self.commit}
        self.card = _front_matter(self.dir / "README.md")

    def dirs(self) -> list[str]:
        out = set()
        for p in self.files:
            parts = p.split("/")[:-1]
            for i in range(1, len(parts) + 1):
                out.add("/".join(parts[:i]))
        return sorted(out)


def _front_matter(readme: Path) -> dict | None:
    try:
        text = readme.read_text()
    except OSError:
        return None
    if not text.startswith("---"):
        return None
    import yaml

    return yaml.safe_load(text[3:text.find("\n---", 3)])


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: "_Server"

    def log_message(self, *a):  # quiet
        pass

    # -- plumbing
    def _json(self, obj, status=200, headers=None):
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _error(self, status, code, msg):
        self._json({"error": msg}, status, {"X-Error-Code": code, "X-Error-Message": msg})

    def do_HEAD(self):
        self.do_GET()

    def do_GET(self):
        hub = self.server.hub
        u = urlsplit(self.path)
        segs = [unquote(s) for s in u.path.split("/")[1:]]
        q = {k: v[-1] for k, v in parse_qs(u.query).items()}
        self.server.requests.append((self.command, u.path, self.headers.get("Range")))
        try:
            if segs[:2] == ["api", "models"]:
                return self._api(hub, segs[2:], q)
            if segs and segs[0] == "cdn" and len(segs) >= 3:
                f = hub.files.get("/".join(segs[2:]))
                if f is None or f.sha256 != segs[1]:
                    return self._error(404, "EntryNotFound", "no such object")
                return self._send_file(f, {"ETag": f'"{f.sha256}"'})
            if len(segs) >= 5 and segs[2] == "resolve":
                return self._resolve(hub, "/".join(segs[:2]), segs[3], "/".join(segs[4:]))
            return self._error(404, "NotFound", "no such route")
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    # -- routes
    def _repo(self, hub, repo_id, rev):
        if repo_id != hub.repo_id:
            self._error(404, "RepoNotFound", "Repository not found")
            return None
        commit = hub.refs.get(rev)
        if commit is None:
            self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        return commit

    def _api(self, hub, segs, q):
        repo_id = "/".join(segs[:2])
        rest = segs[2:]
        if not rest or rest[0] == "revision":
            rev = rest[1] if len(rest) > 1 else "main"
            if self._repo(hub, repo_id, rev) is None:
                return
            blobs = q.get("blobs", "").lower() in ("1", "true")
            sib = []
            for f in hub.files.values():
                s = {"rfilename": f.path}
                if blobs:
                    s.update(size=f.size, blobId=f.blob)
                    if f.lfs:
                        s["lfs"] = {"sha256": f.sha256, "size": f.size, "pointerSize": f.pointer_size}
                sib.append(s)
            card = hub.card or {}
            tags = [f"license:{card['license']}"] if card.get("license") else []
            return self._json({"_id": "0" * 24, "id": hub.repo_id, "modelId": hub.repo_id,
                               "author": hub.repo_id.split("/")[0], "sha": hub.commit, "private": False,
                               "disabled": False, "gated": False, "downloads": 0, "likes": 0, "tags": tags,
                               "lastModified": "2026-01-01T00:00:00.000Z", "cardData": hub.card,
                               "siblings": sib})
        if rest[0] == "tree" and len(rest) >= 2:
            if self._repo(hub, repo_id, rest[1]) is None:
                return
            base = "/".join(rest[2:])
            recursive = q.get("recursive", "").lower() in ("1", "true")
            entries = []
            for d in hub.dirs():
                entries.append({"type": "directory", "oid": hashlib.sha1(d.encode()).hexdigest(), "size": 0,
                                "path": d})
            for f in hub.files.values():
                e = {"type": "file", "oid": f.blob, "size": f.size, "path": f.path}
                if f.lfs:
                    e["lfs"] = {"oid": f.sha256, "size": f.size, "pointerSize": f.pointer_size}
                entries.append(e)
            entries.extend(self.server.faults.extra_tree)

            def under(p):
                if base and not p.startswith(base + "/"):
                    return False
                rel = p[len(base) + 1:] if base else p
                return recursive or "/" not in rel

            entries = sorted((e for e in entries if under(e["path"])), key=lambda e: e["path"])
            size = self.server.faults.page_size
            start = int(q.get("cursor", 0))
            headers = {}
            if size and start + size < len(entries):
                host = self.headers.get("Host")
                nq = f"recursive={q.get('recursive', 'False')}&expand={q.get('expand', 'False')}&cursor={start + size}"
                headers["Link"] = f'<http://{host}{urlsplit(self.path).path}?{nq}>; rel="next"'
            page = entries[start:start + size] if size else entries
            return self._json(page, 200, headers)
        return self._error(404, "NotFound", "no such api route")

    def _resolve(self, hub, repo_id, rev, path):
        commit = self._repo(hub, repo_id, rev)
        if commit is None:
            return
        f = hub.files.get(path)
        if f is None:
            return self._error(404, "EntryNotFound", f"{path} does not exist on {rev}")
        with self.server.lock:
            bad = self.server.faults.fail.get(path)
            if bad and bad[1] > 0:
                bad[1] -= 1
                return self._json({"error": "injected"}, bad[0], {"Retry-After": "0"})
        commit = self.server.faults.commit_header or commit
        if f.lfs:
            self.send_response(302)
            # Another host name for the same server, like the Hub's CDN: huggingface_hub follows
            # same-host redirects for metadata but reads X-Linked-* from this response otherwise.
            port = self.server.server_address[1]
            self.send_header("Location", f"http://localhost:{port}/cdn/{f.sha256}/{quote(f.path)}")
            self.send_header("X-Repo-Commit", commit)
            self.send_header("X-Linked-Etag", f'"{f.sha256}"')
            self.send_header("X-Linked-Size", str(f.size))
            self.send_header("ETag", f'"{f.blob}"')
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        return self._send_file(f, {"X-Repo-Commit": commit, "ETag": f'"{f.blob}"'})

    def _send_file(self, f: _File, headers: dict):
        fl = self.server.faults
        size = fl.short_length.get(f.path, f.size)
        start, end, status = 0, size, 200
        rng = self.headers.get("Range")
        if rng and not fl.ignore_range:
            a, _, b = rng.removeprefix("bytes=").partition("-")
            start = int(a)
            end = min(int(b) + 1, size) if b else size
            if start >= size:
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{size}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            status = 206
        self.send_response(status)
        self.send_header("Content-Length", str(end - start))
        self.send_header("Accept-Ranges", "bytes")
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()
        if self.command == "HEAD":
            return
        stop = min(end, fl.truncate.get(f.path, end))
        drop = None
        with self.server.lock:
            d = fl.drop.get(f.path)
            if d and d[1] > 0:
                d[1] -= 1
                drop = start + d[0]
        if drop is not None:
            stop = min(stop, drop)
        rate = fl.throttle if (fl.throttle_paths is None or f.path in fl.throttle_paths) else None
        chunk = 16384 if rate else 1 << 20
        flip = fl.flip.get(f.path)
        pos = start
        with open(f.abspath, "rb") as fh:
            fh.seek(start)
            while pos < stop:
                b = fh.read(min(chunk, stop - pos))
                if not b:
                    break
                if flip is not None and pos <= flip < pos + len(b):
                    b = bytearray(b)
                    b[flip - pos] ^= 0xFF
                    b = bytes(b)
                self.wfile.write(b)
                pos += len(b)
                if rate:
                    time.sleep(len(b) / rate)
        if pos < end:  # cut the connection before Content-Length was reached
            self.wfile.flush()
            self.close_connection = True
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class _Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True

    def handle_error(self, request, client_address):  # client went away: not our business
        pass


class HubServer:
    """``with HubServer(dir) as hub: os.environ["HF_ENDPOINT"] = hub.url``."""

    def __init__(self, directory: Path, repo_id: str = REPO_ID, faults: Faults | None = None):
        self.repo = HubRepo(Path(directory), repo_id)
        self.faults = faults or Faults()
        self._srv = _Server(("127.0.0.1", 0), _Handler)
        self._srv.hub = self.repo
        self._srv.faults = self.faults
        self._srv.requests = []
        self._srv.lock = threading.Lock()
        self.url = f"http://127.0.0.1:{self._srv.server_address[1]}"
        self._thread: threading.Thread | None = None

    @property
    def requests(self) -> list:
        return self._srv.requests

    @property
    def commit(self) -> str:
        return self.repo.commit

    def reset(self) -> None:
        """Clear the faults (in place: the handler holds this object) and the request log."""
        fresh = Faults()
        for k in fresh.__dataclass_fields__:
            setattr(self.faults, k, getattr(fresh, k))
        self._srv.requests.clear()

    def start(self) -> "HubServer":
        self._thread = threading.Thread(target=self._srv.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True, name="hub-server")
        self._thread.start()
        return self

    def stop(self) -> None:
        self._srv.shutdown()
        self._srv.server_close()

    def __enter__(self) -> "HubServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def env(self, hf_home: Path) -> dict[str, str]:
        """Environment for a pull against this server: no network, no telemetry, a private HF_HOME."""
        return {"HF_ENDPOINT": self.url, "HF_HUB_OFFLINE": "0", "HF_HUB_DISABLE_TELEMETRY": "1",
                "HF_HOME": str(hf_home), "HF_TOKEN": "", "HF_HUB_DISABLE_XET": "1",
                "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("directory")
    ap.add_argument("--repo-id", default=REPO_ID)
    a = ap.parse_args(argv)
    srv = HubServer(Path(a.directory), a.repo_id).start()
    print(srv.url, flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        srv.stop()


if __name__ == "__main__":
    sys.exit(main())
