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
    "b200-tp8-pp2": "55c8303f81c6ad6fdb298575995d6844c3b9de08c1cdf202da86f10b72428e24",
    "b300-tp8": "75235701d82dd335b9b974250fd9d252880a2a1046c487a62a1a3ccd0801aec3",
    "gb300-dep16": "99b9e7a49db11384c26b6c2299c200eded3ed2a802601ed68b3e4a72a48a3dda",
    "h200-tp16-ep16": "e3197e0b65508f814bc7d383d55473d9131ea3e2564880611c2c2d20ab9f0d65",
    "mi355x-tp8": "d1785d57c700a07f1741c8d45cb8913f1fe662a7b458bd52de3b33c4e4abc9bd",
    "new-accelerator.example": "afae000c4a39d9261d7b240cdd65ec99706be622850614fb95e6a4a16370b1d3",
}
# synth tiny seed 0, goldens of the checkpoint with the long-context case at 256 tokens: every
# array; every array but the per-step logit shift (added with the greedy noise rule; the earlier
# pin of every array, which must not move); and the float32 reference arrays alone (the BF16-noise
# arrays, golden/noise.py, were added after the reference was pinned; the reference did not change)
GOLDEN_CONTENT_HASH_1_THREAD = "52d52edc9d5fd691324df01dafe1b91d52d7b7fb2c7d9ef822d69d9500fb5fbb"
BEFORE_LOGIT_SHIFT_CONTENT_HASH_1_THREAD = "a516fb091776c9f475fc159646cea8e8f453e98a740263288e2a24b03731415f"
REFERENCE_CONTENT_HASH_1_THREAD = "85516e13da23a8a762d7fe7573b04cdd931087778d1c2d5c3fdffffd2f6576e1"


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
    from k3bundle.golden.store import content_hash, read_npz

    inter = read_npz(tmp_path / "g" / "golden_intermediates.npz")
    before = {k: v for k, v in inter.items() if k != "__meta__" and "/bf16_noise.logit_shift." not in k}
    assert content_hash(before) == BEFORE_LOGIT_SHIFT_CONTENT_HASH_1_THREAD
    reference = {k: v for k, v in inter.items() if k != "__meta__" and "/bf16_noise." not in k}
    assert content_hash(reference) == REFERENCE_CONTENT_HASH_1_THREAD
