"""Streaming with read-ahead (``SourceWeights(prefetch=True)``): the same numbers as resident
weights, one layer ahead read on a reader thread (on a side CUDA stream where there is one)."""

from __future__ import annotations

import threading

import pytest
import torch

from k3bundle.executor import Executor, SourceWeights


def _run(w):
    ex = Executor(w)
    ids = list(range(5, 105))
    logits, cache = ex.prefill(ids)
    steps = [ex.decode(t, cache) for t in (7, 11, 13)]
    return logits, steps


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")])])
def test_prefetched_stream_equals_resident_weights(tiny_ckpt, device, monkeypatch):
    resident = SourceWeights(tiny_ckpt, dtype="float32", device=device, resident=True)
    streamed = SourceWeights(tiny_ckpt, dtype="float32", device=device, prefetch=True)
    readers, layers = set(), []
    read_ahead = streamed._read_ahead

    def spy(layer, experts):
        readers.add(threading.current_thread().name)
        layers.append((layer, experts))
        return read_ahead(layer, experts)
    monkeypatch.setattr(streamed, "_read_ahead", spy)
    a_logits, a_steps = _run(resident)
    b_logits, b_steps = _run(streamed)
    streamed.close()
    assert torch.equal(a_logits, b_logits) and all(torch.equal(x, y) for x, y in zip(a_steps, b_steps))
    n = resident.config.text.num_hidden_layers
    assert any(r.startswith("k3prefetch") for r in readers)  # read ahead on the reader thread
    # the prefill reads each next layer with its experts; decode steps without them
    assert (1, True) in layers and (1, False) in layers
    assert layers[0] == (0, True) and layers[1:n] == [(l, True) for l in range(1, n)]


def test_prefetch_reads_each_layer_once_per_forward(tiny_ckpt, monkeypatch):
    w = SourceWeights(tiny_ckpt, dtype="float32", prefetch=True)
    got = []
    src_get = w.src.get

    def count(name):
        got.append(name)
        return src_get(name)
    monkeypatch.setattr(w.src, "get", count)
    Executor(w).prefill(list(range(5, 40)))
    w.close()
    names = [g for g in got if ".mlp.experts." not in g and "embed" not in g]
    dup = {g for g in names if names.count(g) > 1}
    # one read per non-expert tensor, plus layer 0 read ahead again for the next forward
    assert all(".layers.0." in g for g in dup), sorted(dup)[:5]
