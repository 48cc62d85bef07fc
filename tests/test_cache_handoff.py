"""The cache handoff format (docs/executor.md "Cache handoff format"): bytes a reader written
from the doc alone (numpy + json, below) reads to the cache's own values; round trip; bad bytes
give one line naming the field."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch

from k3bundle.executor import Executor, SourceWeights
from k3bundle.executor.cache import KDAState
from k3bundle.executor.cache_handoff import CacheFormatError, from_bytes, to_bytes


def doc_reader(data: bytes) -> tuple[dict, list[dict[str, np.ndarray]]]:
    """The format as the doc states it, independently of k3bundle: (header, per layer {name: float64 array})."""
    assert data[:8] == b"K3CACHE\x01"
    (n,) = struct.unpack("<Q", data[8:16])
    header = json.loads(data[16:16 + n].decode("utf-8"))
    base = 16 + n
    assert header["data_bytes"] == len(data) - base
    layers = []
    for entry in header["layers"]:
        arrays = {}
        for a in entry["arrays"]:
            raw = data[base + a["offset"]: base + a["offset"] + a["nbytes"]]
            if a["dtype"] == "bfloat16":  # the upper half of an FP32 word
                vals = (np.frombuffer(raw, "<u2").astype(np.uint32) << 16).view(np.float32)
            else:
                vals = np.frombuffer(raw, {"float32": "<f4", "float64": "<f8", "float16": "<f2"}[a["dtype"]])
            arrays[a["name"]] = vals.astype(np.float64).reshape(a["shape"])
        layers.append(arrays)
    return header, layers


@pytest.fixture(scope="module")
def prefilled(tiny_ckpt):
    """A BF16-policy cache after 70 tokens (FP32 states, BF16 conv and latent: the serving dtypes)."""
    w = SourceWeights(tiny_ckpt, dtype="bfloat16", resident=True)
    ids = torch.randint(0, 1000, (70,), generator=torch.Generator().manual_seed(3))
    return Executor(w).prefill(ids)[1]


def test_doc_reader_reads_every_layer_value(prefilled):
    data = to_bytes(prefilled)
    header, layers = doc_reader(data)
    assert header["length"] == 70 and header["chunk"] == 64 and header["chunk_boundary"] == 64
    assert len(layers) == len(prefilled.layers)
    kinds = set()
    for l, (s, entry, arrays) in enumerate(zip(prefilled.layers, header["layers"], layers)):
        assert entry["layer"] == l and entry["length"] == 70 and entry["chunk_boundary"] == 64
        if isinstance(s, KDAState):
            kinds.add("kda")
            assert entry["kind"] == "kda" and [a["dtype"] for a in entry["arrays"]] == ["float32", "bfloat16"]
            np.testing.assert_array_equal(arrays["recurrent"], s.recurrent_HKV.double().numpy())
            np.testing.assert_array_equal(arrays["conv"], s.conv_3WP.double().numpy())
            assert arrays["recurrent"].shape == tuple(s.recurrent_HKV.shape)
        else:
            kinds.add("mla")
            assert entry["kind"] == "mla" and entry["arrays"][0]["dtype"] == "bfloat16"
            assert arrays["latent"].shape[0] == 70
            np.testing.assert_array_equal(arrays["latent"], s.latent_SC.double().numpy())
    assert kinds == {"kda", "mla"}


def test_round_trip_is_bit_exact_and_continues(prefilled, tiny_ckpt):
    back = from_bytes(to_bytes(prefilled))
    assert back.length == prefilled.length
    for a, b in zip(back.layers, prefilled.layers):
        assert type(a) is type(b)
        for x, y in ((a.recurrent_HKV, b.recurrent_HKV), (a.conv_3WP, b.conv_3WP)) if isinstance(a, KDAState) \
                else ((a.latent_SC, b.latent_SC),):
            assert x.dtype == y.dtype and torch.equal(x, y)
    # the restored cache decodes exactly as the original (same arithmetic, same bytes)
    ex = Executor(SourceWeights(tiny_ckpt, dtype="bfloat16", resident=True))
    assert torch.equal(ex.decode(5, back), ex.decode(5, prefilled.clone()))


def _with_header(data: bytes, edit) -> bytes:
    (n,) = struct.unpack("<Q", data[8:16])
    header = json.loads(data[16:16 + n])
    edit(header)
    new = json.dumps(header).encode()
    return data[:8] + struct.pack("<Q", len(new)) + new + data[16 + n:]


@pytest.mark.parametrize("corrupt, field", [
    (lambda d: b"NOTCACHE" + d[8:], "magic"),
    (lambda d: d[:-1], "data_bytes"),
    (lambda d: d[:8] + struct.pack("<Q", 10 ** 9) + d[16:], "header_length"),
    (lambda d: _with_header(d, lambda h: h["layers"][0].update(kind="ssm")), "layers[0].kind"),
    (lambda d: _with_header(d, lambda h: h["layers"][0]["arrays"][0].update(dtype="int8")), "layers[0].arrays.recurrent.dtype"),
    (lambda d: _with_header(d, lambda h: h["layers"][1]["arrays"][0].update(offset=10 ** 9)), "offset"),
    (lambda d: _with_header(d, lambda h: h["layers"][0]["arrays"][1].update(shape=[1, 2])), "layers[0].arrays.conv.nbytes"),
    (lambda d: _with_header(d, lambda h: h.update(length=-1)), "length"),
])
def test_bad_bytes_give_one_line_naming_the_field(prefilled, corrupt, field):
    with pytest.raises(CacheFormatError) as e:
        from_bytes(corrupt(to_bytes(prefilled)))
    msg = str(e.value)
    assert "\n" not in msg and field in msg, msg
