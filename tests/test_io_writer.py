"""write_safetensors: exact bytes, official reader agrees, deterministic, streaming, atomic."""

import hashlib
import os
import struct
import tracemalloc

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save

from k3bundle.errors import SafetensorsError
from k3bundle.io import SafetensorsFile, TensorSource, write_safetensors


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _mixed() -> dict:
    g = torch.Generator().manual_seed(1)
    return {
        "model.layers.0.w": torch.randint(-(2**15), 2**15, (16, 8), generator=g, dtype=torch.int16).view(torch.bfloat16),
        "model.layers.0.scale": torch.randint(0, 256, (16, 1), generator=g, dtype=torch.uint8),
        "lm_head.weight": torch.randn(5, 3, generator=g),
        "a.bool": torch.tensor([True, False]),
        "f8": torch.randint(0, 256, (3,), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn),
        "scalar": torch.tensor(2.0, dtype=torch.float64),
        "empty": torch.zeros(0, 7, dtype=torch.bfloat16),
        "ünï": torch.arange(3, dtype=torch.int64),
    }


def test_exact_bytes_of_2x2_i32(tmp_path):
    path = tmp_path / "t.safetensors"
    write_safetensors(path, {"test": torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)})
    header = b'{"test":{"dtype":"I32","shape":[2,2],"data_offsets":[0,16]}}'  # 60 bytes
    header += b"    "  # padded with spaces to 64, a multiple of 8
    expected = (b"\x40\x00\x00\x00\x00\x00\x00\x00" + header
                + b"\x00\x00\x00\x00" b"\x01\x00\x00\x00" b"\x02\x00\x00\x00" b"\x03\x00\x00\x00")
    assert path.read_bytes() == expected


def test_exact_header_with_metadata_and_sorted_names(tmp_path):
    path = tmp_path / "m.safetensors"
    tensors = {"b": torch.zeros(1, dtype=torch.uint8), "B": torch.zeros(2, dtype=torch.uint8)}
    write_safetensors(path, tensors, metadata={"z": "1", "format": "pt"})
    header = (b'{"__metadata__":{"format":"pt","z":"1"},'
              b'"B":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},'
              b'"b":{"dtype":"U8","shape":[1],"data_offsets":[2,3]}}')
    header += b" " * (-len(header) % 8)
    assert path.read_bytes() == struct.pack("<Q", len(header)) + header + b"\0\0\0"


def test_same_dtype_matches_official_bytes(tmp_path):
    g = torch.Generator().manual_seed(2)
    tensors = {f"t{i}": torch.randn(i + 1, 3, generator=g).bfloat16() for i in (3, 0, 2, 1)}
    ours = write_safetensors(tmp_path / "o.safetensors", tensors, {"format": "pt"})
    official = save(tensors, metadata={"format": "pt"})
    assert (tmp_path / "o.safetensors").read_bytes() == official
    assert ours.sha256 == hashlib.sha256(official).hexdigest() and ours.size == len(official)


def test_official_reader_reads_ours_bit_exact(tmp_path):
    tensors = _mixed()
    path = str(tmp_path / "x.safetensors")
    write_safetensors(path, tensors, {"format": "pt", "k3": "1"})
    back = load_file(path)
    assert set(back) == set(tensors)
    for key, want in tensors.items():
        assert back[key].dtype == want.dtype and back[key].shape == want.shape, key
        assert _bits(back[key]) == _bits(want), key
    with safe_open(path, "pt") as f:
        assert f.metadata() == {"format": "pt", "k3": "1"}
    with SafetensorsFile(path) as sf:
        assert sf.keys() == sorted(tensors)
        assert all(_bits(sf.get(k)) == _bits(v) for k, v in tensors.items())


def test_deterministic_across_writes_and_insertion_order(tmp_path):
    tensors = _mixed()
    meta = {"b": "2", "a": "1"}
    r1 = write_safetensors(tmp_path / "1.safetensors", tensors, meta)
    r2 = write_safetensors(tmp_path / "2.safetensors", dict(reversed(list(tensors.items()))),
                           dict(reversed(list(meta.items()))))
    r3 = write_safetensors(tmp_path / "3.safetensors", list(tensors.items()), meta, chunk_bytes=7)
    data = (tmp_path / "1.safetensors").read_bytes()
    assert data == (tmp_path / "2.safetensors").read_bytes() == (tmp_path / "3.safetensors").read_bytes()
    assert r1.sha256 == r2.sha256 == r3.sha256 == hashlib.sha256(data).hexdigest()
    assert r1.size == len(data) == os.path.getsize(r1.path)
    (n,) = struct.unpack("<Q", data[:8])
    assert n % 8 == 0 and data[8:9] == b"{"


def test_pass_through_source_is_byte_identical(tmp_path):
    tensors = _mixed()
    src = tmp_path / "src.safetensors"
    write_safetensors(src, tensors)
    with SafetensorsFile(src) as sf:
        sources = {k: TensorSource.from_file(sf, k, chunk_bytes=5) for k in sf.keys()}
        write_safetensors(tmp_path / "dst.safetensors", sources)
    assert (tmp_path / "dst.safetensors").read_bytes() == src.read_bytes()


