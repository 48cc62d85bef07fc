"""k3bundle kernels: backends load, conform on CPU, and every planted bug is caught and named.

Oracles: the reference ops in float64 (the executor's equations, themselves checked against
fla-core's naive functions and float64 recomputations in test_executor_*); k3bundle's MXFP4
codec (checked against the OCP MX spec in test_formats_mxfp4) for the LUT decode; the
executor without any backend for the plumbing (bit-identical logits).
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from k3bundle.errors import K3Error
from k3bundle.formats import mxfp4
from k3bundle.kernels import backend as backends, conformance
from k3bundle.kernels.cases import Sizes
from k3bundle.kernels.planted import BUGS
from k3bundle.kernels.target import target_dims
from k3bundle.kernels.torch_ops import mxfp4_lut_decode
from k3bundle.ops.contract import OP_CONTRACTS, contracts_markdown
from tests._docs import block
from tests.conftest import run_cli

SIZES = Sizes(prefill=160, decode_batch=3, context=96)


@pytest.fixture(scope="module")
def tiny_dims(tiny_ckpt):
    return target_dims("h200-tp16-ep16", tiny_ckpt / "config.json")


def _run(name, dims, ops=None, dtype="bfloat16"):
    d, target_ops, layout = dims
    return conformance.run(backends.load(name), d, ops or target_ops, layout, "cpu", dtype, SIZES, reps=0)


def test_backends_load_by_name_module_and_fail_clearly():
    assert set(backends.load("torch").ops) == {"gated_mla_prefill", "gated_mla_decode_latent_cache",
                                               "mxfp4_weight_gemm_grouped"}
    assert set(backends.load("fla").ops) == {"kda_chunked_prefill", "kda_recurrent_decode"}
    assert set(backends.load("reference").ops) == set(backends.OPS)
    mod = backends.load("tests.backends.one_op")
    assert mod.name == "one-op example" and set(mod.ops) == {"gated_mla_prefill"}
    with pytest.raises(K3Error, match="cannot import"):
        backends.load("no_such_pkg.ops")
    with pytest.raises(K3Error, match="defines none of the ops"):
        backends.load("json")
    with pytest.raises(K3Error, match="no such planted bug"):
        backends.load("planted:nope")


@pytest.mark.parametrize("name", ["reference", "torch", "fla", "tests.backends.one_op"])
def test_shipped_backends_conform_on_cpu(tiny_dims, name):
    res = _run(name, tiny_dims)
    assert res.passed, [(o.op, c.name, c.failures) for o in res.ops for c in o.cases if not c.passed]
    covered = set(res.covered())
    assert covered == set(backends.load(name).ops) & set(tiny_dims[1])
    statuses = {o.op: o.status for o in res.ops}
    assert statuses["attn_res_depth_softmax"] == "no contract"
    if name == "torch":
        assert statuses["kda_chunked_prefill"] == "not covered"
    # every case of every covered op ran, including the adversarial ones
    cases = {(o.op, c.name) for o in res.ops for c in o.cases}
    if "kda_chunked_prefill" in covered:
        assert {("kda_chunked_prefill", n) for n in ("varlen", "gate_lower_bound", "nan_propagates")} <= cases


def test_reference_in_float32_is_at_the_float32_floor(tiny_dims):
    res = _run("reference", tiny_dims, dtype="float32")
    assert res.passed
    worst = max(m["nmse"] for o in res.ops for c in o.cases for m in c.metrics.values() if "nmse" in m)
    assert 0 < worst < 1e-10  # summation order only: never 0 everywhere, never near bf16's 1e-6


#: the op each planted bug lives in; conformance must fail exactly those
PLANTED_OPS = {"kda_state_transposed": {"kda_chunked_prefill"},
               "gate_no_lower_bound": {"kda_chunked_prefill", "kda_recurrent_decode"},
               "beta_no_sigmoid": {"kda_chunked_prefill", "kda_recurrent_decode"},
               "mxfp4_nvfp4_scale_stride": {"mxfp4_weight_gemm_grouped"},
               "router_bias_in_weights": {"sigmoid_biased_topk_router"},
               "mla_scale_128": {"gated_mla_prefill", "gated_mla_decode_latent_cache"}}


def test_every_planted_bug_has_an_expectation():
    assert set(PLANTED_OPS) == set(BUGS)


@pytest.mark.parametrize("bug", sorted(PLANTED_OPS))
def test_planted_bug_fails_its_op_and_names_the_case(tiny_dims, bug):
    res = _run(f"planted:{bug}", tiny_dims)
    assert not res.passed
    assert {o.op for o in res.ops if o.status == "fail"} == PLANTED_OPS[bug]
    for o in res.ops:
        if o.status == "fail":
            bad = o.failing()
            assert bad.failures and bad.name in {c.name for c in o.cases}
    if bug == "kda_state_transposed":  # o is right, the state is not: the report says which output
        first = next(o for o in res.ops if o.status == "fail").failing()
        assert all(f.startswith("state") for f in first.failures)


def test_cli_exit_codes_and_reports(tiny_ckpt, tmp_path):
    cfg = str(tiny_ckpt / "config.json")
    common = ["kernels", "--target", "h200-tp16-ep16", "--config", cfg, "--tokens", "96", "--reps", "1"]
    ok = run_cli(*common, "--backend", "torch", "--ops", "gated_mla_prefill", "--out", str(tmp_path / "r"))
    assert ok.returncode == 0, ok.stderr[-1500:]
    data = json.loads((tmp_path / "r" / "kernels.json").read_text())
    assert data["kind"] == "k3bundle.kernel_conformance" and data["passed"]
    timed = [c for o in data["ops"] for c in o["cases"] if c["time_s"] is not None]
    assert timed and all(c["bound_s"] is None for c in timed)  # no card for a CPU: no bound claimed
    assert "<table" in (tmp_path / "r" / "kernels.html").read_text()
    bad = run_cli(*common, "--backend", "planted:mla_scale_128", "--ops", "gated_mla_prefill")
    assert bad.returncode == 1 and "FAIL" in bad.stdout and "gated_mla_prefill, case random" in bad.stdout
    for args, needle in ((["--backend", "no_such_mod"], "cannot import"), (["--ops", "bogus_op"], "not a custom op"),
                         (["--dtype", "fp7"], "--dtype fp7")):
        r = run_cli(*common, *args)
        assert r.returncode == 2 and needle in r.stderr, (args, r.stderr[-500:])


def test_lut_decode_is_bit_identical_to_the_codec():
    codes = torch.arange(256, dtype=torch.uint8).repeat(256, 1)  # every byte of codes ...
    scales = torch.arange(256, dtype=torch.uint8)[:, None].repeat(1, 16)  # ... under every E8M0 byte
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        a, b = mxfp4.dequantize(codes, scales, dtype), mxfp4_lut_decode(codes, scales, dtype)
        assert torch.equal(a.isnan(), b.isnan())
        fin = ~a.isnan()
        assert torch.equal(a[fin], b[fin]) and torch.equal(torch.signbit(a[fin]), torch.signbit(b[fin]))


def test_the_reference_backend_is_the_executor(tiny_ckpt):
    """Through the op interface the executor computes the same bits as without it, in its
    readable forms (the reference ops are those forms; the fast ones are tests/test_executor_fast.py's)."""
    from k3bundle.executor import Executor, SourceWeights

    w = SourceWeights(tiny_ckpt, dtype="bfloat16", resident=True)
    ids = list(range(3, 150))
    plain, cache = Executor(w, forms="readable").prefill(ids)
    via, cache2 = Executor(w, ops=backends.load("reference")).prefill(ids)
    assert torch.equal(plain, via)
    assert torch.equal(Executor(w, forms="readable").decode(7, cache),
                       Executor(w, ops=backends.load("reference")).decode(7, cache2))


def _install_entry_point(site: Path, name: str, target: str) -> None:
    """A distribution as pip leaves one in site-packages (PEP 376 .dist-info with the entry-point
    file of the packaging spec), declaring backend ``name`` -> module ``target``."""
    info = site / "k3bundle_example_backend-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: k3bundle-example-backend\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[{backends.ENTRY_POINT_GROUP}]\n{name} = {target}\n")


