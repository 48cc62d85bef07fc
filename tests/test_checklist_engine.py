"""k3bundle checklist in engine terms: the MLA cache dtype, vLLM's --gpu-memory-utilization,
attention data parallelism per replica, the prefix-cache budget with JENGA's shared page, the
prefill/decode handoff, and a published figure of 3.25M tokens on one 8×B300 node. Every expected
number is worked by hand here from docs/kimi-k3.md §1 and §5.3 and the engines' cache layouts
(docs/bring-up.md "Engine terms"), never read back from the code."""

from __future__ import annotations

import json

import pytest
import yaml

from k3bundle.checklist import ChecklistError, make_checklist, to_markdown
from k3bundle.checklist.html import to_html
from k3bundle.checklist.serving import Serving, kv_cache_dtypes
from tests.conftest import REPO, run_cli
from tests.test_checklist import HAND

# docs/kimi-k3.md: kv_lora_rank 512, qk_rope_head_dim 64, 24 MLA + 69 KDA layers, KDA 96 heads of 128,
# short conv kernel 4
N_MLA, N_KDA, LAYERS = 24, 69, 93
RECURRENT = 96 * 128 * 128 * 4  # FP32 [H, d, d] per layer and request
CONV = 3 * 12288 * 3 * 2  # BF16 3 × [W−1, P] per layer and request
WEIGHTS = HAND["weights_per_rank"]  # b300-tp8 rank 0, NVFP4 experts, worked out in test_checklist.py
HBM = 288_000_000_000
PUBLISHED_TOKENS = 3_250_000  # published: one 8×B300 node "holds 3.25M tokens after weights"


def _q(rows, key):
    return next(q for q in rows if q.key == key).value


def test_latent_bytes_per_layer_are_the_engines_layouts():
    t = kv_cache_dtypes()
    assert t["bf16"].bytes_per_layer(512, 64) == 576 * 2  # vLLM MLAAttentionSpec: 576 values × 2 B
    assert t["fp8"].bytes_per_layer(512, 64) == 576  # one byte a value; the scale is per layer
    # vLLM's fp8_ds_mla: 512 FP8 + 4 F32 scales (one per 128) + 64 BF16 = the 656 B vLLM hard-codes
    assert t["fp8_ds_mla"].bytes_per_layer(512, 64) == 512 + 4 * 4 + 64 * 2 == 656


@pytest.fixture(scope="module")
def published():
    """The published figure's setup as docs/bring-up.md reads it: vLLM's default --gpu-memory-utilization 0.9, an FP8
    latent cache, TP8 with no attention DP ("A published figure: 3.25M tokens on one node")."""
    return make_checklist("b300-tp8", serving=Serving(kv_cache_dtype="fp8", gpu_memory_utilization=0.9))


def test_the_published_figure_is_reproduced_within_ten_percent(published):
    c = published.capacity
    usable = 259_200_000_000  # 0.9 × 288 GB
    free = usable - WEIGHTS  # 42,612,005,136
    latent = N_MLA * 576 * 1  # 13,824 B per token per rank, FP8, the whole latent on every TP rank
    assert c.reserve == HBM - usable and c.usable == usable
    assert _q(c.quantities, "free_bytes_per_rank") == free == 42_612_005_136
    assert _q(c.quantities, "mla_latent_bytes_per_token") == latent
    assert c.tokens_fit == free // latent == 3_082_465
    assert abs(c.tokens_fit / PUBLISHED_TOKENS - 1) < 0.10  # 5.2% under the article
    # today's figure, beside it: BF16 latent and the layout's 40 GB reserve
    assert (HBM - 40_000_000_000 - WEIGHTS) // (N_MLA * 576 * 2) == HAND["tokens_fit"] == 1_136_140
    assert "gpu_memory_utilization × hbm" in _q_formula(c.quantities, "runtime_reserve_bytes")
    # the roofline reads the same latent: a decode step at 131,072 tokens reads 8 ranks × 13,824 B a token
    assert _q(published.roofline.decode.bytes, "decode_bytes_latent") == 131_072 * 13_824 * 8


def _q_formula(rows, key):
    return next(q for q in rows if q.key == key).formula


