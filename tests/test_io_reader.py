"""SafetensorsFile / read_header: official files read back equal; every format rule errors."""

import json
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from k3bundle.errors import SafetensorsError
from k3bundle.io import SafetensorsFile, read_header


def _raw_file(path, header: str, data: bytes = b"", *, pad: bool = True, length=None) -> str:
    """Hand-build a safetensors file: u64 LE length, header (space padded), data."""
    hb = header.encode("utf-8")
    if pad:
        hb += b" " * (-len(hb) % 8)
    n = len(hb) if length is None else length
    path = str(path)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", n) + hb + data)
    return path


def _entry(dtype, shape, begin, end) -> str:
    return json.dumps({"dtype": dtype, "shape": shape, "data_offsets": [begin, end]})


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.fixture
def official(tmp_path):
    """A file written by safetensors.torch.save_file, and the tensors written."""
    g = torch.Generator().manual_seed(0)
    tensors = {
        # random bit patterns: NaN payloads, subnormals, -0 must survive bit-exactly
        "bf16": torch.randint(-(2**15), 2**15, (7, 5), generator=g, dtype=torch.int16).view(torch.bfloat16),
        "f32": torch.randn(3, 4, generator=g),
        "u8": torch.randint(0, 256, (1000, 16), generator=g, dtype=torch.uint8),
        "i32": torch.arange(6, dtype=torch.int32).reshape(2, 3),
        "f16": torch.randn(4, generator=g).half(),
        "bool": torch.tensor([True, False, True]),
        "f8": torch.randint(0, 256, (4, 4), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn),
        "i64": torch.tensor([-(2**62), 2**62]),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
    }
    path = str(tmp_path / "model-00001-of-000009.safetensors")
    save_file(tensors, path, metadata={"format": "pt", "note": "ünïcode"})
    return path, tensors


def test_official_file_reads_back_bit_exact(official):
    path, tensors = official
    with SafetensorsFile(path) as sf:
        assert set(sf.keys()) == set(tensors) and len(sf) == len(tensors)
        assert sf.sorted_keys() == sorted(tensors)
        assert sf.metadata == {"format": "pt", "note": "ünïcode"}
        for key, want in tensors.items():
            got = sf.get(key)
            assert got.dtype == want.dtype and got.shape == want.shape, key
            assert _bits(got) == _bits(want), key


def test_keys_in_header_order_and_info_offsets(official):
    path, _ = official
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    order = [k for k in header if k != "__metadata__"]
    with SafetensorsFile(path) as sf:
        assert sf.keys() == order
        info = sf.info("i32")
        assert (info.dtype, info.shape) == ("I32", (2, 3))
        assert [info.begin, info.end] == header["i32"]["data_offsets"]
        assert info.abs_begin == 8 + n + info.begin and info.nbytes == 24
        with open(path, "rb") as f:
            f.seek(info.abs_begin)
            assert f.read(info.nbytes) == _bits(torch.arange(6, dtype=torch.int32))
    hdr = read_header(path)
    assert list(hdr.tensors) == order and hdr.data_start == 8 + n


def test_tensors_are_owned_and_writable(official):
    path, tensors = official
    with SafetensorsFile(path) as sf:
        a = sf.get("f32")
        a.add_(1.0)  # must not raise (not a read-only buffer) ...
        assert torch.equal(sf.get("f32"), tensors["f32"])  # ... and must not touch the file
        rows = sf.get_rows("u8", 2, 5)
        rows.zero_()
        assert torch.equal(sf.get_rows("u8", 2, 5), tensors["u8"][2:5])


def test_get_rows_read_bytes_iter_chunks(official):
    path, tensors = official
    with SafetensorsFile(path) as sf:
        assert torch.equal(sf.get_rows("u8", 10, 13), tensors["u8"][10:13])
        assert sf.get_rows("u8", 7, 7).shape == (0, 16)
        assert _bits(sf.get_rows("bf16", 1, 4)) == _bits(tensors["bf16"][1:4])
        want = _bits(tensors["u8"])
        assert sf.read_bytes("u8") == want
        assert sf.read_bytes("u8", 100, 250) == want[100:250]
        chunks = list(sf.iter_chunks("u8", 3000))
        assert [len(c) for c in chunks] == [3000] * 5 + [1000]
        assert b"".join(chunks) == want
        assert list(sf.iter_chunks("empty", 10)) == []


class _CountingFile(SafetensorsFile):
    """Counts the data bytes read through the single read primitive."""

    def _read_into(self, view, offset):
        self.bytes_read = getattr(self, "bytes_read", 0) + len(view)
        super()._read_into(view, offset)


