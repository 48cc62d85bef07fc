"""``k3bundle kernels``: a backend's ops against the reference at a target's per-rank shapes."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from k3bundle.cli._common import ConfigOpt, JsonOpt, Output, exit_with
from k3bundle.errors import K3Error

EXAMPLES = [
    "k3bundle kernels --target h200-tp16-ep16 --backend torch",
    "k3bundle kernels --target b300-tp8 --backend fla --device cuda --tokens 8192 --out reports/",
    "k3bundle kernels --target gb300-dep16 --backend mypkg.k3_ops --device cuda --ops kda_chunked_prefill --json",
    "k3bundle kernels --target h200-tp16-ep16 --backend planted:kda_state_transposed   # exits 1, names op and case",
]


def kernels(
    target: Annotated[str, typer.Option("--target", "-t", help="Layout name (layouts/NAME.yaml) or a layout YAML path: the per-rank shapes.")],
    backend: Annotated[str, typer.Option("--backend", "-b", help="reference, fla, torch, planted:<bug>, an entry point of group k3bundle.backends, or a module path.")] = "reference",
    device: Annotated[str, typer.Option("--device", help="Torch device the backend and the float64 reference run on.")] = "cpu",
    ops: Annotated[list[str] | None, typer.Option("--ops", help="Only these ops (repeat the option); default: every op of the target's custom_ops.")] = None,
    cases: Annotated[list[str] | None, typer.Option("--case", help="Only these cases (names in golden/kernel_cases.yaml; repeatable).")] = None,
    config: ConfigOpt = None,
    dtype: Annotated[str, typer.Option("--dtype", help="Activation dtype of the inputs: bfloat16 (a serving device) or float32.")] = "bfloat16",
    tokens: Annotated[int, typer.Option("--tokens", help="Prefill length of the 'prefill'-sized cases.")] = 512,
    batch: Annotated[int, typer.Option("--batch", help="Requests of the decode-batch cases.")] = 8,
    context: Annotated[int, typer.Option("--context", help="Cached tokens per request of the MLA decode cases.")] = 1024,
    reps: Annotated[int, typer.Option("--reps", help="Timed calls per timed case (median; 0: no timing).")] = 5,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the inputs.")] = 0,
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Write kernels.md, kernels.json and kernels.html into this folder (a bundle's reports/ is where checklist --bundle looks).")] = None,
    json_: JsonOpt = False,
) -> None:
    """Each op the backend provides, on seeded and adversarial inputs at the target's per-rank shapes,
    against the reference in float64: NMSE, max-abs, cosine, NaN propagation, time against the roofline.

    Exits 0 when every covered op conforms, 1 when one does not (the op and the failing case are named),
    2 on bad input. Ops the backend lacks are "not covered".
    """
    from k3bundle.kernels import backend as backends, conformance, report
    from k3bundle.kernels.cases import Sizes
    from k3bundle.kernels.target import device_card, target_dims

    if min(tokens, batch, context) < 1 or reps < 0:
        raise K3Error("--tokens, --batch and --context must be at least 1, --reps at least 0")
    dims, target_ops, name = target_dims(target, config)
    chosen = target_ops
    if ops:
        unknown = [o for o in ops if o not in target_ops]
        if unknown:
            raise K3Error(f"--ops {', '.join(unknown)}: not a custom op of {name} ({', '.join(target_ops)})")
        chosen = [o for o in target_ops if o in ops]
    b = backends.load(backend)
    backends.print_warnings(b)
    o = Output(json_)
    res = conformance.run(b, dims, chosen, name, device, dtype, Sizes(tokens, batch, context), seed, reps,
                          device_card(device), cases, progress=None if json_ else (lambda s: o.info(f"  {s}")))
    res.model = None if config is None else str(config)
    if out is not None:
        paths = report.save(res, out)
        o.info("wrote " + ", ".join(map(str, paths)))
    o.result(report.to_markdown(res), res.to_dict())
    exit_with(0 if res.passed else 1)


__all__ = ["kernels", "EXAMPLES"]
