"""An external runtime's own serving paths in its dumps (docs/dump-format.md "Serving paths"): the
entries written here from the built-in executor on the BF16 device policy (a prefix cache resumed
at a chunk and at a turn boundary through the cache's bytes, a handoff's decode, the case's
request in a batch with two shorter ones) pass against the dump's uninterrupted run; a path with
no entries is "not submitted", never a pass; a state restored one token off fails and is named
by path, layer and tap; bad entries are one line each."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from k3bundle.bundle.open_weights import open_weights
from k3bundle.executor import Executor, TapRecorder
from k3bundle.executor.batching import Request, batched
from k3bundle.executor.cache_handoff import from_bytes, to_bytes
from k3bundle.executor.case import golden_routes
from k3bundle.executor.serving import chunk_grid, uninterrupted
from k3bundle.executor.taps import dump_required, tap_kind
from k3bundle.validate.device_options import open_device
from k3bundle.validate.devices import DEVICE_POLICY
from k3bundle.validate.dump_serving import DumpServing
from k3bundle.validate.errors import DumpError
from k3bundle.validate.run import validate
from k3bundle.validate.serving import turn_boundary
from tests.conftest import REPO, run_cli
from tests.test_serving_paths import load_one_token_off

PATHS = ("resume_chunk", "resume_turn", "handoff", "batching")
KINDS = ("mixer_out", "ffn_out", "logits")


@pytest.fixture(scope="module")
def case(multi_turn_goldens):
    return {**multi_turn_goldens, "weights": open_weights(multi_turn_goldens["src"], DEVICE_POLICY, "cpu")}


def _main(golden) -> dict[str, torch.Tensor]:
    """The runtime's uninterrupted run: the goldens' values (a correct runtime), with decode taps."""
    names = dump_required(9) + ["step_logits"] + [k for k in golden if k.startswith("decode.") and tap_kind(k) in KINDS]
    return {k: torch.as_tensor(golden[k]).float() for k in names}


def _rows(rec, name, want) -> torch.Tensor:
    at = {p: i for i, p in enumerate(rec.positions_of(name))}
    return rec[name][[at[p] for p in want]].float()


def _entries(case, load=from_bytes, only: tuple[str, ...] = PATHS) -> dict[str, torch.Tensor]:
    """The serving paths of the case (``only`` these) on the built-in executor, as a runtime dumps them."""
    w, golden, ids = case["weights"], case["golden"], case["ids"]
    routes, tokens = golden_routes(golden), [int(t) for t in golden["greedy_tokens"]]
    positions, T = [int(p) for p in golden["positions"]], len(ids)
    ref = uninterrupted(w, ids, tokens, routes)
    out = {}
    turn = turn_boundary(ids, w.config.text.vocab_size, 64)
    for path, at in (("resume_chunk", chunk_grid(T, 64)[-1]), ("resume_turn", turn), ("handoff", T)):
        if path not in only:
            continue
        rec = TapRecorder([f"layers.*.{k}" for k in KINDS[:2]] + ["logits"])
        ex = Executor(w, taps=rec, forced_routes=routes)
        cache = load(to_bytes(ref.saved if path == "handoff" else ref.snapshots[at // 64 * 64])).clone()
        last = ref.logits[-1]
        if path != "handoff":
            if at > cache.length:  # a turn boundary off the grid: the tail recomputed
                ex.prefill(ids[cache.length:at], cache=cache)
            last = ex.prefill(ids[cache.length:], cache=cache)[0][-1]
            out[f"serving.{path}.at"] = torch.tensor([at])
        ex.recorders = [TapRecorder(rec.patterns)]  # the decode steps' rows, in step order
        _, steps = ex.decode_steps(last[None], cache, len(tokens), tokens=tokens)
        out[f"serving.{path}.step_logits"] = steps.float()
        for name in ex.recorders[0].names():
            if path != "handoff":
                out[f"serving.{path}.{name}"] = _rows(rec, name, [p for p in positions if p >= at])
            out[f"serving.{path}.decode.{name}"] = ex.recorders[0][name].float()
    n = len(ids)
    if "batching" not in only:
        return out
    others = [Request(ids[:k], ids[k:k + len(tokens)], routes) for k in (n * 2 // 3, n // 3)]
    run = batched(w, [Request(ids, tokens, routes)] + others)[0]
    out["serving.batching.lengths"] = torch.tensor([n, n * 2 // 3, n // 3])
    out["serving.batching.logits"] = run.logits[positions].float()
    out["serving.batching.step_logits"] = run.step_logits.float()
    for l in range(9):
        for k in KINDS[:2]:
            out[f"serving.batching.layers.{l}.{k}"] = run.taps[f"layers.{l}.{k}"][positions].float()
            out[f"serving.batching.decode.layers.{l}.{k}"] = run.taps[f"decode.layers.{l}.{k}"].float()
    return out


def _write(d: Path, tensors: dict[str, torch.Tensor]) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    save_file({k: v if not v.is_floating_point() else v.to(torch.bfloat16) for k, v in tensors.items()},
              str(d / "multi_turn.safetensors"))
    return d


@pytest.fixture(scope="module")
def entries(case):
    return _entries(case)


def test_submitted_paths_pass_and_report_like_the_built_in_ones(case, entries, tmp_path):
    d = _write(tmp_path / "dumps", {**_main(case["golden"]), **entries})
    r = run_cli("validate", str(case["src"]), "--dumps", str(d), "--json")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    data = json.loads(r.stdout)
    paths = {p["path"]: p for p in data["cases"][0]["serving"]}
    assert {k: p["status"] for k, p in paths.items()} == dict.fromkeys(PATHS, "pass"), paths
    assert paths["resume_chunk"]["at"] == entries["serving.resume_chunk.at"].item()
    assert "batch of prompts" in paths["batching"]["reason"] and paths["batching"]["checks"] > 30
    md = Path(next(f for f in data["reports"] if f.endswith("signoff.md"))).read_text()
    assert "| multi_turn | batching |" in md[md.index("## Serving paths"):]


def test_a_path_with_no_entries_is_not_submitted_never_passed(case, entries):
    only = {k: v for k, v in entries.items() if k.startswith("serving.handoff.")}
    res = {p.path: p for p in DumpServing({**_main(case["golden"]), **only}, case["golden"]["positions"])
           .judge("multi_turn", _tol(case))}
    assert res["handoff"].status == "pass"
    for p in ("resume_chunk", "resume_turn", "batching"):
        assert res[p].status == "not submitted" and not res[p].results, p


def _tol(case):
    from k3bundle.golden.tolerances import load_tolerances

    return load_tolerances(case["src"] / "validation" / "tolerances.yaml")


def test_a_state_restored_one_token_off_is_named_by_path_layer_and_tap(case, entries, tmp_path):
    bad = _entries(case, load=load_one_token_off, only=("resume_chunk",))
    d = _write(tmp_path / "dumps", {**_main(case["golden"]), **entries,
                                     **{k: v for k, v in bad.items() if k.startswith("serving.resume_chunk.")}})
    rep = validate(case["src"], open_device(case["src"], dumps=d))
    paths = {p.path: p for p in rep.cases[0].serving}
    assert {k: p.status for k, p in paths.items()} == {**dict.fromkeys(PATHS, "pass"), "resume_chunk": "fail"}
    ff = paths["resume_chunk"].first_failure
    # the runtime re-reads the prompt's last restored token: the first KDA layer's state has it twice
    assert ff.tap == "serving.resume_chunk.layers.0.mixer_out" and ff.layer == 0, ff.line()
    assert not rep.passed


def test_bad_entries_are_one_line_each(case, entries, tmp_path):
    main = _main(case["golden"])
    bad = {**main, "serving.resume_chunk.step_logits": entries["serving.resume_chunk.step_logits"],
           "serving.resume_chunk.logits": entries["serving.resume_chunk.logits"],  # no .at
           "serving.resume_later.step_logits": main["step_logits"],
           "serving.handoff.decode.layers.0.attn_res_out": main["decode.layers.0.mixer_out"],  # not in the dump
           "serving.batching.step_logits": main["step_logits"][:2]}
    d = _write(tmp_path / "dumps", bad)
    with pytest.raises(DumpError) as e:
        validate(case["src"], open_device(case["src"], dumps=d))
    lines = str(e.value).splitlines()[1:]
    f = "multi_turn.safetensors: tensor "
    assert len(lines) == 4, lines
    assert any(f + "'serving.resume_chunk.logits' needs serving.resume_chunk.at" in x for x in lines)
    assert any(f + "'serving.resume_later.step_logits': 'resume_later' is not a serving path" in x for x in lines)
    assert any(f + "'serving.handoff.decode.layers.0.attn_res_out' has no 'decode.layers.0.attn_res_out'" in x
               for x in lines)
    assert any(f + "'serving.batching.step_logits' has shape [2, " in x for x in lines)


def test_the_example_writer_submits_every_path(case, tmp_path):
    from k3bundle.validate.dumps import read_dump

    example = REPO / "docs" / "examples" / "write_serving_dumps.py"
    assert "k3bundle" not in example.read_text().split('"""', 2)[2]  # imports no k3bundle
    r = subprocess.run([sys.executable, str(example), str(case["src"] / "validation"), str(tmp_path / "d")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    cand = read_dump(tmp_path / "d", "multi_turn", case["golden"])
    res = DumpServing(cand, case["golden"]["positions"]).judge("multi_turn", _tol(case))
    assert [(p.path, p.status) for p in res] == [(p, "pass") for p in PATHS]
    assert res[3].reason == f"batch of prompts {len(case['ids'])}"  # the only case: a batch of one prompt
