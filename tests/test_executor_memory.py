"""Peak memory of a run stays near one layer, not the model (design.md "Executor").

The ``small`` preset takes ~20 s to write on 2 cores, so this test writes a mid-size variant
of it instead: 24 layers at width 512 (455 MB of tensors, ~20 MB per layer shard), which
makes the layer/model contrast sharper. The run happens in a subprocess that reports its
peak RSS (VmHWM) before and after prefill + decode, with glibc's thresholds fixed
(tests/_memory.py) so that the peak is what the executor held, not what the heap kept.
"""

from __future__ import annotations

import json
import subprocess
import sys
from unittest import mock

import pytest

from k3bundle import presets
from k3bundle.synth import checkpoint
from tests._memory import VMHWM, child_env

CHILD = r"""
import json, sys, torch
from k3bundle.executor import Executor, SourceWeights
torch.set_num_threads(1)  # the same transients on every machine
peak = lambda: %s
w = SourceWeights(sys.argv[1], dtype="float32", expert_cache=0)
ex = Executor(w)
base = peak()
logits, cache = ex.prefill(torch.randint(0, 1000, (48,), generator=torch.Generator().manual_seed(0)))
ex.decode(7, cache)
print(json.dumps({"base": base, "peak": peak(), "expert_reads": w.expert_reads}))
""" % VMHWM


def mid_config() -> dict:
    cfg = presets.preset_config_dict("small")
    t = cfg["text_config"]
    t.update(hidden_size=512, num_hidden_layers=24, intermediate_size=1024, num_experts=64,
             moe_intermediate_size=512, routed_expert_hidden_size=256, q_lora_rank=128,
             kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
             num_attention_heads=8, num_key_value_heads=8, attn_res_block_size=6)
    t["linear_attn_config"].update(num_heads=8, head_dim=64)
    full = presets.mla_layers_1based(24)  # the release rule, as synth derives it
    t["linear_attn_config"]["full_attn_layers"] = full
    t["linear_attn_config"]["kda_layers"] = [i for i in range(1, 25) if i not in full]
    cfg["vision_config"]["text_hidden_size"] = 512
    return cfg


@pytest.mark.slow
def test_peak_rss_is_one_layer_not_the_model(tmp_path):
    out = tmp_path / "mid"
    with mock.patch.object(checkpoint, "preset_config_dict", lambda name: mid_config()):
        r = checkpoint.write_synthetic(out, preset="mid")
    shards = sorted(out.glob("model-*.safetensors"))
    largest = max(p.stat().st_size for p in shards[:24])  # decoder-layer shards
    p = subprocess.run([sys.executable, "-c", CHILD, str(out)], capture_output=True, text=True, timeout=300,
                       env=child_env())
    assert p.returncode == 0, p.stderr
    m = json.loads(p.stdout)
    grew = m["peak"] - m["base"]
    print(f"peak grew {grew:,} B; largest layer shard {largest:,} B; model {r.total_size:,} B")
    # the model is 455 MB of (mostly MXFP4) tensors, ~5 GB once dequantized to float32;
    # the run may hold one layer (float32: ~2x its BF16 share), one expert and transients
    assert grew < 5 * largest, (grew, largest)
    assert grew < r.total_size / 4, (grew, r.total_size)
    assert m["expert_reads"] < 23 * 64  # only routed experts were ever dequantized
