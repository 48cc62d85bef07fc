"""Image preprocessing (docs/vision.md): sizes, padding, normalisation, patch order, bicubic
resize, synthetic images and bad files, each against an oracle written here."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch
from PIL import Image

from k3bundle.media import MediaError, media_tokens, plan_resize
from k3bundle.media.image import chessboard, preprocess_array, preprocess_file, preprocess_image, resize
from k3bundle.media.synthetic import make_image, parse_spec

# --- sizes: the scale formula worked by hand ----------------------------------------------------
# scale = min(1, sqrt(65536 / (max(1, W//14) * max(1, H//14))), 7168/W, 7168/H); new = int(side * scale);
# padded = the next multiple of 28; grid = padded / 14; tokens = (H/28)(W/28).
HAND = [
    # W, H, new W, new H, padded W, padded H, tokens
    (56, 56, 56, 56, 56, 56, 4),  # within every budget: unchanged, 2x2 tokens
    (10, 10, 10, 10, 28, 28, 1),  # less than a patch: counted as 1x1 patch, padded to 28x28
    (2000, 1000, 2000, 1000, 2016, 1008, 72 * 36),  # 142*71 = 10,082 patches: no resize
    # 571*285 = 162,735 patches: scale sqrt(65536/162735) = 0.634599..., 8000*s = 5076.79, 4000*s = 2538.39
    (8000, 4000, 5076, 2538, 5096, 2548, 182 * 91),
    # 1024*7 patches fit, but the width is 1024 patches: scale 7168/14336 = 0.5 exactly
    (14336, 100, 7168, 50, 7168, 56, 256 * 2),
]


@pytest.mark.parametrize("w,h,nw,nh,pw,ph,tokens", HAND)
def test_sizes_match_hand_worked_examples(w, h, nw, nh, pw, ph, tokens):
    p = plan_resize(w, h)
    assert (p.new_width, p.new_height, p.padded_width, p.padded_height) == (nw, nh, pw, ph)
    assert p.grid_thw == (1, ph // 14, pw // 14)
    assert p.num_tokens == media_tokens(w, h) == tokens


def test_the_patch_budget_is_counted_on_the_original_so_tokens_can_pass_16384():
    # 4213 = 14*300 + 13: the budget sees 300x300 whole patches, scale = sqrt(65536/90000) = 0.85333...,
    # int(4213 * 0.85333) = 3595 -> padded 3612 = 129 merged blocks a side: 16,641 tokens (> 65536/4)
    s = math.sqrt(65536 / 90000)
    assert int(4213 * s) == 3595
    p = plan_resize(4213, 4213)
    assert (p.new_width, p.padded_width, p.num_tokens) == (3595, 3612, 129 * 129)


def test_sizes_hold_the_release_limits_over_a_sweep():
    # independent of the formula's rounding: never enlarged, each side <= 512 patches, padding < 28
    for w in (1, 13, 14, 27, 28, 29, 500, 3599, 7168, 7169, 9000, 30000):
        for h in (1, 14, 100, 4213, 7168, 20000):
            p = plan_resize(w, h)
            assert 1 <= p.new_width <= w and 1 <= p.new_height <= h
            assert p.padded_width // 14 <= 512 and p.padded_height // 14 <= 512
            assert 0 <= p.padded_width - p.new_width < 28 and 0 <= p.padded_height - p.new_height < 28
            assert p.padded_width % 28 == 0 and p.padded_height % 28 == 0


def test_bad_sizes_are_one_line():
    for w, h in ((0, 5), (5, -1), (2.5, 3), (True, 3)):
        with pytest.raises(MediaError, match="must be a positive integer"):
            plan_resize(w, h)


# --- padding and normalisation ------------------------------------------------------------------


def test_padding_is_minus_one_and_pixels_are_normalised():
    rng = np.random.default_rng(1)
    img = rng.integers(0, 256, (10, 10, 3), dtype=np.uint8)
    out = preprocess_array(img)
    assert out.grid_thw == (1, 2, 2) and out.num_tokens == 1 and out.size == (10, 10)
    assert out.patches.dtype == torch.float32 and tuple(out.patches.shape) == (4, 3, 14, 14)
    # reassemble the 28x28 canvas from the row-major patches: canvas[c, 14r + i, 14q + j]
    canvas = out.patches.reshape(2, 2, 3, 14, 14).permute(2, 0, 3, 1, 4).reshape(3, 28, 28).double()
    want = (img.astype(np.float64).transpose(2, 0, 1) / 255.0 - 0.5) / 0.5
    assert torch.allclose(canvas[:, :10, :10], torch.from_numpy(want), atol=1e-6)
    pad = torch.ones(3, 28, 28, dtype=torch.bool)
    pad[:, :10, :10] = False
    assert torch.equal(canvas[pad], torch.full((int(pad.sum()),), -1.0, dtype=torch.float64))


def test_patches_come_in_row_major_order():
    # a 3x5 grid of 14x14 patches (42x70 pixels, padded to 56x84: 4x6 patches), each a distinct colour
    rows, cols = 3, 5
    img = np.zeros((rows * 14, cols * 14, 3), dtype=np.uint8)
    colour = {}
    for r in range(rows):
        for q in range(cols):
            colour[r, q] = (10 * r + 2 * q, 200 - 7 * q, 40 + 30 * r)
            img[14 * r:14 * r + 14, 14 * q:14 * q + 14] = colour[r, q]
    out = preprocess_array(img)
    assert out.grid_thw == (1, 4, 6)
    for k in range(4 * 6):
        r, q = divmod(k, 6)
        rgb = colour.get((r, q), (0, 0, 0))  # outside the image: zero padding
        want = torch.tensor([(c / 255.0 - 0.5) / 0.5 for c in rgb], dtype=torch.float64)
        got = out.patches[k].double()
        assert torch.allclose(got, want[:, None, None].expand(3, 14, 14), atol=1e-6), (k, r, q)


# --- bicubic resize -------------------------------------------------------------------------------
# The released processor resizes with Pillow's BICUBIC (a = -0.5, kernel widened by the scale when
# shrinking). torch's bicubic with antialias=True is the same filter; Pillow stores the horizontal
# pass as uint8 before the vertical one, so the two agree to 1 level of 255 (values kept in 40..215
# so neither pass clips). Without antialias (what a GPU path may use) shrinking differs by far more.


@pytest.mark.parametrize("src,dst", [((97, 61), (40, 25)), ((200, 150), (71, 53)), ((64, 64), (64, 64))])
def test_resize_is_bicubic_with_antialias(src, dst):
    rng = np.random.default_rng(2)
    img = rng.integers(40, 216, (src[1], src[0], 3), dtype=np.uint8)
    got = np.asarray(resize(Image.fromarray(img), *dst)).astype(np.int64)
    t = torch.from_numpy(img.astype(np.float64)).permute(2, 0, 1)[None]
    ref = torch.nn.functional.interpolate(t, size=(dst[1], dst[0]), mode="bicubic", antialias=True,
                                          align_corners=False)
    ref = ref[0].permute(1, 2, 0).round().clamp(0, 255).numpy().astype(np.int64)
    assert np.abs(got - ref).max() <= 1
    if src != dst:
        plain = torch.nn.functional.interpolate(t, size=(dst[1], dst[0]), mode="bicubic", align_corners=False)
        plain = plain[0].permute(1, 2, 0).round().clamp(0, 255).numpy().astype(np.int64)
        assert np.abs(got - plain).max() > 10  # the oracle can tell the two filters apart


def test_large_image_goes_through_the_resize(tmp_path):
    # 7300 wide: the side limit scales by 7168/7300, int(7300 * s) = 7168, int(30 * s) = 29
    img = np.full((30, 7300, 3), 120, dtype=np.uint8)
    out = preprocess_array(img)
    assert (out.plan.new_width, out.plan.new_height) == (7168, 29)
    assert out.grid_thw == (1, 4, 512) and out.num_tokens == 2 * 256
    inside = out.patches.reshape(4, 512, 3, 14, 14).permute(2, 0, 3, 1, 4).reshape(3, 56, 7168)[:, :29]
    assert torch.allclose(inside.double(), torch.full_like(inside, 120 / 255 * 2 - 1).double(), atol=1e-6)


def test_transparent_pixels_land_on_the_chessboard():
    # fully transparent RGBA -> the release's background: 8-pixel squares, white (255) top left, grey 180
    rgba = Image.fromarray(np.zeros((20, 20, 4), dtype=np.uint8))
    out = preprocess_image(rgba)
    canvas = out.patches.reshape(2, 2, 3, 14, 14).permute(2, 0, 3, 1, 4).reshape(3, 28, 28)
    for y, x in ((0, 0), (0, 8), (8, 0), (8, 8), (19, 19), (17, 3)):
        v = 255 if (y // 8 + x // 8) % 2 == 0 else 180
        assert torch.allclose(canvas[:, y, x].double(), torch.full((3,), v / 255 * 2 - 1.0, dtype=torch.float64))
    assert chessboard(1, 9)[0, 8, 0] == 180


# --- files ------------------------------------------------------------------------------------------


def test_png_file_matches_the_array(tmp_path):
    rng = np.random.default_rng(3)
    img = rng.integers(0, 256, (33, 47, 3), dtype=np.uint8)
    Image.fromarray(img).save(tmp_path / "a.png")
    a, b = preprocess_file(tmp_path / "a.png"), preprocess_array(img)
    assert a.size == (47, 33) and torch.equal(a.patches, b.patches)


def _bad_files(tmp_path):
    (tmp_path / "text.png").write_text("this is not an image\n")
    (tmp_path / "empty.png").write_bytes(b"")
    Image.fromarray(np.zeros((64, 64, 3), dtype=np.uint8) + 7).save(tmp_path / "whole.png")
    data = (tmp_path / "whole.png").read_bytes()
    (tmp_path / "cut.png").write_bytes(data[: len(data) // 2])
    os.mkfifo(tmp_path / "fifo.png")
    (tmp_path / "dir.png").mkdir()
    return {"text.png": "not an image", "empty.png": "empty file", "cut.png": "corrupt or truncated",
            "fifo.png": "FIFO", "dir.png": "directory", "missing.png": "cannot read"}


def test_bad_files_are_one_line_naming_the_file(tmp_path):
    for name, words in _bad_files(tmp_path).items():
        with pytest.raises(MediaError) as e:
            preprocess_file(tmp_path / name)
        msg = str(e.value)
        assert str(tmp_path / name) in msg and words in msg and "\n" not in msg, msg


def test_an_image_that_cannot_be_made_rgb_is_one_line():
    with pytest.raises(MediaError, match=r"^pic\.png: mode La cannot be made RGB"):
        preprocess_image(Image.new("La", (4, 4)), "pic.png")


def test_array_input_is_checked():
    with pytest.raises(MediaError, match="uint8 \\[H, W, 3\\]"):
        preprocess_array(np.zeros((4, 4), dtype=np.uint8))


# --- synthetic images ---------------------------------------------------------------------------------


def test_checkerboard_of_the_image_case():
    img = make_image(parse_spec({"kind": "checkerboard", "width": 56, "height": 56}, "image.yaml"))
    assert img.dtype == np.uint8 and img.shape == (56, 56, 3)
    for y in range(56):
        for x in range(56):
            assert (img[y, x] == (255 if (y // 14 + x // 14) % 2 == 0 else 0)).all()
    out = preprocess_array(img)  # one patch per square: patches alternate +1 / -1 in row-major order
    assert out.grid_thw == (1, 4, 4)
    assert [float(out.patches[k].mean()) for k in range(16)] == [1.0 if (k // 4 + k % 4) % 2 == 0 else -1.0
                                                                  for k in range(16)]
    spec = parse_spec({"kind": "checkerboard", "width": 5, "height": 3, "square": 2}, "c.yaml")
    assert make_image(spec)[:, :, 0].tolist() == [[255, 255, 0, 0, 255]] * 2 + [[0, 0, 255, 255, 0]]


@pytest.mark.parametrize("spec,words", [
    ({"kind": "stripes", "width": 56, "height": 56}, "image.kind 'stripes' is not one of checkerboard"),
    ({"kind": "checkerboard", "width": 56, "height": 56, "colour": 3}, "unknown field image.colour"),
    ({"kind": "checkerboard", "width": 56}, "image.height is missing"),
    ({"kind": "checkerboard", "width": 0, "height": 56}, "image.width must be an integer from 1"),
    ({"kind": "checkerboard", "width": 56, "height": "56"}, "image.height must be an integer"),
    ([56, 56], "image must be a mapping"),
])
def test_bad_specs_name_the_case_file(spec, words):
    with pytest.raises(MediaError) as e:
        parse_spec(spec, "golden/cases/image.yaml")
    assert str(e.value).startswith("golden/cases/image.yaml: ") and words in str(e.value)