def test_the_published_setup_on_the_command_line(tmp_path):
    r = run_cli("checklist", "--target", "b300-tp8", "--kv-cache-dtype", "fp8", "--gpu-memory-utilization", "0.9",
                "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)["capacity"]
    assert doc["tokens_fit"] == (259_200_000_000 - WEIGHTS) // 13_824
    assert doc["serving"]["kv_cache_dtype"] == "fp8" and doc["serving"]["gpu_memory_utilization"] == 0.9
    assert {q["key"] for q in doc["prefix_cache"]} >= {"kda_snapshot_bytes", "shared_page_bytes"}
    assert {q["key"] for q in doc["handoff"]} >= {"handoff_bytes", "handoff_bytes_pure_mla", "handoff_seconds"}
    # bad values: one line naming the option, exit 2, nothing on stdout
    for args, says in ((["--kv-cache-dtype", "fp4"], "--kv-cache-dtype fp4: choose one of bf16, fp8, fp8_ds_mla"),
                       (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization 1.5: must be a share")):
        r = run_cli("checklist", "--target", "b300-tp8", *args)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and r.stdout == "" and len(lines) == 1 and lines[0].startswith("error: ")
        assert says in lines[0]


@pytest.mark.parametrize("serving, says", [
    (Serving(gpu_memory_utilization=0.0), "--gpu-memory-utilization 0.0: must be a share"),
    (Serving(gpu_memory_utilization=float("nan")), "--gpu-memory-utilization nan"),
    (Serving(attention_dp=3), "--attention-dp 3: must divide the 8 ranks of a pipeline stage"),
    (Serving(attention_dp=0), "--attention-dp 0: must be a positive integer"),
    (Serving(snapshot_every=0), "--snapshot-every 0: must be a positive integer"),
    (Serving(snapshot_every=64, snapshot_turns=4), "not both"),
    (Serving(page_tokens=0), "--page-tokens 0"),
    (Serving(link_gbps=-1.0), "--link-gbps -1.0: must be a positive number"),
])
def test_bad_engine_options_are_refused_in_one_line(serving, says):
    with pytest.raises(ChecklistError) as e:
        make_checklist("b300-tp8", serving=serving)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_fp8_ds_mla_pays_for_its_per_token_scales():
    c = make_checklist("b300-tp8", serving=Serving(kv_cache_dtype="fp8_ds_mla")).capacity
    assert _q(c.quantities, "mla_latent_bytes_per_token") == N_MLA * 656 == 15_744
    assert c.tokens_fit == HAND["free"] // 15_744


def test_attention_dp_counts_per_replica_as_the_layout_would_state_it(tmp_path):
    """--attention-dp 2 on b300-tp8 is SGLang's --tp 8 --dp 2 --enable-dp-attention: two replicas of
    attention TP 4, each rank the whole latent of its replica's requests and half of their KDA heads;
    the same numbers as a layout that says tp 4 × attention_dp 2."""
    flag = make_checklist("b300-tp8", serving=Serving(attention_dp=2))
    doc = yaml.safe_load((REPO / "layouts" / "b300-tp8.yaml").read_text())
    doc["name"], doc["parallel"]["tp"], doc["parallel"]["attention_dp"] = "b300-tp4-dp2", 4, 2
    path = tmp_path / "b300-tp4-dp2.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))  # format rules match in order
    stated = make_checklist(str(path))
    c, s = flag.capacity, stated.capacity
    assert (c.tp, c.attention_dp) == (4, 2) and flag.plan.layout.parallel == stated.plan.layout.parallel
    assert [q.to_dict() for q in c.quantities] == [q.to_dict() for q in s.quantities]
    st = c.limiting
    assert st.latent_per_token == N_MLA * 576 * 2  # replicated on every attention-TP rank, not split by DP
    assert st.state_per_request == N_KDA * (RECURRENT + CONV) // 4  # heads over attention TP 4
    assert c.tokens_fit == 2 * ((HBM - 40_000_000_000 - st.weights) // (N_MLA * 576 * 2))  # two replicas
    assert st.weights > WEIGHTS  # attention weights split 4 ways, not 8
    # attention TP 1 (--attention-dp 8): every rank holds all the attention weights; they no longer fit
    one = make_checklist("b300-tp8", serving=Serving(attention_dp=8)).capacity
    assert not one.weights_fit and "rank 0 needs 305.85 GB of weights" in one.verdict


def test_prefix_cache_budget_by_hand():
    c = make_checklist("b300-tp8", serving=Serving(snapshot_every=4096)).capacity
    p = c.prefix_cache
    snap = N_KDA * (RECURRENT + CONV) // 8  # every KDA layer's state of one request, one rank of TP8
    assert snap == 56_171_520 and _q(p, "kda_snapshot_bytes") == snap
    k = 31  # snapshots at 4,096, 8,192, ..., 126,976 < 131,072 (the state at 131,072 is the live one)
    assert _q(p, "snapshots_per_request") == k
    per = 131_072 * 27_648 + (1 + k) * snap
    assert _q(p, "cache_bytes_per_request_with_snapshots") == per
    assert _q(p, "requests_fit_with_snapshots") == HAND["free"] // per == 5  # 8 without snapshots
    assert _q(p, "snapshots_fit_beside_batch") == (HAND["free"] - HAND["per_request_128k"]) // snap == 493
    # JENGA: KDA page 6,512,640 / 8 = 814,080 = 2^10·3·5·53; MLA page 64 × 1,152 = 73,728 = 2^13·3^2
    assert _q(p, "kda_state_page_bytes") == 814_080 == 2 ** 10 * 3 * 5 * 53
    assert _q(p, "mla_page_bytes") == 73_728 == 2 ** 13 * 3 ** 2
    shared = 2 ** 13 * 3 ** 2 * 5 * 53
    assert _q(p, "shared_page_bytes") == shared == 24 * 814_080 == 265 * 73_728
    assert _q(p, "shared_page_fragmentation") == pytest.approx(2 * shared / HAND["free"])
    assert _q(p, "mla_tail_bytes") == 0  # 131,072 tokens are 2,048 whole pages
    # one size for both: 768-token MLA pages (12 × 64, the first ≥ 814,080 B), the state padded
    assert _q(p, "one_size_page_waste") == pytest.approx((768 * 1152 - 814_080) / (768 * 1152))
    turns = make_checklist("b300-tp8", context=1000, serving=Serving(snapshot_turns=6, page_tokens=16)).capacity
    assert _q(turns.prefix_cache, "snapshots_per_request") == 6
    assert _q(turns.prefix_cache, "mla_tail_bytes") == (63 * 16 - 1000) * 24 * 1152  # 1,000 tokens in 63 pages


def test_handoff_shrinks_against_a_pure_mla_model_of_the_same_depth():
    c = make_checklist("b300-tp8", serving=Serving(link_gbps=100)).capacity
    h = c.handoff
    latent = 131_072 * N_MLA * 1152
    states = N_KDA * (RECURRENT + CONV)
    pure = 131_072 * LAYERS * 1152
    assert _q(h, "handoff_latent_bytes") == latent == 3_623_878_656
    assert _q(h, "handoff_state_bytes") == states == HAND["kda_per_request"]
    assert _q(h, "handoff_bytes") == latent + states == 4_073_250_816
    assert _q(h, "handoff_bytes_pure_mla") == pure == 14_042_529_792
    assert _q(h, "handoff_ratio") == pytest.approx(0.29, abs=0.005)  # linear attention: under a third
    per_rank = HAND["per_request_128k"]  # each decode rank pulls the whole latent and its 12 heads' states
    assert _q(h, "handoff_bytes_per_rank") == per_rank
    assert _q(h, "handoff_seconds") == pytest.approx(per_rank * 8 / 100e9)  # 0.294 s at 100 Gbit/s
    assert _q(h, "handoff_seconds_pure_mla") == pytest.approx(pure * 8 / 100e9)


def test_every_page_shows_the_budgets(published):
    md, page = to_markdown(published), to_html(published)
    for text in (md, page):
        assert "Prefix cache: KDA snapshots beside the latent" in text and "Prefill/decode handoff" in text
        assert "--kv-cache-dtype fp8" in text and "--gpu-memory-utilization 0.9" in text
    assert "| cached tokens that fit | **3,082,465 tokens** |" in md
    assert "shared page for both kinds (JENGA)" in md and "shared page for both kinds (JENGA)" in page


def test_attention_dp_other_than_the_bundles_is_refused(tmp_path):
    """A bundle's weights are placed for its layout's attention split: another split is refused."""
    from k3bundle.config import release_config_path

    (tmp_path / "config.json").write_bytes(release_config_path().read_bytes())
    (tmp_path / "manifest.json").write_text(json.dumps({"target": "b300-tp8"}))
    with pytest.raises(ChecklistError, match=r"--attention-dp 2: .* was converted for attention_dp 1"):
        make_checklist("b300-tp8", bundle=tmp_path, serving=Serving(attention_dp=2))
