"""Fixtures for the pull tests: a served synth tree, the local Hub server, a reference pull.

Imported by ``tests/test_pull*.py`` (``from tests.pull_fixtures import *``) so conftest.py stays
shared and untouched. No test here touches the network: ``HF_ENDPOINT`` points at 127.0.0.1.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

from tests.hub_server import REPO_ID, HubServer

MARKER_NAME = "k3bundle-pull-executed-repo-code"
BIG = "model-00002-of-000012.safetensors"   # an LFS shard of 4,097,536 bytes
SMALL = "config.json"                       # a plain git file


def sha256_of(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def git_oid(p: Path) -> str:
    data = p.read_bytes()
    return hashlib.sha1(b"blob %d\x00" % len(data) + data).hexdigest()


@pytest.fixture(scope="session")
def hub_tree(tiny_ckpt, tmp_path_factory) -> Path:
    """The synth tiny checkpoint plus what a real repo also has: a README with the license in its
    front matter, .gitattributes, a file in a subfolder, and a .py that would leave a marker file
    if anything ever executed it."""
    root = tmp_path_factory.mktemp("hubtree")
    tree = root / "repo"
    shutil.copytree(tiny_ckpt, tree)
    (tree / "README.md").write_text("---\nlicense: other\nlicense_name: modified-mit\n---\n# Kimi K3 (synth)\n")
    (tree / ".gitattributes").write_text("*.safetensors filter=lfs diff=lfs merge=lfs -text\n")
    (tree / "extra").mkdir()
    (tree / "extra" / "notes.txt").write_text("a file in a subfolder\n")
    marker = root / MARKER_NAME
    (tree / "modeling_side_effect.py").write_text(f"open({str(marker)!r}, 'w').write('executed')\n")
    return tree


@pytest.fixture(scope="session")
def hub(hub_tree, tmp_path_factory):
    """The local Hub serving ``hub_tree`` as REPO_ID; its environment applied for the session."""
    srv = HubServer(hub_tree, REPO_ID).start()
    env = srv.env(tmp_path_factory.mktemp("hf_home"))
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        srv.cli_env = env
        yield srv
    srv.stop()


@pytest.fixture
def server(hub):
    """The session server with clean faults and request log, cleaned again after the test."""
    hub.reset()
    yield hub
    hub.reset()


@pytest.fixture(scope="session")
def clean_pull(hub, tmp_path_factory) -> Path:
    """A reference pull of the whole repo at main (in-process, no faults)."""
    from k3bundle.pull import pull

    hub.reset()
    out = tmp_path_factory.mktemp("clean") / "k3"
    pull(REPO_ID, out, revision="main", workers=4)
    return out
