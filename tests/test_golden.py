"""Golden generation: case files, determinism, bounded long-case size, CLI."""

from __future__ import annotations

import re
import shutil

import numpy as np
import pytest

from k3bundle.config import load_config
from k3bundle.golden.cases import load_case, load_cases
from k3bundle.golden.errors import CaseError
from k3bundle.golden.generate import generate_goldens
from k3bundle.golden.store import read_meta, read_npz
from k3bundle.tokenizer import load_tiktoken
from tests.conftest import REPO, run_cli


@pytest.fixture(scope="module")
def small_cases(tmp_path_factory):
    """greedy + thinking + a 1024-token long case: enough to test the machinery quickly."""
    d = tmp_path_factory.mktemp("cases")
    for name in ("greedy", "thinking", "long_context", "image"):
        shutil.copy(REPO / "golden" / "cases" / f"{name}.yaml", d)
    return d


def test_shipped_cases_cover_every_kind(tiny_trained_ckpt):
    cases = {c.kind: c for c in load_cases()}
    assert set(cases) == {"greedy", "thinking", "tool_call", "multi_turn", "long_context", "image"}
    assert cases["image"].runnable and cases["image"].not_run_reason is None
    enc = load_tiktoken(tiny_trained_ckpt)
    long_ids = cases["long_context"].build_ids(enc)
    assert len(long_ids) >= 8192
    turns = [m for m in cases["multi_turn"].messages if m["role"] == "user"]
    assert len(turns) >= 3
    # the thinking case ends with the thinking generation prompt: ...<|open|>think<|sep|>
    ids = cases["thinking"].build_ids(enc)
    assert enc.decode(ids).endswith("<|open|>message role=\"assistant\"<|sep|><|open|>think<|sep|>")


