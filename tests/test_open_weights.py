"""One function opens the weights of a path for golden, validate and run: a bundle, a checkpoint, or
a one-line error for anything else."""

from __future__ import annotations

import pytest
import torch

from k3bundle.bundle.errors import BundleError
from k3bundle.bundle.open_weights import open_weights, weights_kind
from k3bundle.bundle.weights import BundleWeights
from k3bundle.executor import SourceWeights
from k3bundle.validate.errors import ValidateError
from k3bundle.validate.device_options import weights_for
from tests.conftest import run_cli


@pytest.fixture(scope="module")
def bundle(tiny_ckpt, tmp_path_factory):
    from k3bundle.convert import convert

    out = tmp_path_factory.mktemp("open_weights") / "bundle"
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        convert(tiny_ckpt, "b300-tp8", out, workers=1)
    finally:
        torch.set_num_threads(n)
    return out


def test_a_bundle_gives_its_merged_device_weights_and_a_checkpoint_its_tensors(tiny_ckpt, bundle):
    assert weights_kind(bundle) == "bundle" and weights_kind(tiny_ckpt) == "checkpoint"
    b, s = open_weights(bundle, "float32"), open_weights(tiny_ckpt, "float32")
    assert isinstance(b, BundleWeights) and isinstance(s, SourceWeights)
    # b300-tp8 keeps the non-expert tensors as they are: merged over ranks, they are the source's bit for bit
    lb, ls = b.layer(0), s.layer(0)
    assert lb._tensors.keys() == ls._tensors.keys()
    assert all(torch.equal(lb[k], ls[k]) for k in ls._tensors)


@pytest.mark.skipif(not __import__("os").path.isdir("/proc/self/fd"), reason="counts descriptors in /proc (Linux)")
def test_a_bundle_reader_keeps_at_most_its_cap_of_files_open(bundle, monkeypatch):
    """Every layer read with a cap of 3 open rank files (a b300-tp8 bundle of the release has 864;
    ``ulimit -n`` is often 1,024): the same values as with every file kept open, never more than 3
    descriptors held, none after close."""
    import os

    import k3bundle.bundle.weights as W

    def fds():
        return len(os.listdir("/proc/self/fd"))

    monkeypatch.setattr(W, "MAX_OPEN_FILES", 10_000)
    wide = BundleWeights(bundle, dtype="float32", resident_bytes=0)
    want = [dict(wide.layer(l)._tensors) for l in range(wide.config.text.num_hidden_layers)]
    assert len(wide.files.open) > 3  # uncapped: one reader per rank file read (72 of the bundle's 96)
    wide.close()
    monkeypatch.setattr(W, "MAX_OPEN_FILES", 3)
    before = fds()
    capped = BundleWeights(bundle, dtype="float32", resident_bytes=0)
    for l, tensors in enumerate(want):
        got = capped.layer(l)._tensors
        assert fds() - before <= 3 and len(capped.files.open) <= 3
        assert got.keys() == tensors.keys() and all(torch.equal(got[k], tensors[k]) for k in tensors)
    capped.close()
    assert fds() == before


def test_residency_is_asked_of_both_kinds_alike(tiny_ckpt, bundle):
    assert open_weights(bundle, "float32", resident=False).resident_bytes == 0
    assert open_weights(tiny_ckpt, "float32", resident=True).resident
    assert not open_weights(tiny_ckpt, "float32", resident=False).resident
    auto = open_weights(tiny_ckpt, "float32", resident=None)  # tiny fits: kept, not streamed
    assert auto.resident and not auto.prefetch


def test_neither_is_one_error_naming_the_path(tmp_path):
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(BundleError) as e:
        open_weights(tmp_path)
    assert str(e.value) == f"{tmp_path}: neither a bundle (manifest.json) nor a checkpoint (config.json)"
    with pytest.raises(ValidateError, match="neither a bundle"):  # validate answers in its own error type
        weights_for(tmp_path)


@pytest.mark.parametrize("argv", [["run", "{p}", "--ids", "1"], ["golden", "{p}", "--out", "{p}/g"]])
def test_the_commands_say_neither_in_one_line(tmp_path, argv):
    r = run_cli(*[a.format(p=tmp_path) for a in argv])
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0] == f"error: {tmp_path}: neither a bundle (manifest.json) nor a checkpoint (config.json)"


def test_run_takes_a_bundle_as_it_takes_a_checkpoint(tiny_ckpt, bundle):
    import json

    a = run_cli("run", str(tiny_ckpt), "--ids", "1,2,3", "--steps", "2", "--json")
    b = run_cli("run", str(bundle), "--ids", "1,2,3", "--steps", "2", "--json")
    assert a.returncode == 0 and b.returncode == 0, (a.stderr, b.stderr)
    tokens = [json.loads(r.stdout)["tokens"] for r in (a, b)]
    assert len(tokens[0]) == 2 and tokens[0] == tokens[1]
