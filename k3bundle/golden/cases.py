"""Golden cases: data files (``golden/cases/*.yaml``) turned into token ids.

A case is a conversation (rendered with the XTML renderer, spec §4.2) or a plain prompt, plus
how many greedy steps to continue and which positions to tap. Case files are data; this
module validates them (unknown or missing keys are errors naming the file and key) and builds
their ids with a checkpoint's tokenizer. Long-context cases are built from a deterministic
filler so the prompt length scales (8k tokens on the tiny model in CI, 128k+ on a large
machine) without storing the text.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from k3bundle.chat import render_ids
from k3bundle.data_dirs import data_dirs
from k3bundle.golden.errors import CaseError

KINDS = ("greedy", "thinking", "tool_call", "multi_turn", "long_context", "image")
_KEYS = {"schema_version", "name", "kind", "description", "prompt", "messages", "tools", "render",
         "generate", "taps", "long_context", "requires", "image"}
_RENDER_KEYS = {"thinking", "thinking_effort", "tool_choice", "response_format"}
SUPPORTED_FEATURES: set[str] = set()  # "vision" joins once the executor runs MoonViT-V2


@dataclass(frozen=True)
class TapPlan:
    """Which positions of a case are recorded: all, or a sample plus the last few."""

    all: bool = True
    sample_positions: int = 0
    last_positions: int = 0

    def positions(self, length: int) -> list[int]:
        if self.all or length <= self.sample_positions + self.last_positions:
            return list(range(length))
        step = length / self.sample_positions
        picked = {int(i * step) for i in range(self.sample_positions)}
        picked |= set(range(length - self.last_positions, length))
        return sorted(picked)


@dataclass(frozen=True)
class Case:
    name: str
    kind: str
    description: str
    steps: int
    taps: TapPlan
    source: str
    render: dict = field(default_factory=dict)
    prompt: str | None = None
    messages: list | None = None
    tools: list | None = None
    long_context: dict | None = None
    requires: tuple[str, ...] = ()
    raw: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def runnable(self) -> bool:
        return set(self.requires) <= SUPPORTED_FEATURES

    @property
    def not_run_reason(self) -> str | None:
        missing = sorted(set(self.requires) - SUPPORTED_FEATURES)
        return f"needs {', '.join(missing)}, not in the executor yet" if missing else None

    def build_ids(self, encoding, long_tokens: int | None = None) -> list[int]:
        """Token ids of the teacher-forced part (prompt or rendered conversation)."""
        if self.prompt is not None:
            return encoding.encode(self.prompt, disallowed_special=())
        if self.long_context is not None:
            target = long_tokens or int(self.long_context["target_tokens"])
            return _long_ids(self, encoding, target)
        return render_ids(self.messages, encoding, tools=self.tools, **self.render)


_WORDS = ("tensor shard rank expert block scale layer token cache state kernel device manifest "
          "bundle golden router latent head norm gate chunk decode prefill byte hash layout "
          "memory bandwidth record value index stream worker file").split()


def _filler(seed: int, sentences: int) -> str:
    rng = random.Random(seed)
    out = []
    for i in range(sentences):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(6, 14))]
        out.append(f"Record {i}: " + " ".join(words) + f" = {rng.randint(0, 99999)}.")
    return "\n".join(out)


def _long_ids(case: Case, encoding, target: int) -> list[int]:
    seed = int(case.long_context.get("filler_seed", 0))
    question = case.long_context.get("question", "")

    def ids_for(n: int) -> list[int]:
        msgs = [{"role": "user", "content": (_filler(seed, n) + "\n\n" if n else "") + question}]
        return render_ids(msgs, encoding, **case.render)

    # measure tokens per sentence on a short filler, then grow to the first length >= target
    base, probe = len(ids_for(0)), 32
    per = max(1.0, (len(ids_for(probe)) - base) / probe)
    n = max(1, int((target - base) / per))
    ids = ids_for(n)
    while len(ids) < target:
        n += max(1, int((target - len(ids)) / per))
        ids = ids_for(n)
    return ids


def _check(cond: bool, path: Path, msg: str) -> None:
    if not cond:
        raise CaseError(f"{path}: {msg}")


def load_case(path: str | Path) -> Case:
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as e:
        raise CaseError(f"{path}: cannot read case: {str(e).splitlines()[0]}") from None
    _check(isinstance(data, dict), path, "a case file must be a YAML mapping")
    unknown = sorted(set(data) - _KEYS)
    _check(not unknown, path, f"unknown key {unknown[:1]} (known: {', '.join(sorted(_KEYS))})")
    _check(data.get("schema_version") == 1, path, "schema_version must be 1")
    for key in ("name", "kind", "generate"):
        _check(key in data, path, f"required key {key!r} is missing")
    _check(data["kind"] in KINDS, path, f"kind {data['kind']!r} is not one of {', '.join(KINDS)}")
    sources = [k for k in ("prompt", "messages", "long_context") if k in data]
    _check(len(sources) == 1, path, "give exactly one of prompt, messages, long_context")
    render = data.get("render") or {}
    bad = sorted(set(render) - _RENDER_KEYS)
    _check(not bad, path, f"unknown render option {bad[:1]}")
    steps = (data["generate"] or {}).get("steps")
    _check(isinstance(steps, int) and steps >= 0, path, "generate.steps must be a non-negative integer")
    taps = data.get("taps", "all")
    if taps == "all":
        plan = TapPlan()
    else:
        _check(isinstance(taps, dict) and set(taps) <= {"sample_positions", "last_positions"}, path,
               "taps must be 'all' or {sample_positions, last_positions}")
        plan = TapPlan(False, int(taps.get("sample_positions", 0)), int(taps.get("last_positions", 0)))
    if "long_context" in data:
        _check(isinstance(data["long_context"].get("target_tokens"), int), path,
               "long_context.target_tokens must be an integer")
    return Case(name=str(data["name"]), kind=data["kind"], description=data.get("description", ""),
                steps=steps, taps=plan, source=str(path), render=render, prompt=data.get("prompt"),
                messages=data.get("messages"), tools=data.get("tools"),
                long_context=data.get("long_context"), requires=tuple(data.get("requires", ())),
                raw=data)


def default_cases_dir() -> Path:
    """``golden/cases`` in a source checkout, else the copy inside the installed package."""
    for d in data_dirs("golden/cases"):
        return d
    raise CaseError("no golden/cases directory found; pass --cases DIR")


def load_cases(directory: str | Path | None = None) -> list[Case]:
    d = Path(directory) if directory else default_cases_dir()
    files = sorted(d.glob("*.yaml"))
    if not files:
        raise CaseError(f"{d}: no *.yaml case files")
    cases = [load_case(f) for f in files]
    names = [c.name for c in cases]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise CaseError(f"{d}: case name {dup[0]!r} is used by more than one file")
    return cases
