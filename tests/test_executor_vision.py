"""The vision tower and projector (docs/kimi-k3.md §3.9, V1-V5) against a float64 transcription.

The oracle below is written in numpy from the equations, not from the module: per-patch dot
products for the convolution, bilinear resizing by its half-pixel formula, RoPE as complex
multiplication, attention image by image, merging by explicit (kh, kw) loops. Each quirk of the
released model has a test that fails if the executor did it the other way: the oracle is run
with the other choice and must disagree with the executor, while the true choice agrees.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from k3bundle.config import VisionConfig
from k3bundle.executor import POLICIES, SourceWeights
from k3bundle.executor.errors import ExecutorError
from k3bundle.executor.projector import merge
from k3bundle.executor.taps import vision_tap_names
from k3bundle.executor.vision import encode_images, pos_grid, time_term
from k3bundle.schema import Schema

BLOCK = ("vit.norm0", "vit.wqkv", "vit.wo", "vit.norm1", "vit.fc0", "vit.fc1")
GLOBAL = ("vit.patch_embed", "vit.pos_emb", "vit.final_norm", "proj.fc1", "proj.fc2", "proj.post_norm")
TRUE = dict(eps=2.0 ** -7, rope="col_even", resize="bilinear", proj_gelu="erf", mlp_gelu="tanh",
            pre_norm=False, per_image=True, time_when="t>1")


# ---- the oracle: numpy float64, straight from the equations -------------------------------

def _rms(x, w, eps):
    return w * x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)


def _gelu(x, form):
    if form == "tanh":
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
    return 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))


def _linear_1d(n_out, n_in):
    """[n_out, n_in] bilinear weights, half-pixel centres, source clamped at the edges."""
    m = np.zeros((n_out, n_in))
    for i in range(n_out):
        src = max((i + 0.5) * n_in / n_out - 0.5, 0.0)
        i0 = min(int(math.floor(src)), n_in - 1)
        i1, lam = min(i0 + 1, n_in - 1), src - math.floor(src)
        m[i, i0] += 1 - lam
        m[i, i1] += lam
    return m


def _resize(table, h, w, how):
    if how == "bicubic":  # the other choice, only to show it differs
        t = torch.from_numpy(table).permute(2, 0, 1)[None]
        return torch.nn.functional.interpolate(t, size=(h, w), mode="bicubic")[0].permute(1, 2, 0).numpy()
    if how == "align_corners":
        t = torch.from_numpy(table).permute(2, 0, 1)[None]
        return torch.nn.functional.interpolate(t, size=(h, w), mode="bilinear",
                                               align_corners=True)[0].permute(1, 2, 0).numpy()
    if how == "bilinear" and (h, w) == table.shape[:2]:
        return table
    return np.einsum("ia,jb,abd->ijd", _linear_1d(h, table.shape[0]), _linear_1d(w, table.shape[1]), table)


def _time(t, d):
    omega = 10000.0 ** (-np.arange(d // 2) / (d / 2))
    return np.concatenate([np.sin(np.arange(t)[:, None] * omega), np.cos(np.arange(t)[:, None] * omega)], 1)


def oracle(get, v: VisionConfig, patches, grids, **choice):
    c = {**TRUE, **choice}
    H, Dv = v.vt_num_attention_heads, v.vt_hidden_size
    dh = v.qkv_hidden_size // H
    out = {}
    # (V1) patch embedding: each output channel is a dot product with one 3×P×P filter
    x = np.einsum("nchw,dchw->nd", patches, get("vit.patch_embed"))
    pos, ang = [], []
    freq = 10000.0 ** (-4.0 * np.arange(dh // 4) / dh)
    for t, h, w in grids:
        p2 = _resize(get("vit.pos_emb"), h, w, c["resize"]).reshape(h * w, Dv)
        tt = _time(t, Dv) if (t > 1 or c["time_when"] == "always") else np.zeros((t, Dv))
        pos.append((p2[None] + tt[:, None]).reshape(t * h * w, Dv))
        rows, cols = np.divmod(np.arange(h * w), w)
        a = np.zeros((h * w, dh // 2))
        first, second = (cols, rows) if c["rope"] == "col_even" else (rows, cols)
        a[:, 0::2], a[:, 1::2] = np.outer(first, freq), np.outer(second, freq)
        ang.append(np.tile(a, (t, 1)))
    x = x + np.concatenate(pos)
    rot = np.exp(1j * np.concatenate(ang))[:, None, :]
    out["vision.patch_embed"] = x
    spans = [t * h * w for t, h, w in grids] if c["per_image"] else [len(x)]
    for b in range(v.vt_num_hidden_layers):
        W = {r: get(r, b) for r in BLOCK}
        qkv = (_rms(x, W["vit.norm0"], c["eps"]) @ W["vit.wqkv"].T).reshape(len(x), 3, H, dh)
        q, k, vv = qkv[:, 0], qkv[:, 1], qkv[:, 2]
        q = ((q[..., 0::2] + 1j * q[..., 1::2]) * rot)
        k = ((k[..., 0::2] + 1j * k[..., 1::2]) * rot)
        q = np.stack([q.real, q.imag], -1).reshape(len(x), H, dh)
        k = np.stack([k.real, k.imag], -1).reshape(len(x), H, dh)
        o, s0 = np.zeros((len(x), H, dh)), 0
        for n in spans:
            for hd in range(H):
                s = q[s0:s0 + n, hd] @ k[s0:s0 + n, hd].T / math.sqrt(dh)
                p = np.exp(s - s.max(1, keepdims=True))
                o[s0:s0 + n, hd] = (p / p.sum(1, keepdims=True)) @ vv[s0:s0 + n, hd]
            s0 += n
        x = x + o.reshape(len(x), H * dh) @ W["vit.wo"].T
        x = x + _gelu(_rms(x, W["vit.norm1"], c["eps"]) @ W["vit.fc0"].T, c["mlp_gelu"]) @ W["vit.fc1"].T
        out[f"vision.blocks.{b}.block_out"] = x
    x = _rms(x, get("vit.final_norm"), c["eps"])
    kh, kw = v.merge_kernel_size
    merged, s0 = [], 0
    for t, h, w in grids:
        img = x[s0:s0 + t * h * w].reshape(t, h, w, Dv).mean(0)
        for i in range(h // kh):
            for j in range(w // kw):
                merged.append([img[i * kh + a, j * kw + bb] for a in range(kh) for bb in range(kw)])
        s0 += t * h * w
    m = np.array(merged)
    out["vision.merger"] = m
    if c["pre_norm"]:  # K2.5's LayerNorm before the projector, only to show it differs
        m = (m - m.mean(-1, keepdims=True)) / np.sqrt(m.var(-1, keepdims=True) + v.projector_ln_eps)
    e = _gelu(m.reshape(len(m), -1) @ get("proj.fc1").T, c["proj_gelu"]) @ get("proj.fc2").T
    out["vision.projector"] = _rms(e, get("proj.post_norm"), v.projector_ln_eps)
    return out


# ---- weights: the tiny preset's checkpoint, and hand-built small ones ---------------------

def _file_reader(ckpt: Path):
    """Tensors straight from the safetensors files, by the schema's names."""
    schema = Schema(SourceWeights(ckpt).config)
    where = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]

    def get(role, block=None):
        name = schema.name(role, block)
        with safe_open(ckpt / where[name], "pt") as f:
            return f.get_tensor(name).double().numpy()
    return get


