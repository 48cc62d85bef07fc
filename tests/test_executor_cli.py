"""``k3bundle run`` on the synth tiny checkpoint."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.conftest import run_cli


def test_run_writes_logits_and_continuation(tiny_ckpt, tmp_path):
    out = tmp_path / "run" / "logits.npz"
    r = run_cli("run", str(tiny_ckpt), "--ids", "1,2,3", "--steps", "3", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("step ") == 3 and f"wrote {out}" in r.stdout
    with np.load(out, allow_pickle=False) as z:
        assert z["prompt_ids"].tolist() == [1, 2, 3]
        assert z["prefill_logits"].shape == (3, 1024) and z["prefill_logits"].dtype == np.float32
        assert z["step_logits"].shape == (3, 1024)
        tokens = z["tokens"].tolist()
        assert len(tokens) == 3 and tokens[0] == int(z["prefill_logits"][-1].argmax())
        assert [int(row.argmax()) for row in z["step_logits"]] == tokens
        assert str(z["dtype"]) == "float32"


def test_run_json_float64(tiny_ckpt):
    r = run_cli("run", str(tiny_ckpt), "--ids", "5, 6", "--steps", "2", "--dtype", "float64", "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["dtype"] == "float64" and len(data["tokens"]) == 2 and len(data["steps"]) == 2
    assert data["steps"][0]["top"][0][0] == data["tokens"][0]


@pytest.mark.parametrize("args,needle", [
    (["--ids", "1,1024,2"], "token id 1024 at index 1 is out of range 0..1023"),
    (["--ids", "1,x"], "'x' is not an integer"),
    (["--ids", "1", "--dtype", "float16"], "--dtype 'float16' is not one of"),
    (["--ids", ","], "give at least one token id"),
])
def test_run_bad_input_is_one_line_exit_2(tiny_ckpt, args, needle):
    r = run_cli("run", str(tiny_ckpt), *args)
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_run_missing_checkpoint(tmp_path):
    r = run_cli("run", str(tmp_path / "nope"), "--ids", "1")
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "nope" in r.stderr