def test_get_rows_reads_only_those_rows(tmp_path):
    path = str(tmp_path / "rows.safetensors")
    big = torch.arange(1000 * 64, dtype=torch.float32).reshape(1000, 64)  # 256 bytes a row
    save_file({"a": torch.zeros(3), "big": big, "z": torch.ones(5)}, path)
    with _CountingFile(path) as sf:
        assert torch.equal(sf.get_rows("big", 500, 501), big[500:501])
        assert sf.bytes_read == 256
        sf.bytes_read = 0
        sf.read_bytes("big", 1024, 2048)
        assert sf.bytes_read == 1024


def test_missing_key_names_file_and_key(official):
    path, _ = official
    with SafetensorsFile(path) as sf, pytest.raises(SafetensorsError) as e:
        sf.get("f33")
    msg = str(e.value)
    assert path in msg and "'f33'" in msg and "did you mean 'f32'" in msg


def test_range_errors(official):
    path, _ = official
    with SafetensorsFile(path) as sf:
        for call in (lambda: sf.get_rows("u8", 5, 1001), lambda: sf.get_rows("scalar", 0, 1),
                     lambda: sf.read_bytes("u8", 0, 16001)):
            with pytest.raises(SafetensorsError, match="model-00001-of-000009"):
                call()


def test_closed_file_refuses_reads(official):
    path, _ = official
    sf = SafetensorsFile(path)
    sf.close()
    sf.close()
    with pytest.raises(ValueError):
        sf.get("f32")


def _open_fds() -> int:
    import os
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not __import__("os").path.isdir("/proc/self/fd"), reason="counts descriptors in /proc (Linux)")
def test_a_reader_dropped_without_close_gives_its_descriptor_back(official):
    import gc

    path, _ = official
    before = _open_fds()
    readers = [SafetensorsFile(path) for _ in range(50)]
    assert _open_fds() == before + 50
    del readers
    gc.collect()
    assert _open_fds() == before


# --- one SafetensorsError per rule -------------------------------------------------------

A = _entry("F32", [2], 0, 8)
GOOD = "{" + f'"a":{A},"b":{_entry("F32", [2], 8, 16)}' + "}"


def _bad_files(tmp_path):
    """(case name, file path, substrings the message must contain)."""
    p = lambda name: tmp_path / f"{name}.safetensors"  # noqa: E731
    two = lambda a, b, data: _raw_file(p(data[0]), "{" + f'"a":{a},"b":{b}' + "}", data[1])  # noqa: E731
    return [
        ("truncated", _raw_file(p("truncated"), GOOD, b"\0" * 15), ["truncated", "'b'", "16", "15"]),
        ("trailing", _raw_file(p("trailing"), GOOD, b"\0" * 17), ["trailing bytes", "'b'", "1 bytes"]),
        ("overlap", two(A, _entry("F32", [2], 4, 12), ("overlap", b"\0" * 12)),
         ["overlapping", "'b'", "'a'", "[4, 12]"]),
        ("gap", two(A, _entry("F32", [2], 12, 20), ("gap", b"\0" * 20)),
         ["offsets not contiguous", "'b'", "starts at 12", "'a' ends at 8"]),
        ("gap_at_start", _raw_file(p("gap_at_start"), "{" + f'"a":{_entry("F32", [2], 4, 12)}' + "}", b"\0" * 12),
         ["offsets not contiguous", "'a'", "starts at 4"]),
        ("unknown_dtype", _raw_file(p("unknown_dtype"), "{" + f'"a":{_entry("F12", [2], 0, 8)}' + "}", b"\0" * 8),
         ["unknown dtype", "'a'", "F12"]),
        ("size_mismatch", _raw_file(p("size_mismatch"), "{" + f'"x.weight":{_entry("BF16", [32, 64], 0, 4000)}' + "}",
                                    b"\0" * 4000), ["'x.weight' needs 4096 bytes (shape [32, 64] BF16)", "span 4000"]),
        ("oversized_header", _raw_file(p("oversized_header"), GOOD, b"\0" * 16, length=2**40),
         ["header length 1099511627776 exceeds the limit"]),
        ("header_past_eof", _raw_file(p("header_past_eof"), GOOD, b"", length=1000), ["header length 1000 runs past"]),
        ("non_json", _raw_file(p("non_json"), "{not json}", b""), ["not valid JSON"]),
        ("not_brace", _raw_file(p("not_brace"), "[1, 2]", b""), ["does not start with '{'"]),
        ("duplicate", _raw_file(p("duplicate"), "{" + f'"a":{A},"a":{_entry("F32", [2], 8, 16)}' + "}", b"\0" * 16),
         ["duplicate key 'a'"]),
        ("dup_field", _raw_file(p("dup_field"), '{"a":{"dtype":"F32","dtype":"F32","shape":[2],"data_offsets":[0,8]}}',
                                b"\0" * 8), ["tensor 'a'", "duplicate key 'dtype'"]),
        ("bool_shape", _raw_file(p("bool_shape"), '{"a":{"dtype":"U8","shape":[true],"data_offsets":[0,1]}}', b"\0"),
         ["'a'", "invalid shape"]),
        ("neg_shape", _raw_file(p("neg_shape"), "{" + f'"a":{_entry("U8", [-1], 0, 0)}' + "}", b""),
         ["'a'", "invalid shape"]),
        ("reversed", _raw_file(p("reversed"), "{" + f'"a":{_entry("U8", [0], 8, 0)}' + "}", b""),
         ["'a'", "end before they begin"]),
        ("misaligned_f4", _raw_file(p("misaligned_f4"), "{" + f'"a":{_entry("F4", [3], 0, 2)}' + "}", b"\0\0"),
         ["'a'", "12 bits, not a whole number of bytes"]),
        ("overflow", _raw_file(p("overflow"), "{" + f'"a":{_entry("F64", [2**40, 2**40], 0, 0)}' + "}", b""),
         ["'a'", "overflows"]),
        ("meta_not_str", _raw_file(p("meta_not_str"), '{"__metadata__":{"k":1}}', b""), ["__metadata__", "'k'"]),
        ("extra_field", _raw_file(p("extra_field"), '{"a":{"dtype":"U8","shape":[0],"data_offsets":[0,0],"x":1}}', b""),
         ["'a'", "unknown field 'x'"]),
    ]


