"""k3bundle checklist: full-K3 capacity and roofline numbers derived by hand (docs/bring-up.md),
capacity verdicts with their sentences, a complete checklist for the example accelerator, and
stages ticked only from evidence."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from k3bundle.bundle.graph import graph_manifest
from k3bundle.checklist import CAPACITY_MARGIN, ChecklistError, make_checklist, to_markdown, write_checklist
from k3bundle.checklist.quantity import gb
from k3bundle.checklist.render import SECTIONS
from k3bundle.checklist.stages import REQUIRED_CASE_KINDS
from k3bundle.ops.contract import OP_CONTRACTS
from tests.conftest import REPO, run_cli

# ------------------------------------------------------------------------------------------
# b300-tp8, full K3, by hand from spec/kimi-k3.md §1-§2 and §5.3 (docs/bring-up.md, "Hand derivation").
# D 7168, P = 96 heads x 128 = 12288, TP 8 -> 1536 rows of a head-split projection per rank.
BF16, F32 = 2, 4
KDA_LAYER = (4 * 1536 * 7168 * BF16  # q, k, v, g_proj: 1536 of 12288 rows
             + 7168 * 1536 * BF16  # o_proj: 1536 of 12288 columns
             + 3 * 1536 * 4 * F32  # q/k/v conv1d [1536, 1, 4] F32
             + 128 * 7168 * BF16  # f_a_proj, replicated
             + 1536 * 128 * BF16  # f_b_proj
             + 1536 * F32 + 12 * F32  # dt_bias, A_log (12 real heads, no padding)
             + 12 * 7168 * BF16  # b_proj
             + 128 * F32)  # o_norm, replicated
MLA_LAYER = (1536 * 7168 * BF16 + 1536 * BF16  # q_a_proj + q_a_layernorm, replicated
             + 2304 * 1536 * BF16  # q_b_proj: 18432 / 8 rows
             + 576 * 7168 * BF16 + 512 * BF16  # kv_a_proj_with_mqa + kv_a_layernorm, replicated
             + 3072 * 512 * BF16  # kv_b_proj: 24576 / 8 rows
             + 2 * 1536 * 7168 * BF16)  # g_proj rows, o_proj columns
EVERY_LAYER = 6 * 7168 * BF16  # 4 norms + 2 AttnRes pseudo-queries [1, 7168]
GLOBALS = 3 * 7168 * BF16  # final norm, output AttnRes norm + pseudo-query
DENSE_LAYER0 = 3 * 4224 * 7168 * BF16  # gate/up rows, down columns: 33792 / 8
MOE_LAYER = (896 * 7168 * BF16 + 896 * F32  # router + correction bias, replicated
             + 2 * 3584 * 7168 * BF16 + 3584 * BF16  # latent down/up + norm, replicated
             + 3 * 768 * 7168 * BF16)  # shared experts: 6144 / 8
EMBED_HEAD = 2 * 20480 * 7168 * BF16  # 163840 / 8 vocabulary rows each
VISION = (1024 * 3 * 14 * 14 * BF16 + 64 * 64 * 1024 * BF16 + 1024 * BF16  # patch embed, pos emb, final norm
          + 27 * (2 * 1024 + 4608 * 1024 + 1024 * 1536 + 2 * 4096 * 1024) * BF16  # 27 blocks
          + (4096 * 4096 + 7168 * 4096 + 7168) * BF16)  # projector
# routed experts, NVFP4, TP8 inside an expert: 384 of 3072 intermediate; per row packed in/2 + one
# E4M3 scale per 16 (swizzled 128x4 adds nothing: 384 and 3584 rows are whole 128s, 224 and 24
# scale columns whole 4s) + one F32 global scale per tensor
EXPERT = 2 * 384 * (3584 // 2 + 3584 // 16) + 3584 * (384 // 2 + 384 // 16) + 3 * F32

HAND = {
    "kda_layer": 112_581_168, "mla_layer": 84_545_536, "moe_layer": 148_646_400, "expert": 2_322_444,
    "vision": 894_717_952,
    "weights_per_rank": 216_587_994_864,
    "mla_latent_per_token": 27_648,  # 24 MLA layers x 576 values x 2 B
    "kda_per_request": 449_372_160,  # 69 x (96*128*128*4 + 3*12288*3*2)
    "kda_per_request_per_rank": 56_171_520,  # / 8
    "free": 31_412_005_136,  # 288e9 - 40e9 - weights
    "tokens_fit": 1_136_140,  # floor(free / 27,648)
    "per_request_128k": 3_680_050_176,  # 131,072 x 27,648 + 56,171,520
    "requests_fit_128k": 8,
    "requests_at_margin_128k": 1,  # floor((free - 24.8e9) / per request)
    "decode_bytes_128k": 248_886_648_704,
}


def test_hand_arithmetic_is_consistent():
    assert KDA_LAYER == HAND["kda_layer"] and MLA_LAYER == HAND["mla_layer"]
    assert MOE_LAYER == HAND["moe_layer"] and EXPERT == HAND["expert"] and VISION == HAND["vision"]
    total = (69 * KDA_LAYER + 24 * MLA_LAYER + 93 * EVERY_LAYER + GLOBALS + DENSE_LAYER0 + 92 * MOE_LAYER
             + EMBED_HEAD + VISION + 92 * 896 * EXPERT)
    assert total == HAND["weights_per_rank"]
    assert 24 * 576 * BF16 == HAND["mla_latent_per_token"]
    assert 69 * (96 * 128 * 128 * F32 + 3 * 12288 * 3 * BF16) == HAND["kda_per_request"]
    assert 288_000_000_000 - 40_000_000_000 - total == HAND["free"]
    assert HAND["free"] // 27_648 == HAND["tokens_fit"]


@pytest.fixture(scope="module")
def b300():
    return make_checklist("b300-tp8", context=131_072, batch=1)


def _q(quantities, key):
    return next(q for q in quantities if q.key == key).value


def test_b300_capacity_matches_the_hand_derivation(b300):
    c = b300.capacity
    q = c.quantities
    assert _q(q, "weights_bytes_per_rank") == HAND["weights_per_rank"]
    assert _q(q, "mla_latent_bytes_per_token") == HAND["mla_latent_per_token"]
    assert _q(q, "kda_state_bytes_per_request_total") == HAND["kda_per_request"]
    assert _q(q, "kda_state_bytes_per_request") == HAND["kda_per_request_per_rank"]
    assert _q(q, "free_bytes_per_rank") == HAND["free"]
    assert c.tokens_fit == HAND["tokens_fit"]
    assert _q(q, "cache_bytes_per_request") == HAND["per_request_128k"]
    assert c.concurrency == HAND["requests_fit_128k"]
    assert c.concurrency_at_margin == HAND["requests_at_margin_128k"]
    assert c.margin == pytest.approx((HAND["free"] - HAND["per_request_128k"]) / 248e9)
    assert c.passed and c.verdict.startswith("PASS: margin 11.2%")
    # a second request of 128k tokens breaks the 10% margin: said with the shortfall
    two = make_checklist("b300-tp8", context=131_072, batch=2).capacity
    short = int(CAPACITY_MARGIN * 248e9) - (HAND["free"] - 2 * HAND["per_request_128k"])
    assert not two.passed and f"{gb(short)} short of the 10% margin" in two.verdict


def test_b300_decode_bound_matches_the_hand_derivation(b300):
    d = b300.roofline.decode
    assert _q(d.bytes, "decode_bytes_total") == HAND["decode_bytes_128k"]
    assert _q(d.bytes, "decode_bytes_experts") == pytest.approx(8 * 92 * 896 * EXPERT * 16 / 896)
    assert _q(d.bytes, "decode_bytes_latent") == 131_072 * 27_648 * 8  # every TP rank reads the whole latent
    assert d.bound.value == pytest.approx(HAND["decode_bytes_128k"] / 8 / 8e12)  # memory-bound at batch 1
    assert d.bound_by == "memory" and "max(" in d.t_memory.formula


def test_gemm_flops_are_two_per_active_weight(b300):
    # the schema's active parameters minus what is not a GEMM weight, by hand (spec §2.4-§2.8):
    # per layer 4 norms + 2 pseudo-queries; KDA 3 convs + dt_bias + A_log (128 stored) + o_norm;
    # MLA 2 norms; MoE router bias + latent norm; final norm + output AttnRes pair
    non_gemm = (93 * 6 * 7168 + 69 * (3 * 12288 * 4 + 12288 + 128 + 128) + 24 * (1536 + 512)
                + 92 * (896 + 3584) + 3 * 7168)
    r = b300.roofline
    assert r.gemm_flops_per_token == 2 * (r.active_params - non_gemm)


def _b200_one_node(tmp_path: Path) -> Path:
    d = yaml.safe_load((REPO / "layouts" / "b200-tp8-pp2.yaml").read_text())
    d["name"], d["card"]["count"], d["parallel"]["pp"] = "b200-tp8", 8, 1
    path = tmp_path / "b200-tp8.yaml"
    path.write_text(yaml.safe_dump(d))
    return path


def test_one_8x_b200_node_does_not_hold_k3_but_two_do(tmp_path):
    one = make_checklist(str(_b200_one_node(tmp_path))).capacity
    assert not one.passed and not one.weights_fit
    w = one.limiting.weights
    assert w > 180e9  # more than the whole card
    assert f"needs {gb(w)} of weights" in one.verdict
    assert f"{gb(w - 150e9)} over" in one.verdict
    assert f"more than the whole 180.00 GB HBM, by {gb(w - 180e9)}" in one.verdict
    two = make_checklist("b200-tp8-pp2").capacity
    assert two.passed and len(two.stages) == 2 and max(s.weights for s in two.stages) < 150e9


def test_margin_failure_says_by_how_much():
    c = make_checklist("h200-tp16-ep16").capacity  # 109 GB of weights on 121 GB usable: fits, margin thin
    assert c.weights_fit and not c.passed and c.margin < CAPACITY_MARGIN
    s = c.limiting
    short = int(CAPACITY_MARGIN * c.usable) - (s.free - s.batch_bytes)
    assert c.verdict.startswith(f"FAIL: margin {c.margin:.1%} is below 10%")
    assert f"{gb(short)} short of the 10% margin" in c.verdict


def test_example_accelerator_renders_every_section():
    cl = make_checklist("new-accelerator.example")
    md = to_markdown(cl)
    for title in SECTIONS:
        assert f"## {title}" in md, title
    ops = [o["op"] for o in graph_manifest(cl.plan)["custom_ops"]]
    assert [k.op for k in cl.kernels] == ops
    for k in cl.kernels:
        assert f"`{k.op}`" in md and "no shape rule" not in k.shapes
    gemm = next(k for k in cl.kernels if k.op == "mxfp4_weight_gemm_grouped")
    assert "56 experts × [3072×3584]" in gemm.shapes  # ep 16: 896 / 16 whole experts per rank
    # the conv state in the op contract's notation, [W-1, P]: 96 KDA heads × 128 / tp 4, kernel 4
    conv = next(k for k in cl.kernels if k.op == "causal_short_conv1d_with_state")
    assert OP_CONTRACTS[conv.op].args[2].shape == "[W-1, P]"
    assert "u [T, 3072], weight [3072, 1, 4] F32, state [3, 3072] → out [T, 3072], state [3, 3072]" in conv.shapes, \
        conv.shapes
    for key in ("oom", "collective_timeout", "bad_page", "device_reset"):
        assert f"`{key}`" in md
    assert "24–72 h" in md
    assert [s.key for s in cl.stages] == ["capacity", "conversion", "golden", "per_layer_numerics", "end_to_end",
                                         "performance", "fault_paths", "soak", "signoff"]
    assert all(not s.done and s.missing for s in cl.stages[1:])  # no bundle: nothing but capacity is proven
    for phase in (cl.roofline.decode, cl.roofline.prefill):
        assert phase.bound.value > 0
        for q in (*phase.bytes, *phase.flops, phase.t_memory, phase.t_compute, phase.bound):
            assert q.formula and f"| {q.label} |" in md.replace("\\|", "|")
    # fp8 and mxfp4-from-bf16 GEMMs run at their own peaks
    assert "[fp8]" in md and "[mxfp4]" in md
    json.dumps(cl.to_dict())


# ------------------------------------------------------------------------------------------
# evidence: a tiny bundle converted here (one torch thread: the MXFP4 encoder is ~30x slower
# with OpenMP on 2 cores)


@pytest.fixture(scope="module")
def tiny_bundle(tmp_path_factory) -> Path:
    from k3bundle.convert import convert
    from k3bundle.synth import write_synthetic

    root = tmp_path_factory.mktemp("checklist")
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        write_synthetic(root / "tiny", preset="tiny", seed=0)
        convert(root / "tiny", "b300-tp8", root / "bundle", workers=1)
    finally:
        torch.set_num_threads(n)
    return root / "bundle"


def _stages(bundle: Path) -> dict:
    return {s.key: s for s in make_checklist("b300-tp8", bundle=bundle).stages}


def _fake_goldens(bundle: Path, cases: list[dict]) -> str:
    """Golden files with only their metadata: the evidence reader looks at nothing else."""
    from k3bundle.golden.store import meta_array, write_npz

    digest = "ab" * 32
    meta = {"content_hash": digest, "dtype": "float32", "cases": cases}
    v = bundle / "validation"
    v.mkdir(exist_ok=True)
    write_npz(v / "golden_inputs.npz", {"__meta__": meta_array(meta)})
    write_npz(v / "golden_intermediates.npz", {"__meta__": meta_array(meta)}, compress=True)
    (v / "tolerances.yaml").write_text("name: bf16\n")
    return digest


def _signoff_of(bundle: Path, digest: str, cases: list[dict], reports: list[dict], **fields) -> dict:
    """A hand-written sign-off bound to ``bundle`` as it is (manifest, goldens ``digest``, tolerance
    file, case list), with the case ``reports``."""
    def sha256(path: Path) -> str:
        return hashlib.sha256(path.read_bytes()).hexdigest()

    return {"schema_version": 1, "golden_content_hash": digest, "mode": "device", "device": "cpu",
            "bundle_manifest_sha256": sha256(bundle / "manifest.json"),
            "tolerances_sha256": sha256(bundle / "validation" / "tolerances.yaml"),
            "case_list": [c["name"] for c in cases], "tolerances": "bf16", "passed": True, "cases": reports,
            **fields}


def _write(bundle: Path, rel: str, doc: dict) -> None:
    (bundle / rel).parent.mkdir(parents=True, exist_ok=True)
    (bundle / rel).write_text(json.dumps(doc))


def test_stages_tick_only_from_evidence(tiny_bundle, tmp_path):
    # This tests the checklist's evidence reader with hand-written reports; it does not run golden
    # or validate (their own tests do).
    b = tmp_path / "b"
    shutil.copytree(tiny_bundle, b)
    st = _stages(b)
    assert st["capacity"].done and st["conversion"].done
    assert "re-hashed" in st["conversion"].evidence and "level sample" in st["conversion"].evidence
    assert not st["golden"].done and "validation/ lacks golden_inputs.npz" in st["golden"].missing
    for key in ("per_layer_numerics", "end_to_end", "performance", "fault_paths", "soak", "signoff"):
        assert not st[key].done and st[key].missing, key

    cases = [{"name": k, "kind": k, "status": "ok"} for k in REQUIRED_CASE_KINDS]
    digest = _fake_goldens(b, cases)
    st = _stages(b)
    assert st["golden"].done and f"{len(cases)} of {len(cases)} cases computed" in st["golden"].evidence
    assert not st["per_layer_numerics"].done and st["per_layer_numerics"].missing == "no sign-off in reports/validate/"

    def case(kind, status="pass", layer_ok=True):
        return {"name": kind, "kind": kind, "status": status, "layer_checks": "ran", "results": [
            {"tap": "layer.mixer_out", "layer": 3, "mode": "added", "passed": layer_ok},
            {"tap": "logits", "layer": None, "mode": "distribution", "passed": True}]}

    signoff = _signoff_of(b, digest, cases, [case(k) for k in REQUIRED_CASE_KINDS[:-1]]
                          + [case("image", "fail", layer_ok=False)], mode="dumps", device="x", passed=False)
    _write(b, "reports/validate/dumps-x/signoff.json", signoff)
    st = _stages(b)
    assert not st["per_layer_numerics"].done and "first layer 3 `layer.mixer_out`" in st["per_layer_numerics"].missing
    assert not st["end_to_end"].done and "image: FAIL" in st["end_to_end"].missing

    signoff["cases"][-1] = case("image")
    signoff["golden_content_hash"] = "cd" * 32
    _write(b, "reports/validate/dumps-x/signoff.json", signoff)
    assert "stale" in _stages(b)["end_to_end"].missing  # judged other goldens

    signoff["golden_content_hash"] = digest
    _write(b, "reports/validate/dumps-x/signoff.json", signoff)
    st = _stages(b)
    assert st["per_layer_numerics"].done and st["end_to_end"].done and not st["signoff"].done

    bounds = make_checklist("b300-tp8", bundle=b, batch=4, context=1000).roofline
    tpot, ttft = bounds.decode.bound.value, bounds.prefill.bound.value
    perf = {"kind": "k3bundle.performance", "schema_version": 1,
            "runs": [{"batch": 4, "context": 1000, "tpot_s": tpot / 2, "ttft_s": ttft * 3}]}
    _write(b, "reports/performance.json", perf)
    assert "faster than the roofline lower bound" in _stages(b)["performance"].missing
    perf["runs"][0]["tpot_s"] = tpot * 2
    _write(b, "reports/performance.json", perf)
    st = _stages(b)
    assert st["performance"].done and "50% of roofline" in st["performance"].notes[0]

    faults = {"kind": "k3bundle.faults", "schema_version": 1, "faults": [
        {"fault": f, "outcome": "clean_error", "error": f"{f} reported", "revalidated": True}
        for f in ("oom", "collective_timeout", "bad_page")]}
    _write(b, "reports/faults.json", faults)
    assert _stages(b)["fault_paths"].missing == "device_reset: not injected"
    faults["faults"].append({"fault": "device_reset", "outcome": "hang", "error": "", "revalidated": False})
    _write(b, "reports/faults.json", faults)
    assert "device_reset: outcome 'hang'" in _stages(b)["fault_paths"].missing
    faults["faults"][-1] = {"fault": "device_reset", "outcome": "clean_error", "error": "device 3 lost",
                            "revalidated": True}
    _write(b, "reports/faults.json", faults)

    soak = {"kind": "k3bundle.soak", "schema_version": 1, "hours": 12, "host_memory_growth_bytes": 3 << 30,
            "device_memory_growth_bytes": 0, "golden_rechecks": 6, "golden_recheck_failures": 0, "hangs": 0}
    _write(b, "reports/soak.json", soak)
    missing = _stages(b)["soak"].missing
    assert "ran 12 h, needs ≥ 24 h" in missing and "host memory grew" in missing
    soak.update(hours=48, host_memory_growth_bytes=10 << 20)
    _write(b, "reports/soak.json", soak)
    st = _stages(b)
    assert all(s.done for s in st.values()), {k: s.missing for k, s in st.items() if not s.done}

    # a flipped byte in a device file un-ticks the conversion (and so the sign-off): at the default
    # level (sample) when the file is one it re-hashes, at level full wherever it is
    from k3bundle.provenance.verify import hashed_paths

    manifest = json.loads((b / "manifest.json").read_text())
    sampled = hashed_paths(manifest, "sample", 0, ())
    weights = sorted(f["path"] for f in manifest["files"] if f["path"].endswith(".safetensors"))
    inside, outside = (next(p for p in weights if (p in sampled) == want) for want in (True, False))
    for path in (inside, outside):
        data = bytearray((b / path).read_bytes())
        data[-1] ^= 1
        (b / path).write_bytes(bytes(data))
        st = _stages(b) if path == inside else {s.key: s for s in make_checklist(
            "b300-tp8", bundle=b, verify_level="full").stages}
        assert not st["conversion"].done and "problem" in st["conversion"].missing and not st["signoff"].done
        assert path in st["conversion"].missing
        data[-1] ^= 1
        (b / path).write_bytes(bytes(data))
    data = bytearray((b / outside).read_bytes())
    data[-1] ^= 1
    (b / outside).write_bytes(bytes(data))
    assert _stages(b)["conversion"].done  # not in the sample and the same size: by design not seen there


def test_kernel_shapes_are_the_op_contracts():
    """Every op with a backend contract is shown in the contract's notation: its tensors in the
    contract's order, each dimension the contract's letter with this layout's per-rank size put in
    (T, B, N, S stay letters). The KDA rows at b300-tp8 by hand: 96 KDA heads / tp 8 = 12 of
    head dim 128, per-sequence state [N, H, K, V]."""
    import re

    cl = make_checklist("b300-tp8")
    rows = {k.op: k.shapes for k in cl.kernels}
    assert rows["kda_chunked_prefill"].startswith(
        "q [T, 12, 128], k [T, 12, 128], v [T, 12, 128], g [T, 12, 128], beta [T, 12], A_log [12] F32, "
        "dt_bias [12, 128] F32, state [N, 12, 128, 128] F32, cu_seqlens [N+1] I64 → o [T, 12, 128], "
        "state [N, 12, 128, 128] F32; ")
    assert rows["kda_recurrent_decode"].startswith(
        "q [B, 12, 128], k [B, 12, 128], v [B, 12, 128], g [B, 12, 128], beta [B, 12], A_log [12] F32, "
        "dt_bias [12, 128] F32, state [B, 12, 128, 128] F32 → o [B, 12, 128], state [B, 12, 128, 128] F32; ")
    contract_ops = [op for op in rows if op in OP_CONTRACTS]
    assert len(contract_ops) >= 6
    for op in contract_ops:
        c = OP_CONTRACTS[op]
        shown = rows[op].split("; ")[0]
        ins, outs = shown.split(" → ")
        expect = [(a.name, a.shape) for a in (*c.args, *c.keywords) if a.shape], \
            [(r.name, r.shape) for r in c.returns if r.shape]
        for part, want in zip((ins, outs), expect):
            got = re.findall(r"(\w+) \[([^\]]*)\]", part)
            assert [g[0] for g in got] == [w[0] for w in want], (op, part)
            for (name, dims), (_, shape) in zip(got, want):
                spec = [d.strip() for d in shape.strip("[]").split(",")]
                dims = [d.strip() for d in dims.split(",")]
                assert len(dims) == len(spec), (op, name, dims, spec)
                for d, sp in zip(dims, spec):  # a number where the contract has sizes, its letters where not
                    assert d.isdigit() or d == sp, (op, name, d, sp)
                    if sp in ("T", "B", "N", "S", "N+1"):
                        assert d == sp, (op, name)
    md = to_markdown(cl)
    assert rows["kda_chunked_prefill"] in md


def test_the_end_to_end_stage_says_up_front_which_cases_cannot_run_yet(tiny_bundle, tmp_path):
    """The goldens hold no values for the image case (no vision tower in the executor): the stage
    names it first, with the goldens' reason; once every other case passes it gives no next step,
    since none could close it."""
    b = tmp_path / "b"
    shutil.copytree(tiny_bundle, b, ignore=shutil.ignore_patterns("*.safetensors"))
    reason = "needs vision, not in the executor yet"
    cases = [{"name": k, "kind": k, "status": "ok"} for k in REQUIRED_CASE_KINDS if k != "image"]
    cases.append({"name": "image", "kind": "image", "status": "not run", "reason": reason})
    digest = _fake_goldens(b, cases)

    def stages():
        return {s.key: s for s in make_checklist("b300-tp8", bundle=b, verify_level="manifest").stages}

    e2e = stages()["end_to_end"]
    assert e2e.missing == f"cannot run yet: image ({reason}); no sign-off in reports/validate/"
    assert e2e.next.startswith("k3bundle validate ")  # every other case can still be run

    signoff = _signoff_of(b, digest, cases, [{"name": c["name"], "kind": c["kind"], "status": "pass", "results": []}
                                             for c in cases[:-1]]
                          + [{"name": "image", "kind": "image", "status": "not run", "reason": reason}])
    _write(b, "reports/validate/builtin-cpu/signoff.json", signoff)
    e2e = stages()["end_to_end"]
    assert not e2e.done and e2e.next == ""
    assert e2e.missing == (f"cannot run yet: image ({reason}); every other case passes, so no command can close "
                           "this stage yet")
    md = to_markdown(make_checklist("b300-tp8", bundle=b, verify_level="manifest"))
    line = next(x for x in md.splitlines() if "**end-to-end cases**" in x)
    assert f"missing: cannot run yet: image ({reason})" in line and "next:" not in line

    signoff["cases"][0]["status"] = "fail"  # a case that can run fails: named after, and validate is next again
    _write(b, "reports/validate/builtin-cpu/signoff.json", signoff)
    e2e = stages()["end_to_end"]
    assert e2e.missing == f"cannot run yet: image ({reason}); {cases[0]['name']}: FAIL"
    assert e2e.next.startswith("k3bundle validate ")

    _fake_goldens(b, cases[:-1])  # goldens with no image case at all: the kind is named
    assert stages()["end_to_end"].missing.startswith("cannot run yet: image (the goldens have no image case)")


def test_each_section_says_where_its_figures_come_from(tiny_bundle, tmp_path):
    """checklist --bundle of a tiny model: capacity, roofline and kernel shapes are the bundle's
    model (its sizes named, marked as not the release), op conformance the shapes kernels ran at;
    in the Markdown, the page and the JSON alike. Without a bundle: the released config."""
    import html

    from k3bundle.checklist.html import to_html
    from k3bundle.config import load_config

    text = load_config(tiny_bundle / "config.json").text
    cl = make_checklist("b300-tp8", bundle=tiny_bundle, verify_level="manifest")
    md, page = to_markdown(cl), to_html(cl)
    model = (f"the bundle's model ({tiny_bundle / 'config.json'}) — hidden size {text.hidden_size:,}, "
             f"{text.num_hidden_layers} layers, {text.num_experts} experts (not the released Kimi K3: figures at its "
             "own sizes), placed by this layout")
    for section, title in (("capacity", "## 1. Capacity"), ("roofline", "## 2. Roofline lower bounds"),
                           ("kernels", "## 3. Kernel coverage")):
        line = md.split(title + "\n\n")[1].split("\n")[0]
        assert line == f"Source: {cl.sources[section]}" and model in line, (section, line)
        assert f"<p class='source'><b>Source:</b> {html.escape(cl.sources[section])}</p>" in page
    assert cl.sources["kernels"].endswith("Op conformance: no conformance report read (no reports/kernels.json).")
    assert md.split("## 5. Stages (sign-off order)\n\n")[1].startswith("Source: Ticked from the evidence files")
    assert cl.to_dict()["sources"] == cl.sources

    tiny_bundle_copy = tmp_path / "b"
    shutil.copytree(tiny_bundle, tiny_bundle_copy, ignore=shutil.ignore_patterns("*.safetensors"))
    report = {"kind": "k3bundle.kernel_conformance", "target": "b300-tp8", "backend": "x", "device": "cpu",
              "dtype": "bfloat16", "ops": [], "model": "/ckpt/tiny/config.json"}
    (tiny_bundle_copy / "reports").mkdir(exist_ok=True)
    (tiny_bundle_copy / "reports" / "kernels.json").write_text(json.dumps(report))
    cl = make_checklist("b300-tp8", bundle=tiny_bundle_copy, verify_level="manifest")
    assert cl.sources["kernels"].endswith(
        "Op conformance: measured by `k3bundle kernels` at the per-rank shapes of the config /ckpt/tiny/config.json.")

    released = make_checklist("b300-tp8").sources
    assert released["capacity"].startswith("Figures from the released Kimi K3 config (kimi-k3.config.json) — hidden "
                                           "size 7,168, 93 layers, 896 experts, placed by this layout")


def test_a_bundle_for_another_target_is_refused(tiny_bundle):
    with pytest.raises(ChecklistError, match="converted for layout 'b300-tp8', not 'h200-tp16-ep16'"):
        make_checklist("h200-tp16-ep16", bundle=tiny_bundle)
    with pytest.raises(ChecklistError, match="not both"):
        make_checklist("b300-tp8", bundle=tiny_bundle, config=tiny_bundle / "config.json")


def test_write_checklist_writes_markdown_and_json(tiny_bundle, tmp_path):
    out = tmp_path / "reports" / "checklist.md"
    summary = write_checklist("b300-tp8", bundle=tiny_bundle, out=out)
    assert summary.startswith("b300-tp8: capacity PASS") and "2 of 9 stages ticked" in summary
    assert out.read_text().startswith("# Bring-up checklist: b300-tp8")
    assert json.loads(out.with_suffix(".json").read_text())["kind"] == "k3bundle.checklist"


def test_cli_json_and_exit_codes(tmp_path):
    r = run_cli("checklist", "--target", "b300-tp8", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["capacity"]["tokens_fit"] == HAND["tokens_fit"] and doc["passed"]
    r = run_cli("checklist", "--target", str(_b200_one_node(tmp_path)), "--out", str(tmp_path / "c.md"))
    assert r.returncode == 1 and "capacity FAIL" in r.stdout
    assert "the weights alone do not fit" in (tmp_path / "c.md").read_text()
    with pytest.raises(ChecklistError, match=r"--context \(0\) and --batch \(1\) must be positive"):
        make_checklist("b300-tp8", context=0)  # the CLI prints it as "error: ..." and exits 2


def test_a_kernels_report_ticks_the_ops_it_covered(tiny_bundle, tmp_path):
    """reports/kernels.json (written by `k3bundle kernels`) ticks covered ops that pass, marks a
    planted bug's op failed, leaves every other op open, and ticks nothing for another layout."""
    bundle = tmp_path / "bundle"
    shutil.copytree(tiny_bundle, bundle)
    small = ("--tokens", "70", "--batch", "2", "--context", "40", "--reps", "1")
    r = run_cli("kernels", "--target", "b300-tp8", "--backend", "torch", "--out", str(bundle / "reports"), *small)
    assert r.returncode == 0, r.stderr
    cl = make_checklist("b300-tp8", bundle=bundle)
    st = {op: s for op, (s, _) in cl.op_conformance.items()}
    assert st["gated_mla_prefill"] == st["gated_mla_decode_latent_cache"] == "pass"
    assert st["kda_chunked_prefill"] == st["sigmoid_biased_topk_router"] == "open"
    assert "backend torch on cpu" in cl.op_conformance["gated_mla_prefill"][1]
    md = to_markdown(cl)
    assert "| `gated_mla_prefill` | 3 | [x] backend torch on cpu" in md  # tiny: MLA layers 3, 7, 8
    # kernels ran without --config: at the release's shapes, which the checklist says beside the tiny model's
    assert json.loads((bundle / "reports" / "kernels.json").read_text())["model"] is None
    assert ("Op conformance: measured by `k3bundle kernels` at the layout's release shapes (the released Kimi K3 "
            "config, full size), not at this model's sizes.") in md.split("## 3. Kernel coverage")[1].split("\n\n")[1]
    assert json.loads(json.dumps(cl.to_dict()))["kernels"][0]["op_conformance"] in ("pass", "open")

    r = run_cli("kernels", "--target", "b300-tp8", "--backend", "planted:mla_scale_128", "--ops", "gated_mla_prefill",
                "--out", str(bundle / "reports"), *small)
    assert r.returncode == 1, r.stderr
    cl = make_checklist("b300-tp8", bundle=bundle)
    status, evidence = cl.op_conformance["gated_mla_prefill"]
    assert status == "fail" and "case random fails" in evidence
    assert "[ ] **FAIL** backend planted:mla_scale_128" in to_markdown(cl)

    doc = json.loads((bundle / "reports" / "kernels.json").read_text())
    doc["target"] = "h200-tp16-ep16"
    (bundle / "reports" / "kernels.json").write_text(json.dumps(doc))
    cl = make_checklist("b300-tp8", bundle=bundle)
    assert {s for s, _ in cl.op_conformance.values()} == {"open"}
    assert "made for layout 'h200-tp16-ep16', not 'b300-tp8'" in cl.op_conformance["gated_mla_prefill"][1]