def test_bad_case_files_are_named(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("schema_version: 1\nname: x\nkind: greedy\nprompt: hi\ngenerate: {steps: 2}\nstepz: 3\n")
    with pytest.raises(CaseError, match=r"bad.yaml: unknown key \['stepz'\]"):
        load_case(p)
    p.write_text("schema_version: 1\nname: x\nkind: nope\nprompt: hi\ngenerate: {steps: 2}\n")
    with pytest.raises(CaseError, match="kind 'nope' is not one of"):
        load_case(p)


def test_same_seed_same_content_hash_and_bytes(tmp_path, tiny_trained_ckpt, small_cases):
    a = generate_goldens(tiny_trained_ckpt, out=tmp_path / "a", cases_dir=small_cases, long_tokens=1024)
    b = generate_goldens(tiny_trained_ckpt, out=tmp_path / "b", cases_dir=small_cases, long_tokens=1024)
    assert a.content_hash == b.content_hash
    for name in ("golden_inputs.npz", "golden_intermediates.npz", "tolerances.yaml"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    inter = read_npz(tmp_path / "a" / "golden_intermediates.npz")
    meta = read_meta(inter)
    assert meta["content_hash"] == a.content_hash and meta["seed"] == 0
    status = {c["name"]: c["status"] for c in meta["cases"]}
    assert status == {"greedy": "ok", "thinking": "ok", "long_context": "ok", "image": "ok"}
    # the image case: its tower's input and taps, and the projector's rows at its <|media_pad|> positions
    ids = read_npz(tmp_path / "a" / "golden_inputs.npz")["image/ids"]
    pads = np.flatnonzero(ids == load_config(tiny_trained_ckpt / "config.json").media_placeholder_token_id)
    assert inter["image/media.grid_thws"].tolist() == [[1, 4, 4]] and len(pads) == 4
    assert np.array_equal(inter["image/embed"][pads], inter["image/vision.projector"])
    assert inter["image/vision.merger"].shape[:2] == (4, 4)  # 2x2 merged tokens of 2x2 patches each
    # the greedy tokens are the argmax of the recorded step logits
    assert np.array_equal(inter["greedy/greedy_tokens"], inter["greedy/step_logits"].argmax(-1))
    # teacher-forced logits at the last prompt position chose the first greedy token
    assert inter["greedy/logits"][-1].argmax() == inter["greedy/greedy_tokens"][0]
    assert inter["thinking/layers.1.router_ids"].shape[1] == 4


def test_long_case_size_is_bounded(tmp_path, tiny_trained_ckpt):
    d = tmp_path / "cases"
    d.mkdir()
    shutil.copy(REPO / "golden" / "cases" / "long_context.yaml", d)
    sizes = {}
    for n in (512, 2048):
        r = generate_goldens(tiny_trained_ckpt, out=tmp_path / str(n), cases_dir=d, long_tokens=n)
        sizes[n] = r.bytes_intermediates
    assert sizes[2048] < 1.2 * sizes[512], sizes


def test_cli_golden(tmp_path, tiny_trained_ckpt, small_cases):
    r = run_cli("golden", str(tiny_trained_ckpt), "--out", str(tmp_path / "g"), "--cases", str(small_cases),
                "--long-tokens", "256", "--json")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "g" / "tolerances.yaml").read_text().startswith("#")
    r = run_cli("golden", str(tiny_trained_ckpt), "--out", str(tmp_path / "h"), "--tolerances", "bogus")
    assert r.returncode == 2 and "tolerance set 'bogus' not found" in r.stderr


def test_layer_major_schedule_writes_the_same_goldens_in_one_pass_per_forward(tiny_ckpt, tmp_path, monkeypatch):
    """schedule="layer" runs every case together, each layer read once per pass for all of
    them: the same content hash as case by case, and far fewer layer reads."""
    from k3bundle.executor.weights import SourceWeights

    reads = []
    layer = SourceWeights.layer

    def count(self, l, decode=False):
        reads.append(l)
        return layer(self, l, decode)
    monkeypatch.setattr(SourceWeights, "layer", count)
    a = generate_goldens(tiny_ckpt, out=tmp_path / "case", long_tokens=200, schedule="case")
    by_case, reads[:] = len(reads), []
    b = generate_goldens(tiny_ckpt, out=tmp_path / "layer", long_tokens=200, schedule="layer")
    assert a.content_hash == b.content_hash
    assert (tmp_path / "case" / "golden_intermediates.npz").read_bytes() != b""  # written
    n_layers = 1 + max(reads)
    ok = [c for c in a.cases if c["status"] == "ok"]
    # golden, its BF16 replay and the BF16 teacher-forced pass: prefill and steps - 1 decodes each
    passes = 3 * max(c["steps"] for c in ok)
    assert len(reads) <= passes * n_layers < by_case / 2, (len(reads), by_case)


def test_cli_golden_prints_a_line_per_stage_where_stderr_is_not_a_terminal(tmp_path, tiny_trained_ckpt, small_cases):
    """stderr a pipe (a log, CI): each case run reads as a start and a done line, numbered among
    the cases, then the writing of the files."""
    r = run_cli("golden", str(tiny_trained_ckpt), "--out", str(tmp_path / "g"), "--cases", str(small_cases),
                "--long-tokens", "256", "--no-noise", "--schedule", "case")
    assert r.returncode == 0, r.stderr
    listed = [c["name"] for c in read_meta(read_npz(tmp_path / "g" / "golden_intermediates.npz"))["cases"]]
    assert set(listed) == {"greedy", "thinking", "long_context", "image"}
    want = []
    for i, name in enumerate(listed, 1):
        want += [f"golden: case {name} {i}/4 ...", f"golden: case {name} {i}/4 done S s"]
    want += ["golden: writing the goldens ...", "golden: writing the goldens done S s"]
    got = [re.sub(r"done \d+\.\d s$", "done S s", l) for l in r.stderr.splitlines() if l.startswith("golden: ")]
    assert got == want, r.stderr
