"""``k3bundle parsers`` as a run: probes sent in turn, the report written as JSON and Markdown.

``parsers.json`` holds every probe's checks (name, status, detail), its token counts and finish
reasons; ``parsers.md`` is the same as a table and a list of failures. Both are written at the
end, each atomically, so a run that stops early leaves no report.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from k3bundle.endpoint.client import Endpoint
from k3bundle.endpoint.errors import EndpointError
from k3bundle.endpoint.parsers import CHECKS, FAIL, NOT_CHECKED, PASS, Probe, ProbeResult, probes, run_probe
from k3bundle.golden.cases import Case
from k3bundle.io.files import write_atomic
from k3bundle.tokenizer import load_tiktoken

JSON_NAME, MD_NAME = "parsers.json", "parsers.md"
_MARK = {PASS: "✓", FAIL: "✗", NOT_CHECKED: "–"}


@dataclass
class ParsersReport:
    endpoint: str
    model: str
    max_tokens: int
    results: list[ProbeResult] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.results)

    def failures(self) -> list[str]:
        return [f"{r.probe.name}: {c.name}: {c.detail}" for r in self.results for c in r.checks if c.status == FAIL]

    def to_json(self) -> dict:
        return {"endpoint": self.endpoint, "model": self.model, "max_tokens": self.max_tokens,
                "verdict": "PASS" if self.passed else "FAIL", "failures": self.failures(),
                "probes": [{"name": r.probe.name, "case": r.probe.case, "thinking": r.probe.thinking,
                            "tools": [t.get("function", t).get("name") for t in r.probe.tools or []],
                            "prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens,
                            "finish_reasons": r.finish_reasons, "raw_completion": r.raw_source,
                            "passed": r.passed,
                            "checks": [{"name": c.name, "status": c.status, "detail": c.detail} for c in r.checks]}
                           for r in self.results]}

    def to_markdown(self) -> str:
        lines = [f"# Parsers: {'PASS' if self.passed else 'FAIL'}", "",
                 f"Endpoint `{self.endpoint}`, model `{self.model}`, greedy, max_tokens {self.max_tokens}; each "
                 "probe sent not streamed, then streamed. ✓ pass, ✗ fail, – not checked (the JSON report says why).",
                 "", "| probe | " + " | ".join(CHECKS) + " |", "|---|" + "---|" * len(CHECKS)]
        for r in self.results:
            by = {c.name: _MARK[c.status] for c in r.checks}
            lines.append(f"| {r.probe.name} | " + " | ".join(by.get(n, "") for n in CHECKS) + " |")
        fails = self.failures()
        lines += ["", "## Failures", ""] + [f"- {f}" for f in fails] if fails else ["", "No failures."]
        return "\n".join(lines) + "\n"


def open_tokenizer(path: Path):
    """The tokenizer k3bundle renders and parses with: a bundle's ``tokenizer/``, else ``path`` itself
    (a checkpoint or a tokenizer folder)."""
    return load_tiktoken(path / "tokenizer" if (path / "tokenizer").is_dir() else path)


def select(all_probes: Sequence[Probe], names: Sequence[str] | None) -> list[Probe]:
    """The probes named (a case name selects its own probes), in order; an unknown name is an error."""
    if not names:
        return list(all_probes)
    known = {p.name for p in all_probes} | {p.case for p in all_probes}
    bad = next((n for n in names if n not in known), None)
    if bad is not None:
        raise EndpointError(f"--case {bad!r} is not a probe or case here (known: {', '.join(sorted(known))})")
    return [p for p in all_probes if p.name in names or p.case in names]


def run_parsers(ep: Endpoint, encoding, cases: Sequence[Case], max_tokens: int, names: Sequence[str] | None = None,
                say: Callable[[str], None] | None = None) -> ParsersReport:
    chosen = select(probes(cases), names)
    if not chosen:
        raise EndpointError("no golden case of kind thinking, tool_call or multi_turn to send")
    report = ParsersReport(ep.base_url, ep.model, max_tokens)
    for p in chosen:
        if say:
            say(f"{p.name}: sending")
        report.results.append(run_probe(ep, p, encoding, max_tokens))
        if say:
            say(f"{p.name}: {'pass' if report.results[-1].passed else 'FAIL'}")
    return report


def write_report(report: ParsersReport, out: Path) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    j, m = out / JSON_NAME, out / MD_NAME
    write_atomic(j, json.dumps(report.to_json(), indent=2, ensure_ascii=False) + "\n")
    write_atomic(m, report.to_markdown())
    return j, m
