"""``k3bundle schema``: the tensor schema of a config, summarised or listed."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from k3bundle.cli._common import JsonOpt, Output
from k3bundle.config import load_config
from k3bundle.presets import preset_config
from k3bundle.schema import Schema

EXAMPLES = [
    "k3bundle schema --preset full",
    "k3bundle schema --config /ckpt/Kimi-K3/config.json --list > tensors.tsv",
]


def schema(
    config: Annotated[Path | None, typer.Option(help="A released-style config.json.")] = None,
    preset: Annotated[str | None, typer.Option(help="A built-in config: full, tiny, small or full-depth.")] = None,
    list_: Annotated[bool, typer.Option("--list", help="List every stored tensor (name, shape, dtype, role, layer, TP rule).")] = False,
    json_: JsonOpt = False,
) -> None:
    """Show the checkpoint's tensors for a config: counts, bytes, parameters, roles."""
    if (config is None) == (preset is None):
        raise typer.BadParameter("give exactly one of --config or --preset")
    cfg = load_config(config) if config else preset_config(preset)
    s = Schema(cfg)
    out = Output(json_)
    if list_:
        for t in s.tensors():
            print(f"{t.name}\t{list(t.shape)}\t{t.dtype}\t{t.role.role}\t"
                  f"{'' if t.layer is None else t.layer}\t{t.mixer or ''}\t{t.ffn or ''}\t{t.tp_rule}")
        return
    tot = s.totals
    text = (f"tensors           {tot.tensors:,}\n"
            f"stored bytes      {tot.stored_bytes:,}\n"
            f"routed experts    {tot.routed_expert_bytes:,} bytes\n"
            f"text params       {tot.text_params:,}\n"
            f"active params     {tot.active_params:,} per token\n"
            f"vision params     {tot.vision_params:,}\n"
            f"projector params  {tot.projector_params:,}\n"
            f"shards            {s.num_shards}\n"
            f"MLA layers        {cfg.text.mla_layers}\n")
    out.result(text, {**tot.__dict__, "shards": s.num_shards, "mla_layers": cfg.text.mla_layers})