def test_an_installed_entry_point_backend_loads_by_name(tiny_ckpt, tmp_path, monkeypatch):
    import importlib

    site = tmp_path / "site"
    _install_entry_point(site, "example-vendor", "tests.backends.one_op")
    with pytest.raises(K3Error, match="cannot import"):  # not installed yet: an unknown name
        backends.load("example-vendor")
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    b = backends.load("example-vendor")
    assert b.name == "one-op example" and set(b.ops) == {"gated_mla_prefill"}
    # the command line finds it the same way, as a user's installed package, and runs its op
    repo = Path(__file__).resolve().parents[1]
    r = run_cli("kernels", "--target", "h200-tp16-ep16", "--config", str(tiny_ckpt / "config.json"), "--tokens", "96",
                "--reps", "1", "--backend", "example-vendor", "--ops", "gated_mla_prefill", "--out", str(tmp_path / "r"),
                env={"PYTHONPATH": os.pathsep.join([str(site), str(repo)])})
    assert r.returncode == 0, r.stderr[-1500:]
    data = json.loads((tmp_path / "r" / "kernels.json").read_text())
    assert data["passed"] and [o["status"] for o in data["ops"] if o["op"] == "gated_mla_prefill"] == ["pass"], data


def test_the_documented_contracts_are_the_contract_table():
    assert block("kernels.md", "contracts") == contracts_markdown(), "rerun `python -m tests._docs`"