class _Chunks:
    """Yields nbytes in fresh chunk_bytes allocations, never the whole tensor."""

    def __init__(self, nbytes, chunk_bytes, fail_after=None):
        self.nbytes, self.chunk_bytes, self.fail_after = nbytes, chunk_bytes, fail_after

    def __iter__(self):
        for i in range(self.nbytes // self.chunk_bytes):
            if self.fail_after is not None and i == self.fail_after:
                raise RuntimeError("source died")
            chunk = bytearray(self.chunk_bytes)
            chunk[0] = i % 256
            yield chunk


def test_streaming_64mb_keeps_peak_memory_low(tmp_path):
    nbytes, chunk = 64 << 20, 1 << 20
    expect = hashlib.sha256()
    for c in _Chunks(nbytes, chunk):
        expect.update(c)
    src = TensorSource("U8", (64, 1 << 20), _Chunks(nbytes, chunk))
    tracemalloc.start()
    try:
        result = write_safetensors(tmp_path / "big.safetensors", {"big": src})
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, f"peak {peak} bytes: the tensor was materialised"
    assert result.size == os.path.getsize(result.path) == 8 + 72 + nbytes  # 71-byte header padded to 72
    with SafetensorsFile(result.path) as sf:
        assert sf.get_rows("big", 5, 6)[0, 0].item() == 5
        data_hash = hashlib.sha256()
        for c in sf.iter_chunks("big", 8 << 20):
            data_hash.update(c)
    assert data_hash.hexdigest() == expect.hexdigest()


def test_interrupted_write_leaves_no_file(tmp_path):
    src = TensorSource("U8", (8, 1024), _Chunks(8192, 1024, fail_after=3))
    with pytest.raises(RuntimeError, match="source died"):
        write_safetensors(tmp_path / "x.safetensors", {"a": torch.zeros(2), "x": src})
    assert os.listdir(tmp_path) == []


def test_interrupted_overwrite_keeps_old_file(tmp_path):
    path = tmp_path / "x.safetensors"
    write_safetensors(path, {"a": torch.ones(2)})
    old = path.read_bytes()
    with pytest.raises(RuntimeError):
        write_safetensors(path, {"a": TensorSource("U8", (4096,), _Chunks(4096, 1024, fail_after=1))})
    assert path.read_bytes() == old and os.listdir(tmp_path) == ["x.safetensors"]


@pytest.mark.parametrize("chunks,what", [([b"\0" * 10], "delivered 10 of 12 bytes"),
                                         ([b"\0" * 10, b"\0" * 4], "more than its 12 bytes")])
def test_source_must_deliver_exactly_nbytes(tmp_path, chunks, what):
    path = str(tmp_path / "s.safetensors")
    with pytest.raises(SafetensorsError) as e:
        write_safetensors(path, {"w.scale": TensorSource("BF16", (2, 3), iter(chunks))})
    assert str(e.value).startswith(f"{path}: tensor 'w.scale' ") and what in str(e.value)
    assert os.listdir(tmp_path) == []


def test_input_errors_name_file_and_key(tmp_path):
    path = str(tmp_path / "e.safetensors")
    cases = [
        ([("a", torch.zeros(1)), ("a", torch.zeros(1))], "duplicate tensor 'a'"),
        ({"nc": torch.zeros(3, 4).t()}, "tensor 'nc' is not contiguous; call .contiguous()"),
        ({"__metadata__": torch.zeros(1)}, "'__metadata__' is reserved"),
        ({"u": TensorSource("F12", (1,), [])}, "tensor 'u' has unknown dtype 'F12'"),
        ({"q": TensorSource("F4", (3,), [])}, "tensor 'q': shape [3] F4 is 12 bits"),
    ]
    for tensors, what in cases:
        with pytest.raises(SafetensorsError) as e:
            write_safetensors(path, tensors)
        assert str(e.value).startswith(path + ": ") and what in str(e.value), str(e.value)
    with pytest.raises(SafetensorsError, match="not a str -> str"):
        write_safetensors(path, {"a": torch.zeros(1)}, {"n": 1})
    assert os.listdir(tmp_path) == []


def test_declared_nbytes_must_match_shape(tmp_path):
    class Src:
        dtype, shape, nbytes, chunks = "F32", (4,), 15, [b"\0" * 15]

    with pytest.raises(SafetensorsError, match="tensor 's' declares 15 bytes but shape \\[4\\] F32 needs 16"):
        write_safetensors(tmp_path / "d.safetensors", {"s": Src()})


def test_bfloat16_all_bit_patterns_round_trip(tmp_path):
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    path = tmp_path / "bf16.safetensors"
    write_safetensors(path, {"all": every})
    assert torch.equal(load_file(path)["all"].view(torch.int16), every.view(torch.int16))
    with SafetensorsFile(path) as sf:
        assert torch.equal(sf.get("all").view(torch.int16), every.view(torch.int16))
