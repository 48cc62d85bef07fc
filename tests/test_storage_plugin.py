"""A storage format k3bundle does not ship, installed the way a package would install it.

``tests/plugins/k3toy_int8.py`` (INT8 codes, one BF16 scale per 64 columns of a row) is copied
into a temporary directory with a ``.dist-info`` naming it as an entry point of group
``k3bundle.storage_formats``; with nothing else changed, a layout stores the dense and shared-
expert FFNs of the trained tiny model in it, and the chain runs on the command line: convert ->
verify --source -> trace -> golden -> validate. Trace's answers for the format's bytes are
checked against the arithmetic written here and against the bytes themselves.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from tests._bundles import raw_tensor
from tests.conftest import REPO, run_cli

PLUGIN = Path(__file__).parent / "plugins" / "k3toy_int8.py"
NAME, GROUP = "int8-g64", 64


def _install(site: Path) -> None:
    """The module and a dist-info with its entry point, as ``pip install`` would leave them."""
    site.mkdir()
    shutil.copy(PLUGIN, site / PLUGIN.name)
    info = site / "k3toy_int8-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: k3toy-int8\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[k3bundle.storage_formats]\n{NAME} = k3toy_int8\n")


def _layout(path: Path) -> Path:
    data = yaml.safe_load((REPO / "tests" / "layouts" / "tiny-tp2.yaml").read_text())
    data.update(name="tiny-tp2-int8", description="test layout: the FFNs in a format from an installed package",
                formats={"dense.*": NAME, "moe.shared.*": NAME, "*": "source"})
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _bf16_values(raw: bytes) -> np.ndarray:
    """BF16 bytes -> float32 values (the top half of an IEEE single)."""
    return (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)


@pytest.fixture(scope="module")
def chain(tmp_path_factory, tiny_trained_ckpt):
    root = tmp_path_factory.mktemp("plugin")
    _install(root / "site")
    env = {"PYTHONPATH": os.pathsep.join([str(root / "site"), str(REPO), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    bundle = root / "bundle"
    r = run_cli("convert", str(tiny_trained_ckpt), "--target", str(_layout(root / "layout.yaml")),
                "--out", str(bundle), env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    return {"root": root, "env": env, "bundle": bundle, "src": tiny_trained_ckpt,
            "index": json.loads((bundle / "weights.index.json").read_text())}


def test_without_the_package_the_format_is_unknown(chain, tmp_path):
    r = run_cli("plan", "--target", str(_layout(tmp_path / "layout.yaml")), "--source", str(chain["src"]))
    assert r.returncode == 2 and f"unknown format '{NAME}'" in r.stderr


def test_a_format_taking_a_known_name_or_failing_to_import_is_refused(chain, tmp_path):
    from k3bundle.errors import K3Error
    from k3bundle.storage import LAYOUT_NAMES, STORAGE, register
    from k3bundle.storage.fp8_channel import FP8Channel

    before = (dict(STORAGE), dict(LAYOUT_NAMES))
    with pytest.raises(K3Error, match="other.module: the name 'fp8-e4m3-channel' is taken"):
        register(FP8Channel(), "other.module")
    assert (STORAGE, LAYOUT_NAMES) == before
    site = tmp_path / "site"
    _install(site)
    (site / PLUGIN.name).write_text("import k3toy_missing_dependency\n")
    r = run_cli("plan", "--target", str(_layout(tmp_path / "layout.yaml")), "--source", str(chain["src"]),
                env={"PYTHONPATH": os.pathsep.join([str(site), str(REPO)])})
    assert r.returncode == 2 and f"storage format entry point '{NAME}' (k3toy_int8): cannot import it" in r.stderr


def test_convert_writes_the_parts_the_format_declares(chain):
    mine = [e for e in chain["index"]["tensors"] if e["storage"] == NAME]
    assert {e["role"] for e in mine} == {"dense.gate_proj", "dense.up_proj", "dense.down_proj",
                                         "moe.shared.gate_proj", "moe.shared.up_proj", "moe.shared.down_proj"}
    for e in mine:
        rows = e["source"]["rows"][1] - e["source"]["rows"][0]
        cols = e["source"]["cols"][1] - e["source"]["cols"][0]
        want = ("I8", [rows, cols]) if e["part"] == "weight" else ("BF16", [rows, cols // GROUP])
        assert (e["dtype"], e["shape"]) == want, e["key"]
        assert e["transform"] == NAME
    manifest = json.loads((chain["bundle"] / "device_weights" / "quantization_config.json").read_text())
    assert any(g["format"] == "int-quantized" and g["weights"]["group_size"] == GROUP
               for g in manifest["config_groups"].values())


def test_verify_rederives_and_value_checks_the_format(chain):
    r = run_cli("verify", str(chain["bundle"]), "--source", str(chain["src"]), "--json", env=chain["env"])
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-2000:])
    report = json.loads(r.stdout)
    assert report["ok"] and report["rederived_files"] > 0


def _expected(e: dict, offset: int) -> dict:
    """The source of a byte of an ``int8-g64`` part, worked out here from the index entry."""
    s = e["source"]
    (r0, _), (c0, _), width = s["rows"], s["cols"], s["logical_shape"][1]
    if e["part"] == "weight":  # I8 [rows, cols]: one byte, one element
        i, j = divmod(offset, e["shape"][1])
        k0, k1 = c0 + j, c0 + j + 1
    else:  # BF16 [rows, cols / 64]: two bytes, one group of a row
        i, g = divmod(offset // 2, e["shape"][1])
        k0, k1 = c0 + GROUP * g, c0 + GROUP * (g + 1)
    row = r0 + i
    return {"file": s["file"], "key": s["key"], "rows": [row, row + 1], "cols": [k0, k1],
            "bytes": [(row * width + k0) * 2, (row * width + k1) * 2]}


def test_trace_maps_the_format_bytes_back_to_their_source(chain):
    bundle, index = chain["bundle"], chain["index"]
    down = {e["part"]: e for e in index["tensors"]  # rank 1 holds columns 256..511: a slice that starts inside
            if e["storage"] == NAME and e["rank"] == 1 and e["role"] == "dense.down_proj"}
    assert down["weight"]["source"]["cols"][0] > 0
    rng = random.Random(0)
    asks = [(e, rng.randrange(e["byte_range"][1] - e["byte_range"][0])) for e in down.values() for _ in range(12)]
    code = ("import json, sys\nfrom k3bundle.provenance.trace import trace\n"
            "asks = json.loads(sys.argv[1])\n"
            "print(json.dumps([trace(sys.argv[2], r, k, o)['byte'] for r, k, o in asks]))")
    r = subprocess.run([sys.executable, "-c", code, json.dumps([[e["rank"], e["key"], o] for e, o in asks]),
                        str(bundle)], capture_output=True, text=True, env={**os.environ, **chain["env"]}, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    _, weight = raw_tensor(bundle / down["weight"]["file"], down["weight"]["key"])
    _, scale = raw_tensor(bundle / down["scale"]["file"], down["scale"]["key"])
    q = np.frombuffer(weight, dtype=np.int8).reshape(down["weight"]["shape"])
    scales = _bf16_values(scale).reshape(down["scale"]["shape"])
    _, source = raw_tensor(chain["src"] / down["weight"]["source"]["file"], down["weight"]["source"]["key"])
    for (e, offset), got in zip(asks, json.loads(r.stdout)):
        want = _expected(e, offset)
        assert got["source"] == want and not got["padding"], (e["part"], offset)
        values = _bf16_values(source[slice(*want["bytes"])])
        i = want["rows"][0] - e["source"]["rows"][0]
        j = want["cols"][0] - e["source"]["cols"][0]
        s = scales[i, j // GROUP]
        if e["part"] == "weight":  # the code at this byte times its group's scale is that element, to a step
            assert abs(float(q[i, j]) * s - values[0]) <= s
        else:  # the scale at this byte is the largest magnitude of exactly those 64 elements / 127
            assert len(values) == GROUP and abs(s - np.abs(values).max() / 127) <= s * 2.0**-8  # BF16 rounding
    cli = run_cli("trace", str(bundle), "1", down["scale"]["key"], "--offset", "2", "--json", env=chain["env"])
    assert cli.returncode == 0, cli.stderr
    assert json.loads(cli.stdout)["byte"]["source"] == _expected(down["scale"], 2)


def test_validate_signs_off_the_bundle(chain):
    bundle, cases = chain["bundle"], chain["root"] / "cases"
    cases.mkdir()
    shutil.copy(REPO / "golden" / "cases" / "greedy.yaml", cases)
    r = run_cli("golden", str(bundle), "--out", str(bundle / "validation"), "--cases", str(cases), env=chain["env"])
    assert r.returncode == 0, r.stderr[-2000:]
    r = run_cli("validate", str(bundle), "--json", env=chain["env"])
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-2000:])
    assert {c["name"]: c["status"] for c in json.loads(r.stdout)["cases"]} == {"greedy": "pass"}