class HandWeights:
    """A minimal weight source: the interface ``encode_images`` asks of one."""

    def __init__(self, tensors, dtype="float64"):
        self.t, self.policy, self.device = tensors, POLICIES[dtype], torch.device("cpu")

    def vision_tensor(self, role, block=None):
        return self.t[(role, block)].to(self.policy.weight)


def _hand(seed=0):
    v = VisionConfig(vt_hidden_size=8, vt_intermediate_size=12, vt_num_hidden_layers=2, vt_num_attention_heads=2,
                     qkv_hidden_size=16, patch_size=2, init_pos_emb_height=4, init_pos_emb_width=4,
                     merge_kernel_size=[2, 2], mm_hidden_size=8, text_hidden_size=12)
    g = torch.Generator().manual_seed(seed)

    def r(*shape, std=None):
        fan = math.prod(shape[1:]) if len(shape) > 1 else 1
        return torch.randn(*shape, generator=g, dtype=torch.float64) * (std or fan ** -0.5)
    t = {("vit.patch_embed", None): r(8, 3, 2, 2), ("vit.pos_emb", None): r(4, 4, 8, std=0.5),
         ("vit.final_norm", None): 1 + 0.1 * r(8, std=1), ("proj.fc1", None): r(32, 32),
         ("proj.fc2", None): r(12, 32), ("proj.post_norm", None): 1 + 0.1 * r(12, std=1)}
    for b in range(2):
        t |= {("vit.norm0", b): 1 + 0.1 * r(8, std=1), ("vit.wqkv", b): r(48, 8), ("vit.wo", b): r(8, 16),
              ("vit.norm1", b): 1 + 0.1 * r(8, std=1), ("vit.fc0", b): r(12, 8), ("vit.fc1", b): r(8, 12)}
    return HandWeights(t), v, (lambda role, block=None: t[(role, block)].numpy())


