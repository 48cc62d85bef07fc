"""``synth --preset tiny-trained``: the shipped trained model (bench/train_tiny.py).

Oracles: the shipped file is read with the third-party ``safetensors`` and ``zstandard``;
MXFP4 experts are decoded with an E2M1 table and E8M0 rule written here from the OCP MX
spec; conditioning is a property of the model (random tiny, same code, is the contrast).
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import zstandard
from safetensors import safe_open
from safetensors.torch import load

from k3bundle.errors import SynthError
from k3bundle.schema import Schema, Section
from k3bundle.presets import preset_config
from k3bundle.synth import write_synthetic
from k3bundle.synth.weights import TorchDraw, logical_values, stored_form
from tests.conftest import run_cli

SHIPPED = Path(__file__).resolve().parents[1] / "k3bundle" / "data" / "trained" / "tiny-trained.safetensors.zst"
# sha256 of the decompressed safetensors file: the trained model the docs describe
# (docs/synthetic-models.md "tiny-trained"); a retrained model must change this on purpose
PINNED_SHA256 = "512139e8dd85b0a64ad7daacc5d164f46c7752389c0f424581d69dfb679c8c8a"
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]  # OCP MX v1.0 table 5, codes 0..7 (bit 3 = sign)

PROSE = ("A bring-up engineer compares every layer of the new device against a reference. When the "
         "hidden state drifts, the first layer whose error grows more than the others is where the "
         "fault lives, and the report names that layer, the tap and the size of the error.")
CODE = ('import json\nfrom pathlib import Path\n\n\ndef load_manifest(path):\n    data = json.loads('
        'Path(path).read_text())\n    out = {}\n    for entry in data["tensors"]:\n        out[entry["name"]] = '
        'entry\n    return out\n')


@pytest.fixture(scope="module")
def shipped() -> dict[str, torch.Tensor]:
    return load(zstandard.ZstdDecompressor().decompress(SHIPPED.read_bytes()))


def test_shipped_file_is_small_and_pinned():
    assert SHIPPED.stat().st_size <= 20_000_000
    raw = zstandard.ZstdDecompressor().decompress(SHIPPED.read_bytes())
    assert hashlib.sha256(raw).hexdigest() == PINNED_SHA256


def test_synth_copies_the_trained_text_tensors(tiny_trained_ckpt, shipped):
    schema = Schema(preset_config("tiny-trained"))
    seen = 0
    for f in sorted(tiny_trained_ckpt.glob("*.safetensors")):
        with safe_open(str(f), "pt") as s:
            for name in s.keys():
                spec = schema.get(name)
                t = s.get_tensor(name)
                if spec.role.section is Section.TEXT:
                    assert torch.equal(t, shipped[name]), name
                    seen += 1
                elif spec.part == "weight" and spec.dtype == "BF16":  # untrained: drawn as synth draws
                    assert torch.equal(t, stored_form(spec, logical_values(schema, spec, 0))[name]), name
    assert seen == len(shipped) == sum(1 for s in schema.tensors() if s.role.section is Section.TEXT)


def test_experts_are_mxfp4_with_the_floor_scale_rule(shipped):
    """Every block decodes (OCP table) with its largest magnitude at 4 or 6 times the scale:
    the FLOOR rule puts the block max in [4, 8) before rounding (the release's encoding)."""
    blocks = 0
    for name, packed in shipped.items():
        if not name.endswith("weight_packed"):
            continue
        scale = shipped[name.replace("weight_packed", "weight_scale")]
        assert packed.dtype == scale.dtype == torch.uint8 and packed.shape[-1] == 16 * scale.shape[-1]
        codes = torch.stack([packed & 0xF, packed >> 4], -1).reshape(packed.shape[0], -1)  # low nibble first
        mag = torch.tensor(E2M1)[(codes & 7).long()]
        block_max = mag.reshape(codes.shape[0], -1, 32).amax(-1)
        nonzero = block_max > 0
        assert set(block_max[nonzero].unique().tolist()) <= {4.0, 6.0}, name
        assert (scale != 255).all(), name  # no NaN scale
        blocks += int(nonzero.sum())
    assert blocks > 0


def test_router_bias_was_balanced_during_training(shipped):
    schema = Schema(preset_config("tiny-trained"))
    for layer in schema.config.text.moe_layers:
        name = schema.name("moe.router_bias", layer)
        init = logical_values(schema, schema.get(name), 0, TorchDraw)  # where training started
        moved = (shipped[name] - init).abs()
        assert float(moved.max()) > 1e-2, name  # the load-driven update ran


def _loss_and_logits(ckpt: Path, text: str, dtype: str):
    from k3bundle.executor import Executor
    from k3bundle.executor.weights import SourceWeights
    from k3bundle.tokenizer import load_tiktoken

    ids = torch.tensor(load_tiktoken(ckpt).encode(text))
    with torch.no_grad():
        logits, _ = Executor(SourceWeights(ckpt, dtype, resident=True)).prefill(ids[:-1])
    return float(F.cross_entropy(logits.float(), ids[1:])), logits.float()


@pytest.mark.parametrize("text", [PROSE, CODE], ids=["prose", "code"])
def test_trained_model_predicts_unseen_text(tiny_trained_ckpt, tiny_ckpt, text):
    trained, _ = _loss_and_logits(tiny_trained_ckpt, text, "float32")
    random_, _ = _loss_and_logits(tiny_ckpt, text, "float32")
    assert random_ > math.log(1024)  # no better than uniform over the vocabulary
    assert trained < random_ - 2.0  # nats per token on text written for this test


def test_trained_model_is_well_conditioned_in_bf16(tiny_trained_ckpt, tiny_ckpt):
    """bf16 device emulation against float32: the trained model agrees, random weights do not."""
    def compare(ckpt):
        _, f32 = _loss_and_logits(ckpt, PROSE + "\n\n" + CODE, "float32")
        _, b16 = _loss_and_logits(ckpt, PROSE + "\n\n" + CODE, "bfloat16")
        nmse = float(((b16 - f32) ** 2).sum() / (f32 ** 2).sum())
        return nmse, float((b16.argmax(-1) == f32.argmax(-1)).float().mean())

    nmse, top1 = compare(tiny_trained_ckpt)
    assert nmse < 2e-2 and top1 >= 0.9, (nmse, top1)
    nmse_r, top1_r = compare(tiny_ckpt)
    assert nmse_r > 5 * nmse and top1_r < top1, (nmse_r, top1_r)


def test_seed_does_not_apply_to_a_trained_preset(tmp_path):
    with pytest.raises(SynthError, match="one trained model"):
        write_synthetic(tmp_path / "x", preset="tiny-trained", seed=3)
    r = run_cli("synth", "--preset", "tiny-trained", "--seed", "3", "--out", str(tmp_path / "y"))
    assert r.returncode != 0 and "one trained model" in r.stderr and not (tmp_path / "y").exists()


@pytest.mark.parametrize("damage,needle", [
    (lambda b: b[:1000], "not a zstd-compressed safetensors file"),
    (lambda b: zstandard.ZstdCompressor().compress(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      "),
     "does not match the preset's text tensors"),
])
def test_damaged_trained_file_is_named(tmp_path, monkeypatch, damage, needle):
    from k3bundle.synth import trained

    (tmp_path / "trained").mkdir()
    (tmp_path / "trained" / SHIPPED.name).write_bytes(damage(SHIPPED.read_bytes()))
    monkeypatch.setattr(trained, "data_root", lambda: tmp_path)
    with pytest.raises(SynthError, match=needle) as e:
        write_synthetic(tmp_path / "out", preset="tiny-trained")
    assert SHIPPED.name in str(e.value)
    assert not (tmp_path / "out").exists() and not (tmp_path / ".out.partial").exists()
