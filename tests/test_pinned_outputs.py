"""Behaviour pins: the bytes of every shipped layout's tiny bundle and the goldens' content hash.

These digests were recorded before a refactor of the convert and executor code (with
``bench/pin_outputs.py``) and must not move when code is reorganised. They are regression
pins, not correctness oracles: correctness is proven elsewhere (``verify --source`` reassembles
every pass-through byte; the codecs match the OCP MX spec and torchao; the executor matches
float64 references). A change that *intends* to alter bundle bytes or golden values must
update these digests and say why in its commit.

Golden values depend on torch's intra-op thread count (reduction order), so they are pinned
at one thread.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from tests._bundles import SHIPPED, bundles, one_torch_thread, single_threaded_torch  # noqa: F401

BUNDLE_DIGESTS = {
    "b200-tp8-pp2": "a3aabdfa3075701b546c015bf5d4ddbbcbc350393952a172b54cc3fee502a2c7",
    "b300-tp8": "096b75c5eec5b893aab3a04512919c906a67fcde92e334e435078fccd9b4a168",
    "gb300-dep16": "168e689b3ad4e86e8dd729bcd533d9e14fed08133668175c5ae44c1fc7901f47",
    "h200-tp16-ep16": "afb5d17ca65b3a5059b7cb5de233e88df9422622bd840ffd72e3961620ef7b23",
    "mi355x-tp8": "1959018aa3ad0822aadb52901f012709bd876534554d7d4b9bc6225112155ef6",
    "new-accelerator.example": "3c45c68c00370e42a71bb90c1a91097c4218436d436c71b7472bf61f5fe09a0c",
}
# synth tiny seed 0, goldens of the checkpoint with the long-context case at 256 tokens
GOLDEN_CONTENT_HASH_1_THREAD = "85516e13da23a8a762d7fe7573b04cdd931087778d1c2d5c3fdffffd2f6576e1"


def tree_digest(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        if p.is_file():
            h.update(p.relative_to(root).as_posix().encode() + b"\0")
            h.update(hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()


def test_every_shipped_layout_is_pinned():
    assert sorted(BUNDLE_DIGESTS) == sorted(SHIPPED)


@pytest.mark.parametrize("layout", SHIPPED)
def test_bundle_bytes_are_pinned(bundles, layout):
    assert tree_digest(bundles[layout]) == BUNDLE_DIGESTS[layout]


def test_golden_content_hash_is_pinned(tiny_ckpt, tmp_path):
    from k3bundle.golden.generate import generate_goldens

    with one_torch_thread():
        res = generate_goldens(tiny_ckpt, out=tmp_path / "g", long_tokens=256)
    assert res.content_hash == GOLDEN_CONTENT_HASH_1_THREAD