@pytest.mark.parametrize("module", ["k3bundle.kernels.reference", "k3bundle.kernels.torch_ops",
                                    "k3bundle.kernels.fla_kda", "tests.backends.one_op"])
def test_every_implementation_takes_the_documented_call(module):
    """Each shipped op's signature has the contract's positional arguments in order, and its
    keywords (a keyword with a default in the contract may be absent from the call, so the
    implementation must default it too)."""
    mod = importlib.import_module(module)
    for op, c in OP_CONTRACTS.items():
        fn = getattr(mod, op, None)
        if fn is None:
            continue
        params = inspect.signature(fn).parameters.values()
        positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        keywords = {p.name: p.default for p in params if p.kind == p.KEYWORD_ONLY}
        assert positional == [a.name for a in c.args], (module, op)
        assert {k.name for k in c.keywords} <= set(keywords), (module, op)
        assert all(keywords[k.name] is not inspect.Parameter.empty for k in c.keywords if k.default), (module, op)
        assert all(v is not inspect.Parameter.empty for k, v in keywords.items()
                   if k not in {a.name for a in c.keywords}), (module, op)  # extra keywords need defaults


def test_the_one_op_example_is_its_own_code():
    from tests.backends import one_op

    assert one_op.gated_mla_prefill.__module__ == "tests.backends.one_op"


MISSPELT = '''
import torch

NAME = "misspelt"


def gated_mla_prefil(q, k, v, gate, *, offset, scale):  # one letter short: no op
    raise AssertionError("never called")


def causal_short_conv1d_with_state(u, weight, state):
    from k3bundle.kernels.reference import causal_short_conv1d_with_state as ref
    return ref(u, weight, state)


def helper(x):  # public, but near no op name
    return x
'''


def test_a_function_near_an_op_name_is_warned_and_a_module_in_the_working_directory_loads(tiny_ckpt, tmp_path):
    (tmp_path / "my_vendor_ops.py").write_text(MISSPELT)
    repo = Path(__file__).resolve().parents[1]
    # -P: the working directory is not on sys.path, as for the installed `k3bundle` script
    r = subprocess.run([sys.executable, "-P", "-m", "k3bundle", "kernels", "--target", "h200-tp16-ep16",
                        "--config", str(tiny_ckpt / "config.json"), "--tokens", "96", "--reps", "0",
                        "--backend", "my_vendor_ops", "--ops", "causal_short_conv1d_with_state", "--json"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": str(repo)})
    assert r.returncode == 0, r.stderr[-1500:]
    warnings = [line for line in r.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "'gated_mla_prefil'" in warnings[0] and "'gated_mla_prefill'" in warnings[0], r.stderr
    assert "helper" not in r.stderr and "torch" not in warnings[0]
    data = json.loads(r.stdout)
    assert [o["status"] for o in data["ops"] if o["op"] == "causal_short_conv1d_with_state"] == ["pass"]


def test_a_module_of_misspelt_ops_only_is_refused_with_the_near_name(tmp_path, monkeypatch):
    (tmp_path / "only_misspelt.py").write_text("def kda_recurent_decode(*a, **k):\n    pass\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the working directory is added for this test only
    with pytest.raises(K3Error, match="defines none of the ops.*'kda_recurent_decode'.*'kda_recurrent_decode'"):
        backends.load("only_misspelt")
