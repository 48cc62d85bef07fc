"""Synthetic checkpoints: release-faithful names, dtypes, layout; deterministic bytes.

The checks read the output with plain ``safetensors`` and ``json`` (not k3bundle's reader) and
compare against facts hand-copied from spec/kimi-k3.md §2.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from pathlib import Path

import pytest
import tiktoken
import torch
from safetensors import safe_open

from k3bundle.config import load_config
from k3bundle.synth import write_synthetic
from tests.conftest import run_cli

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]  # OCP MX v1.0 FP4 E2M1 magnitudes


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _all_tensors(ckpt: Path) -> dict[str, tuple[str, str, list[int]]]:
    out = {}
    for shard in sorted(ckpt.glob("model-*.safetensors")):
        header = _raw_header(shard)
        for k, v in header.items():
            if k != "__metadata__":
                out[k] = (shard.name, v["dtype"], v["shape"])
    return out


def _raw_header(path: Path) -> dict:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path, tiny_ckpt):
    again = write_synthetic(tmp_path / "again", preset="tiny", seed=0).out
    files = sorted(p.name for p in tiny_ckpt.iterdir())
    assert files == sorted(p.name for p in again.iterdir())
    for name in files:
        assert _sha(tiny_ckpt / name) == _sha(again / name), name
    other = write_synthetic(tmp_path / "other", preset="tiny", seed=1).out
    assert _sha(other / "model-00002-of-000012.safetensors") != _sha(tiny_ckpt / "model-00002-of-000012.safetensors")
    assert _sha(other / "config.json") == _sha(tiny_ckpt / "config.json")


def test_release_names_and_shapes(tiny_ckpt):
    cfg = json.loads((tiny_ckpt / "config.json").read_text())
    t = cfg["text_config"]
    D, L, E = t["hidden_size"], t["routed_expert_hidden_size"], t["moe_intermediate_size"]
    with safe_open(tiny_ckpt / "model-00004-of-000012.safetensors", "pt") as f:  # layer 3 (MLA)
        kv_a = f.get_tensor("language_model.model.layers.3.self_attn.kv_a_proj_with_mqa.weight")
        assert kv_a.dtype == torch.bfloat16
        assert list(kv_a.shape) == [t["kv_lora_rank"] + t["qk_rope_head_dim"], D]
    with safe_open(tiny_ckpt / "model-00002-of-000012.safetensors", "pt") as f:  # layer 1 (KDA, MoE)
        scale = f.get_tensor("language_model.model.layers.1.block_sparse_moe.experts.10.w2.weight_scale")
        packed = f.get_tensor("language_model.model.layers.1.block_sparse_moe.experts.10.w2.weight_packed")
        assert scale.dtype == torch.uint8 and list(scale.shape) == [L, E // 32]
        assert packed.dtype == torch.uint8 and list(packed.shape) == [L, E // 2]
        a_log = f.get_tensor("language_model.model.layers.1.self_attn.A_log")
        heads = t["linear_attn_config"]["num_heads"]
        assert a_log.dtype == torch.float32 and list(a_log.shape) == [128]
        assert torch.all(a_log[heads:] == 0) and torch.all(a_log[:heads] != 0)  # zero padding


def test_dtypes_follow_the_release(tiny_ckpt):
    f32_suffixes = ("A_log", "dt_bias", "conv1d.weight", "o_norm.weight", "e_score_correction_bias")
    for name, (_, dtype, _) in _all_tensors(tiny_ckpt).items():
        if ".experts." in name:
            assert dtype == "U8", name
        elif name.endswith(f32_suffixes):
            assert dtype == "F32", name
        else:
            assert dtype == "BF16", name


def test_index_and_shards(tiny_ckpt):
    index = json.loads((tiny_ckpt / "model.safetensors.index.json").read_text())
    tensors = _all_tensors(tiny_ckpt)
    assert {k: v[0] for k, v in tensors.items()} == index["weight_map"]
    itemsize = {"BF16": 2, "F32": 4, "U8": 1}
    total = 0
    for _, dtype, shape in tensors.values():
        n = itemsize[dtype]
        for s in shape:
            n *= s
        total += n
    assert index["metadata"]["total_size"] == total
    shards = sorted(set(index["weight_map"].values()))
    assert shards == [f"model-{i:05d}-of-000012.safetensors" for i in range(1, 13)]  # 9 layers + 3
    by_shard = {}
    for name, shard in index["weight_map"].items():
        by_shard.setdefault(shard, set()).add(name)
    # shard n holds layer n-1; then text globals, projector, vision (spec §2.1)
    assert all(".layers.2." in n for n in by_shard["model-00003-of-000012.safetensors"])
    assert "language_model.lm_head.weight" in by_shard["model-00010-of-000012.safetensors"]
    assert all(n.startswith("mm_projector.") for n in by_shard["model-00011-of-000012.safetensors"])
    assert all(n.startswith("vision_tower.") for n in by_shard["model-00012-of-000012.safetensors"])


def test_experts_in_lexicographic_order_and_contiguous(tiny_ckpt):
    header = _raw_header(tiny_ckpt / "model-00002-of-000012.safetensors")
    experts = sorted((v["data_offsets"][0], k) for k, v in header.items() if ".experts." in k)
    ids = []
    for _, k in experts:
        e = re.search(r"\.experts\.(\d+)\.", k).group(1)
        if not ids or ids[-1] != e:
            ids.append(e)
    assert ids == sorted(str(i) for i in range(16))  # "0", "1", "10", ..., "15", "2", ...
    assert ids[:3] == ["0", "1", "10"]
    assert len(experts) == 16 * 6  # each expert's six tensors sit together: one "page" per expert


def test_routed_experts_are_real_mxfp4(tiny_ckpt):
    with safe_open(tiny_ckpt / "model-00003-of-000012.safetensors", "pt") as f:
        stem = "language_model.model.layers.2.block_sparse_moe.experts.5.w1"
        packed = f.get_tensor(stem + ".weight_packed")
        scale = f.get_tensor(stem + ".weight_scale")
    # independent decode from the OCP table: low nibble = even column
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], -1).long()
    mag = torch.tensor(E2M1, dtype=torch.float64)[codes & 7]
    sign = torch.where(codes & 8 > 0, -1.0, 1.0).double()
    factor = torch.pow(2.0, scale.double() - 127).repeat_interleave(32, dim=1)
    w = sign * mag * factor
    fan_in = w.shape[1]
    assert abs(w.std().item() * fan_in**0.5 - 1) < 0.2  # N(0, 1/fan_in) draws, quantized
    assert len(torch.unique(codes)) == 16
    # FLOOR rule: every block's largest magnitude code is 4 or 6 (amax in [4, 8) * 2^X)
    block_max = (codes & 7).reshape(codes.shape[0], -1, 32).amax(-1)
    assert set(block_max.unique().tolist()) <= {6, 7}


def test_config_tokenizer_and_side_files(tiny_ckpt):
    cfg = load_config(tiny_ckpt)
    raw = json.loads((tiny_ckpt / "config.json").read_text())
    assert "quantization_config" in raw["text_config"] and "quantization_config" not in raw
    assert raw["text_config"]["linear_attn_config"]["full_attn_layers"] == [4, 8, 9]
    V = cfg.text.vocab_size
    # special tokens sit at the release's offsets from the end of the vocabulary (spec §4.1)
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (V - 256, V - 254, V - 1)
    assert cfg.media_placeholder_token_id == V - (163840 - 163605)
    ranks = {}
    import base64
    for line in (tiny_ckpt / "tiktoken.model").read_text().splitlines():
        tok, rank = line.split()
        ranks[base64.b64decode(tok)] = int(rank)
    assert len(ranks) == V - 256
    enc = tiktoken.Encoding("tiny", pat_str=r"\S+|\s+", mergeable_ranks=ranks,
                            special_tokens={"<|end_of_msg|>": V - 254})
    assert enc.decode(enc.encode("hello tensors")) == "hello tensors"
    tc = json.loads((tiny_ckpt / "tokenizer_config.json").read_text())
    assert json.dumps(tc).count("<|end_of_msg|>") >= 1
    for name in ("generation_config.json", "preprocessor_config.json", "modeling_kimi_k3.py",
                 "tokenization_kimi.py", "encoding_k3.py"):
        assert (tiny_ckpt / name).is_file()


def test_failure_leaves_no_output(tmp_path, monkeypatch):
    import k3bundle.synth.checkpoint as ck

    calls = {"n": 0}
    real = ck.make_tensors

    def failing(schema, specs, seed, fixed=None):
        calls["n"] += 1
        if calls["n"] == 4:
            raise OSError("disk full")
        return real(schema, specs, seed, fixed)

    monkeypatch.setattr(ck, "make_tensors", failing)
    with pytest.raises(OSError):
        write_synthetic(tmp_path / "out", preset="tiny")
    assert list(tmp_path.iterdir()) == []  # neither the output nor the staging directory


def test_cli_refuses_existing_dir_and_full(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "keep.txt").write_text("mine")
    r = run_cli("synth", "--preset", "tiny", "--out", str(tmp_path / "x"))
    assert r.returncode == 2 and r.stderr.strip() == f"error: {tmp_path / 'x'}: already exists and is not empty (pass --force to replace it)"
    assert (tmp_path / "x" / "keep.txt").read_text() == "mine"
    r = run_cli("synth", "--preset", "full", "--out", str(tmp_path / "y"))
    assert r.returncode == 2 and "1.56 TB" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = run_cli("synth", "--preset", "huge", "--out", str(tmp_path / "y"))
    assert r.returncode == 2 and "unknown preset 'huge'" in r.stderr


def test_cli_json_summary(tmp_path):
    r = run_cli("synth", "--preset", "tiny", "--out", str(tmp_path / "t"), "--seed", "3", "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["seed"] == 3 and data["tensors"] == 1020
    assert "model.safetensors.index.json" in data["files"]
