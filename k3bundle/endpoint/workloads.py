"""Serving workloads as data (``golden/workloads/NAME.yaml``) and the prompts they make.

A workload gives its full-size parameters — median input tokens per request, output tokens,
turns per session, how a session's prompts grow — and a ``scale`` that multiplies every token
count and the turns, so a CI run can send a small copy of the same shape to a small model.
Prompts are deterministic from the seed: synthetic token ids drawn from ``token_id_range`` (sent
to ``/v1/completions`` as ids), or words standing for them (sent as text).

A session of ``turns`` turns reuses its prefix: turn t's prompt is turn t-1's prompt followed by
a new block of ``step`` tokens (standing for the previous answer and the next tool result or user
message, drawn rather than taken from the endpoint's answer so that every engine gets the same
prompts). Lengths grow linearly from ``first_turn_input_tokens``; ``step`` is chosen so the
median over the turns is ``input_tokens``: median = first + step × (turns − 1) / 2.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from pathlib import Path

from k3bundle.data_dirs import data_dirs
from k3bundle.endpoint.errors import EndpointError
from k3bundle.errors import YamlFileError
from k3bundle.io.strict_yaml import read_yaml

WORKLOAD_SCHEMA_VERSION = 1
PROMPT_KINDS = ("token_ids", "text")
_REQUIRED = ("schema_version", "name", "description", "prompt", "token_id_range", "seed", "input_tokens",
             "output_tokens", "turns", "sessions_per_client", "scale")
_OPTIONAL = ("first_turn_input_tokens",)
#: words that stand for token ids in a text prompt (each about one token in any BPE vocabulary)
WORDS = ("the", "model", "tool", "call", "result", "file", "line", "value", "test", "error", "step", "data",
         "code", "read", "write", "next", "plan", "check", "list", "name")


class WorkloadError(EndpointError):
    """A workload file that cannot be used; the message names the file and the key."""


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    prompt: str  # "token_ids" or "text"
    token_id_range: tuple[int, int]
    seed: int
    input_tokens: int  # median prompt length over a session's turns
    output_tokens: int
    turns: int
    first_turn_input_tokens: int
    sessions_per_client: int
    scale: float
    path: str = ""

    def scaled(self, scale: float | None = None) -> Workload:
        """This workload at ``scale`` (default its own): token counts and turns × scale, rounded;
        at least 1 input token, 2 output tokens (one interval for TPOT) and, where the workload has
        several turns, 2 turns (one reused prefix)."""
        s = self.scale if scale is None else scale
        if not s > 0:
            raise WorkloadError(f"{self.path or self.name}: scale must be positive, got {s}")
        turns = max(min(self.turns, 2), round(self.turns * s))
        first = max(1, round(self.first_turn_input_tokens * s))
        return replace(self, input_tokens=max(first, round(self.input_tokens * s)),
                       output_tokens=max(2, round(self.output_tokens * s)), turns=turns,
                       first_turn_input_tokens=first, scale=s)

    @property
    def step(self) -> int:
        """New prompt tokens per turn after the first (0 for a single turn)."""
        if self.turns == 1:
            return 0
        return round(2 * (self.input_tokens - self.first_turn_input_tokens) / (self.turns - 1))

    def turn_lengths(self) -> list[int]:
        return [self.first_turn_input_tokens + t * self.step for t in range(self.turns)]

    def session(self, index: int) -> list[list[int]]:
        """The token ids of every turn of session ``index``: each prompt extends the one before."""
        rng = random.Random(f"{self.seed}:{index}")  # a string seed: the same ids on every platform
        lo, hi = self.token_id_range
        ids: list[int] = []
        out = []
        for n in self.turn_lengths():
            ids = ids + [rng.randrange(lo, hi) for _ in range(n - len(ids))]
            out.append(ids)
        return out

    def to_dict(self) -> dict:
        return {"name": self.name, "description": self.description, "prompt": self.prompt,
                "token_id_range": list(self.token_id_range), "seed": self.seed, "input_tokens": self.input_tokens,
                "output_tokens": self.output_tokens, "turns": self.turns,
                "first_turn_input_tokens": self.first_turn_input_tokens, "step_tokens": self.step,
                "sessions_per_client": self.sessions_per_client, "scale": self.scale, "file": self.path}


def as_text(ids: list[int]) -> str:
    """A text prompt standing for ``ids`` (one word per id)."""
    return " ".join(WORDS[i % len(WORDS)] for i in ids)


def _int(doc: dict, key: str, where: str, lo: int = 1) -> int:
    v = doc[key]
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise WorkloadError(f"{where}: {key} must be an integer ≥ {lo}, got {v!r}")
    return v


def parse_workload(doc: object, where: str) -> Workload:
    """A ``Workload`` from the parsed YAML ``doc``; a bad field is one line naming ``where`` and the key."""
    if not isinstance(doc, dict):
        raise WorkloadError(f"{where}: a workload file is a mapping of fields ({', '.join(_REQUIRED)})")
    unknown = sorted(set(doc) - set(_REQUIRED) - set(_OPTIONAL))
    if unknown:
        raise WorkloadError(f"{where}: {unknown[0]}: unknown field (fields: {', '.join(_REQUIRED + _OPTIONAL)})")
    missing = [k for k in _REQUIRED if k not in doc]
    if missing:
        raise WorkloadError(f"{where}: {missing[0]}: missing")
    if doc["schema_version"] != WORKLOAD_SCHEMA_VERSION:
        raise WorkloadError(f"{where}: schema_version: {doc['schema_version']!r}, this k3bundle reads "
                            f"{WORKLOAD_SCHEMA_VERSION}")
    for key in ("name", "description"):
        if not isinstance(doc[key], str) or not doc[key]:
            raise WorkloadError(f"{where}: {key} must be a non-empty string")
    if doc["prompt"] not in PROMPT_KINDS:
        raise WorkloadError(f"{where}: prompt must be one of {', '.join(PROMPT_KINDS)}, got {doc['prompt']!r}")
    r = doc["token_id_range"]
    if (not isinstance(r, list) or len(r) != 2 or any(isinstance(x, bool) or not isinstance(x, int) for x in r)
            or not 0 <= r[0] < r[1]):
        raise WorkloadError(f"{where}: token_id_range must be [low, high) with 0 ≤ low < high, got {r!r}")
    scale = doc["scale"]
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
        raise WorkloadError(f"{where}: scale must be a positive number, got {scale!r}")
    turns = _int(doc, "turns", where)
    inp = _int(doc, "input_tokens", where)
    if turns > 1 and "first_turn_input_tokens" not in doc:
        raise WorkloadError(f"{where}: first_turn_input_tokens: missing (needed when turns > 1)")
    first = _int(doc, "first_turn_input_tokens", where) if "first_turn_input_tokens" in doc else inp
    if first > inp or (turns == 1 and first != inp):
        raise WorkloadError(f"{where}: first_turn_input_tokens ({first}) must be at most input_tokens ({inp}), "
                            "and equal to it for a single turn")
    return Workload(doc["name"], doc["description"], doc["prompt"], (r[0], r[1]), _int(doc, "seed", where, 0), inp,
                    _int(doc, "output_tokens", where), turns, first, _int(doc, "sessions_per_client", where),
                    float(scale), where)


def workload_path(name: str) -> Path:
    """``name`` as a YAML file path, or the shipped ``golden/workloads/NAME.yaml``."""
    p = Path(name)
    if p.suffix in (".yaml", ".yml") or p.is_file():
        return p
    for d in data_dirs("golden/workloads"):
        if (d / f"{name}.yaml").is_file():
            return d / f"{name}.yaml"
    shipped = sorted({f.stem for d in data_dirs("golden/workloads") for f in d.glob("*.yaml")})
    raise WorkloadError(f"--workload {name!r}: no such workload (shipped: {', '.join(shipped)}; or give a YAML file)")


def load_workload(name: str) -> Workload:
    path = workload_path(name)
    try:
        doc = read_yaml(path)
    except YamlFileError as e:
        raise WorkloadError(str(e)) from None
    return parse_workload(doc, str(path))


__all__ = ["WORDS", "Workload", "WorkloadError", "as_text", "load_workload", "parse_workload", "workload_path"]
