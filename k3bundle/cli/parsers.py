"""``k3bundle parsers``: an endpoint's reasoning / content / tool-call split against k3bundle's XTML parser."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from k3bundle.cli._common import JsonOpt, Output, exit_with
from k3bundle.cli._target import ApiKeyOpt, CasesOpt, ModelOpt, connect, require_client
from k3bundle.endpoint.errors import EndpointError
from k3bundle.file_names import MANIFEST, REPORTS_DIR
from k3bundle.golden.cases import load_cases

EXAMPLES = [
    "k3bundle parsers /tmp/k3-tt --endpoint http://127.0.0.1:8000/v1 --out /tmp/parsers",
    "k3bundle parsers /data/k3-bundle --endpoint http://gpu-host:8000/v1 --model moonshotai/Kimi-K3",
    "k3bundle parsers /tmp/k3-tt --endpoint http://127.0.0.1:8000 --case tool_call --max-tokens 1024 --json",
]


def parsers(
    tokenizer: Annotated[Path, typer.Argument(help="A bundle (its tokenizer/; the report goes to its reports/), a "
                                                   "checkpoint or a tokenizer directory: k3bundle renders and "
                                                   "parses with it.")],
    endpoint: Annotated[str, typer.Option(help="The OpenAI-compatible base URL, e.g. http://host:8000/v1.")],
    model: ModelOpt = None,
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Report folder (default: BUNDLE/reports).")] = None,
    max_tokens: Annotated[int, typer.Option(help="Completion tokens per request.")] = 512,
    case: Annotated[list[str] | None, typer.Option("--case", help="Only this probe or golden case (repeatable).")] = None,
    cases: CasesOpt = None,
    api_key: ApiKeyOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Send every golden conversation with thinking and tools; exit 0 pass, 1 fail, 2 bad input or endpoint unreachable."""
    o = Output(json_)
    require_client("parsers")
    from k3bundle.endpoint.parsers_report import open_tokenizer, run_parsers, write_report

    if max_tokens < 1:
        raise EndpointError(f"--max-tokens must be at least 1, got {max_tokens}")
    is_bundle = (tokenizer / MANIFEST).is_file()
    if out is None and not is_bundle:
        raise EndpointError(f"{tokenizer}: not a bundle (no {MANIFEST}); give --out DIR for the report")
    out = out if out is not None else tokenizer / REPORTS_DIR
    encoding = open_tokenizer(tokenizer)
    golden = load_cases(cases)
    ep = connect(endpoint, model, api_key)
    report = run_parsers(ep, encoding, golden, max_tokens, case, say=lambda s: sys.stderr.write(s + "\n"))
    j, m = write_report(report, out)
    lines = [f"{r.probe.name}: {'pass' if r.passed else 'FAIL'}" for r in report.results]
    lines += [f"  {f}" for f in report.failures()]
    lines.append(f"parsers: {'PASS' if report.passed else 'FAIL'} ({len(report.results)} probes); report {j}, {m}")
    o.result("\n".join(lines), {**report.to_json(), "report": [str(j), str(m)]})
    exit_with(0 if report.passed else 1)
