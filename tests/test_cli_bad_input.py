"""Bad input at the command line: one clear error line naming the file, exit 2, no traceback."""

from __future__ import annotations

import json
import shutil
import struct

import pytest

from k3bundle.errors import SchemaError
from k3bundle.checkpoint import SourceCheckpoint
from tests.conftest import run_cli


def _file(path, header: dict, data: bytes, header_len: int | None = None):
    h = json.dumps(header).encode()
    n = len(h) if header_len is None else header_len
    path.write_bytes(struct.pack("<Q", n) + h + data)
    return path


def _one_error_line(r, *needles):
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    assert "Traceback" not in r.stderr and r.stdout == ""


@pytest.mark.parametrize("case,needles", [
    ("truncated", ["truncated", "'b'"]),
    ("overlap", ["overlap", "'b'"]),
    ("oversized", ["header", "1099511627776"]),
    ("shape", ["'a'", "needs 8 bytes"]),
])
def test_bad_safetensors(tmp_path, case, needles):
    p = tmp_path / f"{case}.safetensors"
    a = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
    b = {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}
    if case == "truncated":
        _file(p, {"a": a, "b": b}, bytes(12))
    elif case == "overlap":
        _file(p, {"a": a, "b": {**b, "data_offsets": [4, 12]}}, bytes(16))
    elif case == "oversized":
        _file(p, {"a": a}, bytes(8), header_len=2**40)
    elif case == "shape":
        _file(p, {"a": {**a, "data_offsets": [0, 6]}}, bytes(6))
    r = run_cli("inspect", str(p))
    _one_error_line(r, str(p), *needles)


def test_good_checkpoint_inspects(tiny_ckpt):
    r = run_cli("inspect", str(tiny_ckpt))
    assert r.returncode == 0 and "OK" in r.stdout and "1,020 tensors" in r.stdout


def test_checkpoint_with_missing_shard(tmp_path, tiny_ckpt):
    ck = tmp_path / "ck"
    shutil.copytree(tiny_ckpt, ck)
    (ck / "model-00005-of-000012.safetensors").unlink()
    r = run_cli("inspect", str(ck))
    _one_error_line(r, "model-00005-of-000012.safetensors")


def test_checkpoint_with_wrong_shape_is_named(tmp_path, tiny_ckpt):
    import torch
    from k3bundle.io import SafetensorsFile, write_safetensors

    ck = tmp_path / "ck"
    shutil.copytree(tiny_ckpt, ck)
    shard = ck / "model-00011-of-000012.safetensors"
    with SafetensorsFile(shard) as f:
        tensors = {k: f.get(k) for k in f.keys()}
    tensors["mm_projector.post_norm.weight"] = torch.zeros(128, dtype=torch.bfloat16)
    write_safetensors(shard, tensors, metadata={"format": "pt"})
    index = json.loads((ck / "model.safetensors.index.json").read_text())
    index["metadata"]["total_size"] -= 256
    (ck / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(SchemaError, match=r"mm_projector.post_norm.weight is BF16 \[128\], schema says BF16 \[256\]"):
        SourceCheckpoint(ck)
    r = run_cli("inspect", str(ck))
    _one_error_line(r, "mm_projector.post_norm.weight")


def test_source_reads_by_name(tiny_ckpt):
    with SourceCheckpoint(tiny_ckpt) as src:
        name = "language_model.model.layers.1.block_sparse_moe.experts.3.w1.weight_packed"
        assert src.shard_of(name) == "model-00002-of-000012.safetensors"
        full = src.get(name)
        assert src.get_rows(name, 5, 9).equal(full[5:9])
        assert src.read_bytes(name, 0, 16) == full.flatten()[:16].numpy().tobytes()
