"""``k3bundle checklist``: capacity, roofline bounds, kernels, fault paths and sign-off stages of a target."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from k3bundle.checklist import DEFAULT_BATCH, DEFAULT_CONTEXT, make_checklist, to_markdown
from k3bundle.checklist import ChecklistError, save_checklist
from k3bundle.checklist.serving import DEFAULT_LINK_GBPS, DEFAULT_PAGE_TOKENS, Serving, kv_cache_dtypes
from k3bundle.provenance.verify import LEVELS
from k3bundle.cli._common import ConfigOpt, JsonOpt, Output, exit_with

EXAMPLES = [
    "k3bundle checklist --target b300-tp8",
    "k3bundle checklist --target b200-tp8-pp2 --context 32768 --batch 16 --out b200.md",
    "k3bundle checklist --target b300-tp8 --bundle /bundles/k3-b300 --json",
    "k3bundle checklist --target b300-tp8 --bundle /bundles/k3-b300 --run dumps-vllm-bf16",
    "k3bundle checklist --target ./layouts/my-card.yaml --config /ckpt/Kimi-K3/config.json",
    "k3bundle checklist --target b300-tp8 --kv-cache-dtype fp8 --gpu-memory-utilization 0.9",
    "k3bundle checklist --target b300-tp8 --snapshot-every 4096 --page-tokens 64 --link-gbps 400",
]


def checklist(
    target: Annotated[str, typer.Option("--target", "-t", help="Layout name (layouts/NAME.yaml) or a path to a layout YAML.")],
    config: ConfigOpt = None,
    bundle: Annotated[Path | None, typer.Option("--bundle", help="A bundle converted for the target: its config, graph manifest, goldens and reports are the evidence.")] = None,
    context: Annotated[int, typer.Option(help="Tokens per request the cache must hold (and a prompt's length for TTFT).")] = DEFAULT_CONTEXT,
    batch: Annotated[int, typer.Option(help="Concurrent requests over the whole deployment.")] = DEFAULT_BATCH,
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Write the Markdown here (and the JSON beside it, .json) instead of stdout.")] = None,
    verify: Annotated[str, typer.Option("--verify", help="With --bundle, how its files are checked against the manifest: sample (default: the metadata and a seeded 2% of the weight files re-hashed, the rest by size), full (every byte re-hashed), manifest (sizes only).")] = "sample",
    verify_seed: Annotated[int, typer.Option("--verify-seed", help="Seed of the --verify sample subset.")] = 0,
    kv_cache_dtype: Annotated[str, typer.Option("--kv-cache-dtype", help=f"How the engine stores the MLA latent: {', '.join(kv_cache_dtypes())} (k3bundle/data/kv_cache_dtypes.yaml: bf16 1,152 B per token and layer, fp8 576 B with a per-layer scale, fp8_ds_mla 656 B with per-token scales).")] = "bf16",
    gpu_memory_utilization: Annotated[float | None, typer.Option("--gpu-memory-utilization", help="vLLM's share of each card's HBM the engine may use, weights included (0 < F <= 1); replaces the layout's memory.runtime_reserve_bytes by hbm - F x hbm.")] = None,
    attention_dp: Annotated[int | None, typer.Option("--attention-dp", help="Attention data-parallel replicas over a pipeline stage's ranks (SGLang --dp N --enable-dp-attention: attention TP = ranks / N, experts split as the layout says); default the layout's parallel.attention_dp.")] = None,
    snapshot_every: Annotated[int | None, typer.Option("--snapshot-every", help="Prefix-cache policy: a KDA state snapshot every N tokens of a request.")] = None,
    snapshot_turns: Annotated[int | None, typer.Option("--snapshot-turns", help="Prefix-cache policy: T snapshots per request, one at each turn boundary.")] = None,
    page_tokens: Annotated[int, typer.Option("--page-tokens", help="Tokens per MLA page (the shared page is lcm(KDA state page, MLA page)).")] = DEFAULT_PAGE_TOKENS,
    link_gbps: Annotated[float, typer.Option("--link-gbps", help="Prefill-to-decode link per rank, Gbit/s, for the handoff time.")] = DEFAULT_LINK_GBPS,
    run: Annotated[str | None, typer.Option("--run", metavar="RUN_KEY", help="With --bundle, the validate run whose sign-off ticks the numerics stages (reports/validate/RUN_KEY: builtin-cpu, dumps-NAME, ...); default the latest run.")] = None,
    json_: JsonOpt = False,
) -> None:
    """The bring-up checklist of a target: numbers computed from the plan, stages ticked only from evidence.

    Without --config or --bundle it checks the released Kimi K3 config. Exits 1 when capacity fails.
    """
    if config is not None and bundle is not None:
        raise ChecklistError("give --config or --bundle, not both (a bundle carries its own config.json)")
    if out is not None and out.suffix == ".json":
        raise ChecklistError(f"{out}: --out names the Markdown file (e.g. checklist.md); the JSON is written beside it")
    if verify not in LEVELS:
        raise ChecklistError(f"--verify {verify}: choose one of {', '.join(LEVELS)}")
    serving = Serving(kv_cache_dtype, gpu_memory_utilization, attention_dp, snapshot_every, snapshot_turns, page_tokens,
                      link_gbps)
    cl = make_checklist(target, config=config, bundle=bundle, context=context, batch=batch, verify_level=verify,
                        verify_seed=verify_seed, serving=serving, run=run)
    o = Output(json_)
    if out is None:
        o.result(to_markdown(cl), cl.to_dict())
    else:
        md, js, page = save_checklist(cl, out)
        o.info(f"wrote {md}, {js} and {page}")
        o.result(cl.summary(), cl.to_dict())
    exit_with(0 if cl.passed else 1)


__all__ = ["checklist", "EXAMPLES"]
