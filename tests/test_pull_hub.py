"""``k3bundle pull REPO`` against a local Hub look-alike: pinning, verification, faults, resume.

Oracles are independent of the code under test: sha256 / git blob sha1 computed here with
hashlib over the served tree, byte equality of the pulled files, and the server's request log.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from k3bundle.pull import PullError, pull, read_source
from k3bundle.pull import download as dl
from tests.conftest import run_cli
from tests.hub_server import REPO_ID, TAG
from tests.pull_fixtures import (BIG, MARKER_NAME, SMALL, clean_pull, git_oid, hub, hub_tree,  # noqa: F401
                                 server, sha256_of)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _files(tree: Path) -> list[Path]:
    return sorted(p for p in tree.rglob("*") if p.is_file())


def _cli(hub, *args):
    return run_cli("pull", *args, env=hub.cli_env)


def _one_error(r, *needles):
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    assert "Traceback" not in r.stderr
    return lines[0]


class CountingHashlib:
    """Stands in for ``hashlib`` inside k3bundle.pull.download: counts bytes fed to sha256."""

    def __init__(self):
        self.sha256_bytes = 0

    def sha256(self, *a):
        outer, h = self, hashlib.sha256(*a)

        class H:
            def update(self, b):
                outer.sha256_bytes += len(b)
                h.update(b)

            def hexdigest(self):
                return h.hexdigest()

        return H()

    def sha1(self, *a):
        return hashlib.sha1(*a)


# ------------------------------------------------------------------ clean pull


def test_clean_pull_records_and_verifies_every_file(server, hub_tree, tmp_path):
    out = tmp_path / "k3"
    r = _cli(server, REPO_ID, "--revision", "main", "--out", str(out), "--json")
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""  # no progress bar without a terminal
    s = json.loads(r.stdout)
    src_files = _files(hub_tree)
    total = sum(p.stat().st_size for p in src_files)
    assert s["bytes"] == total and s["files"] == len(src_files) == s["listed"]
    assert s["actions"] == {"downloaded": len(src_files)}
    # each byte downloaded once and hashed once, nothing read back from disk
    assert s["bytes_downloaded"] == s["bytes_hashed"] == total and s["bytes_read"] == 0

    text = (out / "source.json").read_text()
    d = json.loads(text)
    assert text == json.dumps(d, indent=2, sort_keys=True) + "\n"
    assert set(d) >= {"schema_version", "k3bundle_version", "kind", "repo_id", "revision", "commit",
                      "license", "files"}
    assert (d["schema_version"], d["kind"], d["repo_id"], d["revision"]) == (1, "hub", REPO_ID, "main")
    assert d["commit"] == server.commit and d["license"] == "modified-mit" and d["complete"] is True
    paths = [f["path"] for f in d["files"]]
    assert paths == sorted(paths) == [p.relative_to(hub_tree).as_posix() for p in src_files]
    for f in d["files"]:
        assert set(f) == {"path", "size", "sha256", "lfs", "git_blob_sha1", "url"}
        src = hub_tree / f["path"]
        assert (out / f["path"]).read_bytes() == src.read_bytes()
        assert f["size"] == src.stat().st_size and f["sha256"] == sha256_of(src)
        assert f["lfs"] == f["path"].endswith(".safetensors")
        assert f["git_blob_sha1"] == (None if f["lfs"] else git_oid(src))
        assert f["url"] == f"{server.url}/{REPO_ID}/resolve/{server.commit}/{f['path']}"
    assert not list(out.rglob("*.part")) and not list(out.rglob("*.bad"))
    assert not (hub_tree.parent / MARKER_NAME).exists()  # repo code is data, never run
    assert read_source(out).files == read_source(out).files  # reader accepts what the writer wrote


def test_branch_tag_and_sha_pin_to_the_commit(server, tmp_path):
    server.faults.page_size = 3  # also walk the paginated tree listing
    got = {}
    for rev in ("main", TAG, server.commit):
        out = tmp_path / rev.replace("/", "_")
        r = pull(REPO_ID, out, revision=rev, include=["config.json", "extra/"])
        rec = read_source(out)
        assert rec.commit == server.commit and rec.revision == rev
        assert [f.path for f in rec.files] == ["config.json", "extra/notes.txt"] and rec.complete is False
        assert r.listed == len(server.repo.files) == 27
        got[rev] = [(f.path, f.sha256) for f in rec.files]
    assert got["main"] == got[TAG] == got[server.commit]
    # after resolving, every request names the sha, never the branch or tag
    after = [p for m, p, _ in server.requests if "/resolve/" in p or "/tree/" in p]
    assert after and all(server.commit in p for p in after)
    assert sum("/tree/" in p for p in after) == 3 * 10  # 27 files + 1 folder, 3 per page


def test_unknown_repo_and_revision(server, tmp_path):
    with pytest.raises(PullError, match=r"revision 'nope' not found"):
        pull(REPO_ID, tmp_path / "a", revision="nope")
    with pytest.raises(PullError, match=r"someone/else: repository not found"):
        pull("someone/else", tmp_path / "b")
    assert not (tmp_path / "a").exists()


# ------------------------------------------------------------------ corruption and truncation


@pytest.mark.parametrize("name,kind,via_cli", [(BIG, "sha256", True), (SMALL, "git blob sha1", False)])
def test_flipped_byte_is_detected_and_named(server, hub_tree, tmp_path, name, kind, via_cli):
    server.faults.flip[name] = 1234
    out = tmp_path / "k3"
    if via_cli:
        r = _cli(server, REPO_ID, "--out", str(out), "--workers", "3")
        line = _one_error(r, f"error: {name}: {kind} mismatch: got ", "the Hub records",
                          f"(file kept as {name}.bad)")
    else:
        with pytest.raises(PullError) as ei:
            pull(REPO_ID, out, workers=3)
        line = str(ei.value)
        assert line.startswith(f"{name}: {kind} mismatch: got ") and line.endswith(f"(file kept as {name}.bad)")
    expected = sha256_of(hub_tree / name) if kind == "sha256" else git_oid(hub_tree / name)
    assert expected[:12] in line
    assert not (out / name).exists() and not (out / "source.json").exists()
    bad = out / f"{name}.bad"
    assert bad.stat().st_size == (hub_tree / name).stat().st_size
    assert bad.read_bytes() != (hub_tree / name).read_bytes()
    # the server heals: a rerun fetches only that file and removes the stale .bad
    server.reset()
    res = pull(REPO_ID, out)
    assert res.summary()["actions"] == {"kept": 26, "downloaded": 1}
    assert not bad.exists() and (out / name).read_bytes() == (hub_tree / name).read_bytes()


def test_truncated_transfer_fails_then_resumes_hashing_each_byte_once(server, hub_tree, clean_pull, tmp_path,
                                                                      monkeypatch):
    size = (hub_tree / BIG).stat().st_size
    cut = 1_500_000
    server.faults.truncate[BIG] = cut
    out = tmp_path / "k3"
    r = _cli(server, REPO_ID, "--out", str(out), "--retries", "1")
    _one_error(r, f"error: {BIG}: transfer stopped at 1,500,000 of 4,097,536 bytes after 2 attempt(s)",
               f"partial kept as {BIG}.part, rerun to resume")
    assert not (out / BIG).exists() and not (out / "source.json").exists()
    assert (out / f"{BIG}.part").stat().st_size == cut
    assert (out / f"{BIG}.part").read_bytes() == (hub_tree / BIG).read_bytes()[:cut]

    server.reset()
    counting = CountingHashlib()
    monkeypatch.setattr(dl, "hashlib", counting)
    s = pull(REPO_ID, out).summary()
    assert s["actions"] == {"kept": 26, "resumed": 1}
    # the prefix on disk is read and hashed once, the rest streamed and hashed once
    assert s["bytes_read"] == cut and s["bytes_downloaded"] == size - cut
    assert counting.sha256_bytes == s["bytes_hashed"] == size
    assert ("GET", f"/cdn/{sha256_of(hub_tree / BIG)}/{BIG}", f"bytes={cut}-") in server.requests
    assert (out / "source.json").read_bytes() == (clean_pull / "source.json").read_bytes()


def test_short_content_length_is_refused(server, tmp_path):
    server.faults.short_length[SMALL] = 1000
    with pytest.raises(PullError, match=r"^config.json: the server announces 1,000 bytes \(Content-Length\), "
                                        r"the Hub records 4,008$"):
        pull(REPO_ID, tmp_path / "k3", include=[SMALL])


def test_dropped_connection_resumes_in_the_same_pull(server, hub_tree, clean_pull, tmp_path, monkeypatch):
    server.faults.drop[BIG] = [1_000_000, 2]  # the first two responses stop after 1 MB
    counting = CountingHashlib()
    monkeypatch.setattr(dl, "hashlib", counting)
    out = tmp_path / "k3"
    s = pull(REPO_ID, out, workers=4).summary()
    total = s["bytes"]
    assert s["actions"] == {"downloaded": 27}
    # no byte fetched twice, none read back, each hashed once (the hasher survives the retries)
    assert s["bytes_downloaded"] == s["bytes_hashed"] == counting.sha256_bytes == total
    assert s["bytes_read"] == 0 and s["bytes_discarded"] == 0
    ranges = [rg for m, p, rg in server.requests if p.endswith(BIG) and p.startswith("/cdn/")]
    assert ranges == [None, "bytes=1000000-", "bytes=2000000-"]
    assert (out / "source.json").read_bytes() == (clean_pull / "source.json").read_bytes()


def test_server_ignoring_range_restarts_the_file(server, hub_tree, tmp_path):
    out = tmp_path / "k3"
    out.mkdir()
    (out / f"{BIG}.part").write_bytes((hub_tree / BIG).read_bytes()[:300_000])
    server.faults.ignore_range = True
    s = pull(REPO_ID, out, include=[BIG]).summary()
    assert s["bytes_discarded"] == 300_000 and s["bytes_downloaded"] == s["bytes"]
    assert (out / BIG).read_bytes() == (hub_tree / BIG).read_bytes()


def test_bad_partial_prefix_is_refetched_once(server, hub_tree, tmp_path):
    out = tmp_path / "k3"
    out.mkdir()
    (out / f"{BIG}.part").write_bytes(b"\0" * 300_000)  # not the server's bytes
    s = pull(REPO_ID, out, include=[BIG]).summary()
    assert s["actions"] == {"downloaded": 1}
    assert (out / BIG).read_bytes() == (hub_tree / BIG).read_bytes()


def test_sigkill_mid_file_then_rerun_gives_identical_source_json(server, hub_tree, clean_pull, tmp_path):
    out = tmp_path / "k3"
    server.faults.throttle = 400_000
    server.faults.throttle_paths = (BIG,)
    env = {**os.environ, **server.cli_env}
    env.pop("K3BUNDLE_DEBUG", None)
    p = subprocess.Popen([sys.executable, "-m", "k3bundle", "pull", REPO_ID, "--out", str(out), "--workers", "2"],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    part = out / f"{BIG}.part"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not (part.exists() and part.stat().st_size > 200_000):
        time.sleep(0.05)
    os.kill(p.pid, signal.SIGKILL)
    p.wait(timeout=10)
    assert p.returncode == -signal.SIGKILL
    done = part.stat().st_size
    assert 200_000 < done < (hub_tree / BIG).stat().st_size
    assert not (out / BIG).exists() and not (out / "source.json").exists()

    server.reset()
    r = _cli(server, REPO_ID, "--out", str(out), "--json")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["actions"]["resumed"] == 1 and s["actions"].get("kept", 0) >= 1
    # this run hashed exactly the bytes that were not already verified: the kept files are not read
    state = json.loads((out / ".k3bundle-pull.json").read_text())["files"]
    kept = s["bytes"] - s["bytes_hashed"]
    assert s["bytes_hashed"] == s["bytes_read"] + s["bytes_downloaded"] and s["bytes_read"] >= done
    assert kept > 0 and len(state) == 27
    assert (out / "source.json").read_bytes() == (clean_pull / "source.json").read_bytes()


# ------------------------------------------------------------------ keeping, refusing, safety


def test_rerun_keeps_verified_files_and_recheck_rehashes(server, clean_pull, tmp_path, monkeypatch):
    out = tmp_path / "k3"
    pull(REPO_ID, out)
    s = pull(REPO_ID, out).summary()
    assert s["actions"] == {"kept": 27} and s["bytes_hashed"] == 0 and s["bytes_downloaded"] == 0
    s = pull(REPO_ID, out, recheck=True).summary()
    assert s["actions"] == {"verified": 27} and s["bytes_read"] == s["bytes_hashed"] == s["bytes"]
    # a verified file changed on disk (same size) is hashed again, found different, and left alone
    data = bytearray((out / BIG).read_bytes())
    data[10] ^= 1
    (out / BIG).write_bytes(bytes(data))
    with pytest.raises(PullError, match=rf"^{BIG}: already in .* with different content \(got .*, the Hub "
                                        r"records .*\); k3bundle does not overwrite it"):
        pull(REPO_ID, out)
    assert (out / BIG).read_bytes() == bytes(data)
    assert (out / "source.json").read_bytes() == (clean_pull / "source.json").read_bytes()


def test_existing_identical_file_is_adopted_after_one_read(server, hub_tree, tmp_path):
    out = tmp_path / "k3"
    out.mkdir()
    (out / SMALL).write_bytes((hub_tree / SMALL).read_bytes())
    s = pull(REPO_ID, out, include=[SMALL, "tiktoken.model"]).summary()
    assert s["actions"] == {"verified": 1, "downloaded": 1}
    assert s["bytes_read"] == (hub_tree / SMALL).stat().st_size


@pytest.mark.parametrize("bad", ["../evil", "/tmp/evil-abs", "a\\..\\evil", "sub/../../evil"])
def test_traversal_names_in_the_listing_are_refused(server, tmp_path, bad):
    server.faults.extra_tree.append({"type": "file", "oid": "0" * 40, "size": 5, "path": bad})
    out = tmp_path / "deep" / "k3"
    with pytest.raises(PullError, match=r"refusing this file name"):
        pull(REPO_ID, out)
    assert not (tmp_path / "deep" / "evil").exists() and not (tmp_path / "evil").exists()
    assert not out.exists()  # refused before anything was written


def test_traversal_name_refused_by_the_cli(server, tmp_path):
    server.faults.extra_tree.append({"type": "file", "oid": "0" * 40, "size": 5, "path": "../evil"})
    r = _cli(server, REPO_ID, "--out", str(tmp_path / "k3"))
    _one_error(r, "error: '../evil': refusing this file name: '..' component escapes the output directory")
    assert not (tmp_path / "evil").exists()


def test_symlinked_folder_in_out_is_not_written_through(server, tmp_path):
    out = tmp_path / "k3"
    out.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (out / "extra").symlink_to(elsewhere)
    with pytest.raises(PullError, match=r"^extra/notes.txt: refusing to write through a symlink"):
        pull(REPO_ID, out)
    assert list(elsewhere.iterdir()) == []


def test_foreign_source_json_in_out_is_not_replaced(server, tmp_path):
    out = tmp_path / "k3"
    out.mkdir()
    (out / "source.json").write_text('{"mine": true}\n')
    with pytest.raises(PullError, match=r"source.json: exists and was not written by k3bundle"):
        pull(REPO_ID, out, include=[SMALL])
    assert (out / "source.json").read_text() == '{"mine": true}\n'


def test_server_errors_are_retried_and_a_wrong_commit_is_refused(server, hub_tree, tmp_path):
    server.faults.fail[SMALL] = [503, 2]
    s = pull(REPO_ID, tmp_path / "a", include=[SMALL]).summary()
    assert s["actions"] == {"downloaded": 1}
    assert sum(p.endswith(f"/{SMALL}") for _, p, _ in server.requests) == 3
    server.faults.fail[SMALL] = [404, 1]
    with pytest.raises(PullError, match=rf"^{SMALL}: HTTP 404 from {server.url}/"):
        pull(REPO_ID, tmp_path / "b", include=[SMALL])
    server.faults.commit_header = "f" * 40
    with pytest.raises(PullError, match=rf"^{SMALL}: the Hub served commit f{{40}} for a request pinned to "
                                        rf"{server.commit}$"):
        pull(REPO_ID, tmp_path / "c", include=[SMALL])


def test_one_pull_at_a_time_per_folder(server, tmp_path):
    import fcntl

    out = tmp_path / "k3"
    out.mkdir()
    fd = os.open(out, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        with pytest.raises(PullError, match=r"another k3bundle pull is writing into this folder"):
            pull(REPO_ID, out, include=[SMALL])
    finally:
        os.close(fd)
    assert pull(REPO_ID, out, include=[SMALL]).summary()["actions"] == {"downloaded": 1}