def _patches(grids, p, seed=1):
    n = sum(t * h * w for t, h, w in grids)
    return torch.randn(n, 3, p, p, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _rel(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.fixture(scope="module")
def tiny(tiny_ckpt):
    W = SourceWeights(tiny_ckpt, dtype="float64")
    return W, W.config.vision, _file_reader(tiny_ckpt)


# the tiny table is 8×8: one image at exactly its size, one resized non-square, one two-frame clip
TINY_GRIDS = [(1, 8, 8), (1, 4, 6), (2, 6, 2)]
HAND_GRIDS = [(1, 4, 4), (1, 2, 6), (3, 2, 2)]


def _run(W, v, grids, **kw):
    taps = {}
    e = encode_images(W, v, _patches(grids, v.patch_size, **kw), grids, taps)
    return e, taps


def test_tiny_preset_matches_float64_transcription(tiny):
    W, v, get = tiny
    e, taps = _run(W, v, TINY_GRIDS)
    want = oracle(get, v, _patches(TINY_GRIDS, v.patch_size).numpy(), TINY_GRIDS)
    assert list(taps) == vision_tap_names(v)
    assert e.shape == (16 + 6 + 3, v.text_hidden_size) and e.dtype == torch.float64
    for name, value in want.items():
        assert _rel(taps[name], value) < 1e-12, name
    assert _rel(e, want["vision.projector"]) < 1e-12


def test_hand_built_weights_match_float64_transcription():
    W, v, get = _hand()
    e, taps = _run(W, v, HAND_GRIDS)
    want = oracle(get, v, _patches(HAND_GRIDS, 2).numpy(), HAND_GRIDS)
    for name, value in want.items():
        assert _rel(taps[name], value) < 1e-12, name


# ---- the quirks: the other choice must disagree -------------------------------------------

@pytest.mark.parametrize("other", [
    dict(eps=1e-6),  # blocks' norms declared without ε: finfo(bf16).eps = 2^-7, not a small ε
    dict(eps=1e-5),
    dict(rope="row_even"),  # the docstring's order (rows on the even pairs)
    dict(resize="bicubic"),  # the upstream default mode; K3 asks bilinear
    dict(resize="align_corners"),  # bilinear, but corner-aligned
    dict(proj_gelu="tanh"),  # the projector's GELU is exact erf ...
    dict(mlp_gelu="erf"),  # ... the tower MLP's is the tanh form
    dict(pre_norm=True),  # K2.5's projector pre-norm, absent in K3
    dict(per_image=False),  # attention across images
    dict(time_when="always"),  # time term (frame 0 = [0 ‖ 1]) on single-frame images
], ids=lambda d: "-".join(f"{k}={v}" for k, v in d.items()))
def test_quirk_done_the_other_way_disagrees(tiny, other):
    W, v, get = tiny
    e, _ = _run(W, v, TINY_GRIDS)
    patches = _patches(TINY_GRIDS, v.patch_size).numpy()
    assert _rel(e, oracle(get, v, patches, TINY_GRIDS)["vision.projector"]) < 1e-12
    assert _rel(e, oracle(get, v, patches, TINY_GRIDS, **other)["vision.projector"]) > 1e-6


def test_images_do_not_attend_to_each_other(tiny):
    W, v, _ = tiny
    grids = [(1, 4, 6), (1, 4, 4)]
    p = _patches(grids, v.patch_size)
    q = p.clone()
    q[24:] = -q[24:]  # change the second image only
    a, b = encode_images(W, v, p, grids), encode_images(W, v, q, grids)
    assert torch.equal(a[:6], b[:6])  # the first image's 6 tokens: unchanged, bit for bit
    assert not torch.allclose(a[6:], b[6:])


def test_time_term_only_for_clips():
    # t = 1: the table alone; t = 2: frame f adds [sin(f·ω) ‖ cos(f·ω)], frame 0 adds [0 ‖ 1]
    W, v, _ = _hand()
    table = W.t[("vit.pos_emb", None)]
    from k3bundle.executor.vision import position
    one = position(table, [(1, 4, 4)])
    two = position(table, [(2, 4, 4)])
    assert torch.equal(one, table.flatten(0, 1))
    assert torch.equal(two[:16], table.flatten(0, 1) + torch.cat([torch.zeros(4), torch.ones(4)]).double())
    assert not torch.equal(two[16:], two[:16])


def test_position_table_used_as_is_at_its_size_and_bilinear_otherwise(tiny):
    W, v, get = tiny
    table = W.vision_tensor("vit.pos_emb")
    assert torch.equal(pos_grid(table, 8, 8), table.flatten(0, 1))
    for h, w in [(4, 6), (10, 8), (2, 16)]:
        assert _rel(pos_grid(table, h, w), _resize(get("vit.pos_emb"), h, w, "bilinear").reshape(h * w, -1)) < 1e-13


def test_bfloat16_policy_stays_close_to_float64(tiny_ckpt, tiny):
    W64, v, _ = tiny
    e64, _ = _run(W64, v, TINY_GRIDS)
    e16, _ = _run(SourceWeights(tiny_ckpt, dtype="bfloat16"), v, TINY_GRIDS)
    e32, _ = _run(SourceWeights(tiny_ckpt, dtype="float32"), v, TINY_GRIDS)
    assert e16.dtype == torch.bfloat16 and e32.dtype == torch.float32
    assert _rel(e32, e64) < 1e-5
    assert 1e-5 < _rel(e16.double(), e64) < 0.05  # BF16 rounding is visible, not an error


# ---- bad input: one line naming what is wrong ---------------------------------------------

@pytest.mark.parametrize("grids,patches,msg", [
    ([(1, 3, 4)], 12, "not a multiple of the merge kernel"),
    ([(1, 4, 4)], 15, "hold 16"),
    ([(5, 2, 2)], 20, "more than init_pos_emb_time"),
    ([(1, 2, 1026)], 2052, "over 512"),
])
def test_bad_grids_are_one_line(tiny, grids, patches, msg):
    W, v, _ = tiny
    with pytest.raises(ExecutorError, match=msg):
        encode_images(W, v, torch.zeros(patches, 3, 14, 14), grids)


def test_unsupported_config_is_refused(tiny):
    W, v, _ = tiny
    with pytest.raises(ExecutorError, match="pos_emb_interpolation_mode is 'bicubic'"):
        encode_images(W, replace(v, pos_emb_interpolation_mode="bicubic"), torch.zeros(4, 3, 14, 14), [(1, 2, 2)])
    with pytest.raises(ExecutorError, match=r"patches have shape \[4, 3, 16, 16\]"):
        encode_images(W, v, torch.zeros(4, 3, 16, 16), [(1, 2, 2)])


# ---- a second reference where transformers' Kimi-K2.5 MoonViT shares the math --------------

def test_shared_pieces_match_transformers_kimi_k25(tiny):
    k25 = pytest.importorskip("transformers.models.kimi_k25.modeling_kimi_k25")
    from transformers.vision_utils import get_vision_interpolation_indices_and_weights
    W, v, _ = tiny
    table = W.vision_tensor("vit.pos_emb")
    # the fixed time table (V1): K2.5 keeps it with a zero row first
    cfg = type("C", (), dict(hidden_size=v.vt_hidden_size, pos_emb_time=4, pos_emb_height=8, pos_emb_width=8))
    ref_time = k25.Kimi_K25VisionPositionEmbeddings(cfg).compute_pos_embed()[1:]
    assert _rel(time_term(4, v.vt_hidden_size, torch.float64), ref_time.double()) < 1e-6  # theirs is float32
    # bilinear resizing (V1) as gather weights
    grid = torch.tensor([[1, 4, 6]])
    idx, wts = get_vision_interpolation_indices_and_weights(grid, 8, mode="bilinear", align_corners=False)
    ref = (table.flatten(0, 1)[idx] * wts.double()[..., None]).sum(1)
    assert _rel(pos_grid(table, 4, 6), ref) < 1e-6  # their weights are float32
    # the sd2_tpool merge (V4): mean over frames, (kh, kw) row-major in a token
    grids = [(2, 4, 6), (1, 2, 2)]
    x = torch.randn(52, v.vt_hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    ref_m = k25.Kimi_K25VisionModel.temporal_merge(None, x, torch.tensor(grids), 2, 2)
    assert _rel(merge(x, grids, (2, 2)), ref_m) < 1e-6  # pooled in float32 there


# ---- E0: the projector's rows take the <|media_pad|> positions ------------------------------

def test_image_rows_replace_the_placeholder_embeddings_in_order(tiny_ckpt):
    from k3bundle.executor import Executor, TapRecorder

    W = SourceWeights(tiny_ckpt, dtype="float64")
    pad = W.config.media_placeholder_token_id
    ids = [5, pad, pad, 7, pad, 9]
    media = torch.randn(3, W.config.text.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    rec = TapRecorder(names=["embed"])
    Executor(W, rec).prefill(ids, media=media)
    plain = W.embed(torch.tensor(ids))
    assert torch.equal(rec["embed"][[1, 2, 4]], media)  # in the order the images come
    assert torch.equal(rec["embed"][[0, 3, 5]], plain[[0, 3, 5]])
    with pytest.raises(ExecutorError, match="3 <\\|media_pad\\|> positions .* give 2 rows"):
        Executor(W).prefill(ids, media=media[:2])


def test_vision_taps_sort_before_the_embedding_and_are_placed_by_block():
    from k3bundle.executor.taps import forward_key
    from k3bundle.validate.findings import place

    forward = ["vision.patch_embed", "vision.blocks.0.block_out", "vision.blocks.2.block_out",
               "vision.blocks.10.block_out", "vision.merger", "vision.projector", "embed", "layers.0.mixer_out",
               "logits"]
    assert sorted(reversed(forward), key=forward_key) == forward
    assert place("vision.blocks.10.block_out") == "vision block 10, vision.blocks.10.block_out"
    assert place("vision.projector") == "vision tower, vision.projector"
