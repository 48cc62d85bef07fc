"""The checklist's MoonViT row and the vision tower's per-image roofline, against a hand count.

The oracle is arithmetic written here from the release's vision_config (docs/kimi-k3.md §1.3,
§3.9): hidden 1,024, 12 heads × 128 (qkv 1,536), MLP 4,096, 27 blocks, patch 14, merge 2 × 2,
projector 4,096 → 4,096 → 7,168; and the processor's size rule worked by hand for the image
(no resize below 65,536 patches, padding right and bottom to a multiple of 28).
"""

from __future__ import annotations

import json

import pytest

from k3bundle.checklist import make_checklist, to_markdown
from k3bundle.checklist.html import to_html
from k3bundle.checklist.vision import vision_shapes
from k3bundle.config import release_config_path

BF16 = 2
# 1,024 px is 73.1 patches: padded up to 37 × 28 = 1,036 px = 74 patches a side
SIDE_PATCHES, N, TOKENS = 74, 74 * 74, 37 * 37
Dv, HEADS, DH, Q, IV, BLOCKS, DM, D = 1024, 12, 128, 12 * 128, 4096, 27, 4 * 1024, 7168

HAND_FLOPS = {
    "patch_embed": N * 2 * Dv * (3 * 14 * 14),  # one [1024, 588] product per patch
    "attn_proj": BLOCKS * N * 2 * (3 * Q * Dv + Dv * Q),  # W_qkv [4608, 1024], W_o [1024, 1536]
    "attn_core": BLOCKS * HEADS * (2 * N * N * DH + 2 * N * N * DH),  # q kᵀ [N, N] and p v, every pair
    "mlp": BLOCKS * N * 2 * (IV * Dv + Dv * IV),  # fc0 [4096, 1024], fc1 [1024, 4096]
    "projector": TOKENS * 2 * (DM * DM + D * DM),  # W_p1 [4096, 4096], W_p2 [7168, 4096]
}
HAND_BYTES = {
    "patch_embed": Dv * 3 * 14 * 14 * BF16,
    "attn_proj": BLOCKS * (3 * Q * Dv + Dv * Q) * BF16,
    "mlp": BLOCKS * 2 * IV * Dv * BF16,
    "projector": (DM * DM + D * DM) * BF16,
}


@pytest.fixture(scope="module")
def b300():
    return make_checklist("b300-tp8", context=4096, batch=1)


def _q(rows, key):
    return next(q for q in rows if q.key == key).value


def test_hand_count_in_round_numbers():
    # cross-checks of the hand count itself: 4·N²·Q for the core; 2 FLOP per weight per row elsewhere
    assert HAND_FLOPS["attn_core"] == BLOCKS * 4 * N ** 2 * Q
    assert HAND_FLOPS["mlp"] == N * HAND_BYTES["mlp"]  # 2 FLOP per weight per patch; BF16: 2 bytes per weight
    assert sum(HAND_BYTES.values()) == 886_202_368  # docs/bring-up.md's 894,717,952 less pos emb and norms
    assert 8_388_608 + 2_048 + 27 * 2 * 2_048 + 14_336 == 894_717_952 - 886_202_368


def test_shapes_come_from_the_processors_size_rule(b300):
    s = vision_shapes(b300.plan)
    assert (s.padded, s.grid, s.patches, s.tokens) == ((1036, 1036), (74, 74), N, TOKENS)
    assert (s.hidden, s.heads, s.head_dim, s.mlp, s.blocks, s.merged, s.text) == (Dv, HEADS, DH, IV, BLOCKS, DM, D)
    # 2,000 × 1,000 px: 142 × 71 whole patches, no resize; padded to 2,016 × 1,008 = 144 × 72 patches
    w = vision_shapes(b300.plan, 2000, 1000)
    assert (w.padded, w.grid, w.patches, w.tokens) == ((2016, 1008), (72, 144), 72 * 144, 36 * 72)
    # 8,000 × 8,000 px: 571² whole patches > 65,536, scaled by √(65536/571²), 8,000 · 256/571 truncated to 3,586 px, padded
    # to 3,612 = 129 × 28: 258 × 258 patches
    big = vision_shapes(b300.plan, 8000, 8000)
    assert big.padded == (3612, 3612) and big.patches == 258 * 258


@pytest.mark.parametrize("target,peak", [("b300-tp8", 2.25e15), ("h200-tp16-ep16", 989.5e12),
                                         ("gb300-dep16", 2.5e15)])
def test_per_image_flops_bytes_and_bound_match_the_hand_count(target, peak, b300):
    cl = b300 if target == "b300-tp8" else make_checklist(target, context=4096, batch=1)
    v = cl.vision
    for row, want in HAND_FLOPS.items():
        assert _q(v.flops, f"vision_flops_{row}") == want, row
    for row, want in HAND_BYTES.items():
        assert _q(v.bytes, f"vision_bytes_{row}") == want, row
    flops, nbytes = sum(HAND_FLOPS.values()), sum(HAND_BYTES.values())
    assert _q(v.flops, "vision_flops_total") == flops and _q(v.bytes, "vision_bytes_total") == nbytes
    bw = cl.plan.layout.card.hbm_bandwidth_bytes_per_s
    assert v.t_compute.value == pytest.approx(flops / peak, rel=1e-12)
    assert v.t_memory.value == pytest.approx(nbytes / bw, rel=1e-12)
    assert v.bound.value == pytest.approx(max(flops / peak, nbytes / bw), rel=1e-12)
    assert v.bound.value == v.t_compute.value  # 9.45 TFLOP against 0.9 GB: compute-bound on every card


def test_the_moonvit_row_and_the_roofline_are_rendered(b300):
    row = next(k for k in b300.kernels if k.op == "moonvit_rope2d_attention")
    for part in ("1,024×1,024 px", "padded 1,036×1,036", "N = 74×74 = 5,476 patches", "q, k, v [5,476, 12, 128]",
                 "hidden 1,024, MLP 4,096, 27 blocks", "projector [1,369, 4,096] → 4,096 → 7,168",
                 f"{sum(HAND_FLOPS.values()) / 1e12:.2f} TFLOP per image"):
        assert part in row.shapes, (part, row.shapes)
    md = to_markdown(b300)
    section = md[md.index("## 2. Roofline"):md.index("## 3. Kernel coverage")]
    assert "### Vision tower and projector (per image)" in section
    t = sum(HAND_FLOPS.values()) / 2.25e15
    assert f"**time to encode one image ≥ {t * 1e3:,.3f} ms**" in section
    assert "27 × 4 × 5,476² × 1536" in section and "1,369 × 2·(4096·4096 + 7168·4096)" in section
    assert f"| {row.shapes} |" in md
    page = to_html(b300)
    assert "Vision tower and projector (per image)" in page and f"{t * 1e3:,.3f} ms" in page
    doc = json.loads(json.dumps(b300.to_dict()))
    vis = doc["roofline"]["vision"]
    assert (vis["patches"], vis["tokens"], vis["grid"]) == (N, TOKENS, [74, 74])
    assert vis["bound_s"] == pytest.approx(t, rel=1e-12)


def test_a_model_without_a_vision_tower_has_no_vision_bound(tmp_path):
    cfg = json.loads(release_config_path().read_text())
    del cfg["vision_config"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    cl = make_checklist("b300-tp8", config=tmp_path / "config.json", context=4096)
    assert cl.vision is None and cl.to_dict()["roofline"]["vision"] is None
    assert "Vision tower and projector" not in to_markdown(cl)