def test_each_rule_raises_one_named_error(tmp_path):
    for case, path, parts in _bad_files(tmp_path):
        with pytest.raises(SafetensorsError) as e:
            SafetensorsFile(path)
        msg = str(e.value)
        assert "\n" not in msg, case
        assert msg.startswith(path + ": "), (case, msg)
        for part in parts:
            assert part in msg, (case, part, msg)
        with pytest.raises(SafetensorsError):
            read_header(path)


def test_exact_size_mismatch_message(tmp_path):
    path = _raw_file(tmp_path / "model-00001-of-000009.safetensors",
                     "{" + f'"x.weight":{_entry("BF16", [32, 64], 0, 4000)}' + "}", b"\0" * 4000)
    with pytest.raises(SafetensorsError) as e:
        read_header(path)
    assert str(e.value) == (f"{path}: tensor 'x.weight' needs 4096 bytes (shape [32, 64] BF16) "
                            "but its data_offsets span 4000")


@pytest.mark.parametrize("case", ["truncated", "trailing", "overlap", "gap", "unknown_dtype",
                                  "size_mismatch", "oversized_header", "header_past_eof", "non_json"])
def test_official_reader_agrees_the_file_is_bad(tmp_path, case):
    """Independent oracle: the reference implementation rejects the same hand-built files."""
    path = {c: p for c, p, _ in _bad_files(tmp_path)}[case]
    with pytest.raises(Exception):
        with safe_open(path, "pt") as f:
            for k in f.keys():
                f.get_tensor(k)


def test_non_utf8_header(tmp_path):
    path = str(tmp_path / "latin.safetensors")
    hb = b'{"\xff":1}'
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)) + hb)
    with pytest.raises(SafetensorsError, match="not valid UTF-8 at byte 2"):
        read_header(path)


def test_header_limit_is_configurable_and_tiny_file(tmp_path):
    path = _raw_file(tmp_path / "ok.safetensors", GOOD, b"\0" * 16)
    assert list(read_header(path).tensors) == ["a", "b"]
    with pytest.raises(SafetensorsError, match="exceeds the limit of 16"):
        read_header(path, max_header_bytes=16)
    short = tmp_path / "short.safetensors"
    short.write_bytes(b"\1\0\0")
    with pytest.raises(SafetensorsError, match="too small"):
        read_header(short)


def test_empty_and_zero_size_tensors_are_valid(tmp_path):
    path = _raw_file(tmp_path / "e.safetensors",
                     "{" + f'"a":{_entry("F32", [0], 0, 0)},"b":{_entry("U8", [2], 0, 2)},'
                     f'"c":{_entry("F32", [], 2, 6)}' + "}", b"\1\2\0\0\x80\x3f")
    with SafetensorsFile(path) as sf:
        assert sf.get("a").shape == (0,)
        assert sf.get("b").tolist() == [1, 2]
        assert sf.get("c").item() == 1.0
    nothing = _raw_file(tmp_path / "n.safetensors", "{}", b"")
    assert read_header(nothing).tensors == {}


def test_f4_needs_read_bytes(tmp_path):
    path = _raw_file(tmp_path / "f4.safetensors", "{" + f'"q":{_entry("F4", [2, 4], 0, 4)}' + "}", b"\x12\x34\x56\x78")
    with SafetensorsFile(path) as sf:
        assert sf.read_bytes("q") == b"\x12\x34\x56\x78"
        with pytest.raises(SafetensorsError, match="'q' has dtype F4"):
            sf.get("q")
        with pytest.raises(SafetensorsError, match="use read_bytes"):
            sf.get_rows("q", 0, 1)
