"""validate on CUDA: merged on one GPU, one NCCL process per rank on two (skipped without GPUs).

The clean TP=2 and TP=2+EP=2 bundles must pass every case with goldens made on the GPU; the
faults of ``test_validate.py`` must be located to the same layer and tap under NCCL as under
gloo; goldens made on CUDA and on CPU must agree to float32 noise.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from k3bundle.golden.generate import generate_goldens
from k3bundle.golden.store import read_npz
from tests.conftest import REPO
from tests.test_validate import (  # noqa: F401  (the module fixture is shared)
    _copy, _entry, _first, _patch, _validate, work,
)

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
gpu = [pytest.mark.gpu, pytest.mark.skipif(GPUS < 1, reason="needs a CUDA device")]
multi_gpu = [pytest.mark.multi_gpu, pytest.mark.skipif(GPUS < 2, reason="needs two CUDA devices")]
CASES = ("greedy", "thinking", "tool_call", "multi_turn", "long_context", "image")
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@pytest.fixture(scope="module")
def cuda_goldens(work, tmp_path_factory):
    """Goldens of the five text cases (long context at 2,048 tokens), made on the GPU and on CPU."""
    root = tmp_path_factory.mktemp("cuda-goldens")
    cases = root / "cases"
    cases.mkdir()
    for name in CASES:
        shutil.copy(REPO / "golden" / "cases" / f"{name}.yaml", cases)
    src = work["tiny-tp2"]
    out = {}
    for dev in ("cuda", "cpu"):
        out[dev] = root / dev
        generate_goldens(src, out=out[dev], cases_dir=cases, long_tokens=2048, device=dev)
    return out


def _with_goldens(bundle, goldens, tmp_path):
    b = _copy(bundle, tmp_path)
    shutil.rmtree(b / "validation")
    shutil.copytree(goldens, b / "validation")
    return b


@pytest.mark.parametrize("name,ranks", [
    pytest.param("tiny-tp2", "merged", marks=gpu),
    pytest.param("tiny-tp2", "distributed", marks=multi_gpu),
    pytest.param("tiny-ep2", "distributed", marks=multi_gpu),
])
def test_clean_bundle_passes_every_case_on_cuda(work, cuda_goldens, tmp_path, name, ranks):
    b = _with_goldens(work[name], cuda_goldens["cuda"], tmp_path)
    r, data = _validate(b, "--device", "cuda", "--ranks", ranks, env=NCCL_ENV)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-2000:])
    status = {c["name"]: c["status"] for c in data["cases"]}
    assert status == {c: "pass" for c in CASES}


@pytest.mark.gpu
@pytest.mark.skipif(GPUS < 1, reason="needs a CUDA device")
def test_cuda_and_cpu_goldens_agree_to_float32_noise(cuda_goldens):
    a = read_npz(cuda_goldens["cuda"] / "golden_intermediates.npz")
    b = read_npz(cuda_goldens["cpu"] / "golden_intermediates.npz")
    worst: dict[str, float] = {}
    for k, x in a.items():
        if k == "__meta__" or x.dtype.kind != "f" or "/decode" in k or "step_logits" in k:
            continue
        y = b[k].astype(np.float64)
        nmse = float(((x - y) ** 2).sum() / max((y ** 2).sum(), 1e-30))
        kind = k.rsplit(".", 1)[-1].rsplit("/", 1)[-1]
        worst[kind] = max(worst.get(kind, 0.0), nmse)
    print("CUDA vs CPU goldens, worst NMSE per tap kind:", {k: f"{v:.1e}" for k, v in sorted(worst.items())})
    assert worst and max(worst.values()) < 1e-8, worst


FAULTS = ["dt_bias", "experts", "scale", "transpose"]


def _fault(work, tmp_path, fault):
    b = _copy(work["tiny-ep2" if fault == "experts" else "tiny-tp2"], tmp_path)
    golden = read_npz(work["golden"] / "golden_intermediates.npz")
    if fault == "dt_bias":
        _patch(b, _entry(b, 1, "layers.2.self_attn.dt_bias"), lambda t: -t)
        return b, (2, "layers.2.mixer_out")
    if fault == "experts":
        ids = golden["greedy/layers.1.router_ids"]
        e0 = int([e for e in np.unique(ids) if e < 8][0])
        e1 = int([e for e in np.unique(ids) if e >= 8][0])
        from k3bundle.io import SafetensorsFile
        for w in ("w1.weight_packed", "w2.weight_packed", "w3.weight_packed",
                  "w1.weight_scale", "w2.weight_scale", "w3.weight_scale"):
            a = _entry(b, 0, f"layers.1.block_sparse_moe.experts.{e0}.{w}")
            c = _entry(b, 1, f"layers.1.block_sparse_moe.experts.{e1}.{w}")
            with SafetensorsFile(b / a["file"]) as fa, SafetensorsFile(b / c["file"]) as fc:
                ta, tc = fa.get(a["key"]), fc.get(c["key"])
            _patch(b, a, lambda t: tc)
            _patch(b, c, lambda t: ta)
        return b, (1, "layers.1.ffn_out")
    if fault == "scale":
        vals, counts = np.unique(golden["greedy/layers.4.router_ids"], return_counts=True)
        entry = _entry(b, 0, f"layers.4.block_sparse_moe.experts.{int(vals[counts.argmax()])}.w2.weight_scale")

        def bump(t):
            t[0, 0] = t[0, 0] + 8
            return t
        _patch(b, entry, bump)
        return b, (4, "layers.4.ffn_out")
    _patch(b, _entry(b, 0, "layers.0.mlp.gate_proj.weight"), lambda t: t.t())
    return b, (0, "layers.0.ffn_out")


@pytest.mark.parametrize("ranks", [pytest.param("merged", marks=gpu), pytest.param("distributed", marks=multi_gpu)])
@pytest.mark.parametrize("fault", FAULTS)
def test_faults_are_located_on_cuda_as_on_cpu(work, tmp_path, fault, ranks):
    b, where = _fault(work, tmp_path, fault)
    r, data = _validate(b, "--device", "cuda", "--ranks", ranks, env=NCCL_ENV)
    assert r.returncode == 1, (r.stdout[-2000:], r.stderr[-2000:])
    assert _first(data) == where


@pytest.mark.gpu
@pytest.mark.skipif(GPUS < 1, reason="needs a CUDA device")
def test_the_exact_check_runs_on_cuda_and_sees_a_weight_change_below_bf16(work, tmp_path):
    """CPU goldens of the bundle itself, validated on the GPU: the exact check runs under the
    ``exact_gpu`` limits (float32, TF32 off), passes the clean bundle, and locates a 1e-3
    relative change of layer 5's mixer weights — below BF16's resolution, so no added check can."""
    import random

    from k3bundle.calibrate.weight_faults import perturb_layer
    b = _copy(work["tiny-tp2"], tmp_path)
    shutil.rmtree(b / "validation")
    cases = tmp_path / "cases"
    cases.mkdir()
    shutil.copy(REPO / "golden" / "cases" / "greedy.yaml", cases)
    generate_goldens(b, cases_dir=cases, device="cpu")
    r, data = _validate(b, "--device", "cuda")
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-2000:])
    assert data["exact_check"].startswith("ran: float32 on cuda against goldens made on cpu"), data["exact_check"]
    where = perturb_layer(1e-3)(b, read_npz(b / "validation" / "golden_intermediates.npz"), random.Random(0))
    r, data = _validate(b, "--device", "cuda")
    assert r.returncode == 1, (r.stdout[-3000:], r.stderr[-2000:])
    ff = [c for c in data["cases"] if c["status"] == "fail"][0]["first_failure"]
    assert (ff["layer"], ff["tap"], ff["mode"]) == (where.layer, where.tap, "exact_gpu")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu)])
def test_the_distributed_path_runs_at_world_size_one(work, tmp_path, device):
    """``--ranks distributed`` on a one-rank layout: every collective of the rank workers
    (``all_reduce`` of partial sums, ``all_gather`` of logits and KDA heads) runs through the
    process group, NCCL on CUDA and gloo on CPU. One GPU is enough to catch a host tensor handed
    to NCCL (it refuses CPU tensors even at world size 1) before two GPUs are at hand; the CPU
    run checks the same path under gloo, and both must pass every case."""
    from k3bundle.convert import convert

    layout = tmp_path / "tiny-tp1.yaml"
    text = (REPO / "tests" / "layouts" / "tiny-tp2.yaml").read_text()
    layout.write_text(text.replace("tiny-tp2", "tiny-tp1").replace("count: 2", "count: 1").replace("tp: 2", "tp: 1"))
    b = tmp_path / "tiny-tp1"
    convert(work["src"], str(layout), b, workers=1)
    shutil.copytree(work["golden"], b / "validation")
    r, data = _validate(b, "--device", device, "--ranks", "distributed", env=NCCL_ENV)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-2000:])
    status = {c["name"]: c["status"] for c in data["cases"]}
    assert status == {"greedy": "pass", "long_context": "pass", "image": "pass"}, status
    r, _ = _validate(b, "--device", device, "--ranks", "distributed", "--nproc", "2")  # the rank path it took
    assert r.returncode != 0 and "the layout has 1 ranks, --nproc 2 differs" in r.stderr, r.stderr[-2000:]
