"""Golden cases: data files (``golden/cases/*.yaml``) turned into token ids.

A case is a conversation (rendered with the XTML renderer, docs/chat.md) or a plain prompt, plus
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

from k3bundle.chat import render_ids
from k3bundle.data_dirs import data_dirs
from k3bundle.errors import YamlFileError
from k3bundle.golden.errors import CaseError
from k3bundle.io.strict_yaml import read_yaml
from k3bundle.media import MediaError, media_tokens
from k3bundle.media.synthetic import ImageSpec, make_image, parse_spec

KINDS = ("greedy", "thinking", "tool_call", "multi_turn", "long_context", "image")
_KEYS = {"schema_version", "name", "kind", "description", "prompt", "messages", "tools", "render",
         "generate", "taps", "long_context", "requires", "image"}
_RENDER_KEYS = {"thinking", "thinking_effort", "tool_choice", "response_format"}
SUPPORTED_FEATURES: set[str] = {"vision"}  # the executor runs MoonViT-V2 (executor.vision)


@dataclass(frozen=True)
class TapPlan:
    """Which positions of a case are recorded: all, or a sample plus the last few."""

    all: bool = True
    sample_positions: int = 0
    last_positions: int = 0

    def positions(self, length: int) -> list[int]:
        if self.all or length <= self.sample_positions + self.last_positions:
            return list(range(length))
        step = length / max(1, self.sample_positions)
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
    image: ImageSpec | None = None  # the synthetic image of an image case (media.synthetic)
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
            target = self.long_context["target_tokens"] if long_tokens is None else check_long_tokens(long_tokens)
            return _long_ids(self, encoding, target)
        return render_ids(self.messages, encoding, tools=self.tools, images=self.media_blocks(), **self.render)

    def image_input(self):
        """The case's image preprocessed for the vision tower (``media.image.ImageInput``), or None."""
        if self.image is None:
            return None
        from k3bundle.media.image import preprocess_array  # Pillow, only where pixels are needed

        return preprocess_array(make_image(self.image), self.source)

    def media_blocks(self) -> list[tuple[int, int, int]] | None:
        """The image's media block for the renderer: (width, height, <|media_pad|> count)."""
        if self.image is None:
            return None
        return [(self.image.width, self.image.height, media_tokens(self.image.width, self.image.height))]


def _image_parts(messages: list) -> int:
    return sum(1 for m in messages if isinstance(m.get("content"), list)
               for part in m["content"] if isinstance(part, dict) and part.get("type") in ("image", "image_url"))


_WORDS = ("tensor shard rank expert block scale layer token cache state kernel device manifest "
          "bundle golden router latent head norm gate chunk decode prefill byte hash layout "
          "memory bandwidth record value index stream worker file").split()


def _filler(seed: int, sentences: int) -> str:
    # Python's Mersenne Twister with choice/randint: integer arithmetic only (getrandbits and
    # rejection), so the same text on every machine; the goldens' decisions pin holds it
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


#: the most greedy steps a case may ask for: goldens keep every tap of every step, so this bounds
#: them (the shipped cases use 8 to 16; a step of the release's model is ~0.5 GB of float32 taps)
MAX_STEPS = 4096
#: the most tokens a long-context case may build: the release's context (max_position_embeddings)
MAX_TOKENS = 1 << 20
#: positions a sampled tap plan may name (``sample_positions + last_positions``)
MAX_TAPPED = 65536


def _check(cond: bool, path: Path, msg: str) -> None:
    if not cond:
        raise CaseError(f"{path}: {msg}")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int_in(data: dict, key: str, where: str, lo: int, hi: int, path: Path) -> int:
    v = data.get(key)
    _check(_is_int(v) and lo <= v <= hi, path, f"{where}{key} must be an integer from {lo} to {hi:,}, got {v!r}")
    return v


def _mapping(data: dict, key: str, path: Path, keys: set[str] | None = None) -> dict:
    body = data.get(key) or {}
    _check(isinstance(body, dict), path, f"{key} must be a mapping, got {body!r}")
    unknown = sorted(set(body) - keys) if keys is not None else []
    _check(not unknown, path, f"unknown key {key}.{unknown[0] if unknown else ''} (known: {', '.join(sorted(keys or ()))})")
    return body


def check_long_tokens(n: int) -> int:
    """``--long-tokens``: the long-context case's length, within 1 .. ``MAX_TOKENS``."""
    if not _is_int(n) or not 1 <= n <= MAX_TOKENS:
        raise CaseError(f"--long-tokens must be an integer from 1 to {MAX_TOKENS:,} (the release's context), "
                        f"got {n!r}")
    return n


def _tap_plan(data: dict, path: Path) -> TapPlan:
    taps = data.get("taps", "all")
    if taps == "all":
        return TapPlan()
    _check(isinstance(taps, dict) and bool(taps) and set(taps) <= {"sample_positions", "last_positions"}, path,
           f"taps must be 'all' or {{sample_positions, last_positions}}, got {taps!r}")
    sample = _int_in(taps, "sample_positions", "taps.", 0, MAX_TAPPED, path) if "sample_positions" in taps else 0
    last = _int_in(taps, "last_positions", "taps.", 0, MAX_TAPPED, path) if "last_positions" in taps else 0
    _check(0 < sample + last <= MAX_TAPPED, path, f"taps must name 1 to {MAX_TAPPED:,} positions, got "
                                                  f"sample_positions {sample} + last_positions {last}")
    return TapPlan(False, sample, last)


def load_case(path: str | Path) -> Case:
    """One case file, every field typed and range-checked (``CaseError`` naming the file and field)."""
    path = Path(path)
    try:
        data = read_yaml(path)
    except YamlFileError as e:
        raise CaseError(str(e)) from None
    _check(isinstance(data, dict), path, "a case file must be a YAML mapping")
    unknown = sorted(set(data) - _KEYS)
    _check(not unknown, path, f"unknown key {unknown[:1]} (known: {', '.join(sorted(_KEYS))})")
    _check(_is_int(data.get("schema_version")) and data["schema_version"] == 1, path, "schema_version must be 1")
    for key in ("name", "kind", "generate"):
        _check(key in data, path, f"required key {key!r} is missing")
    _check(isinstance(data["name"], str) and data["name"].strip() != "", path,
           f"name must be a non-empty string, got {data['name']!r}")
    _check(data["kind"] in KINDS, path, f"kind {data['kind']!r} is not one of {', '.join(KINDS)}")
    _check(isinstance(data.get("description", ""), str), path, "description must be a string")
    sources = [k for k in ("prompt", "messages", "long_context") if k in data]
    _check(len(sources) == 1, path, "give exactly one of prompt, messages, long_context")
    _check(isinstance(data.get("prompt", ""), str), path, f"prompt must be a string, got {data.get('prompt')!r}")
    for key in ("messages", "tools"):
        v = data.get(key, [])
        _check(isinstance(v, list) and all(isinstance(m, dict) for m in v), path,
               f"{key} must be a list of mappings, got {v!r}")
    requires = data.get("requires", [])
    _check(isinstance(requires, list) and all(isinstance(r, str) for r in requires), path,
           f"requires must be a list of feature names, got {requires!r}")
    render = _mapping(data, "render", path, _RENDER_KEYS)
    generate = _mapping(data, "generate", path, {"steps"})
    steps = _int_in(generate, "steps", "generate.", 0, MAX_STEPS, path)
    plan = _tap_plan(data, path)
    if "long_context" in data:
        long = _mapping(data, "long_context", path, {"target_tokens", "filler_seed", "question"})
        _int_in(long, "target_tokens", "long_context.", 1, MAX_TOKENS, path)
        _check(_is_int(long.get("filler_seed", 0)), path, "long_context.filler_seed must be an integer")
        _check(isinstance(long.get("question", ""), str), path, "long_context.question must be a string")
    image = None
    _check(("image" in data) == (data["kind"] == "image"), path, "an image case, and only an image case, "
                                                                 "declares image: {kind, width, height}")
    if "image" in data:
        try:
            image = parse_spec(data["image"], str(path))
        except MediaError as e:
            raise CaseError(str(e)) from None
        parts = _image_parts(data.get("messages") or [])
        _check(parts == 1, path, f"an image case's messages need exactly one image part, found {parts}")
    return Case(name=data["name"], kind=data["kind"], description=data.get("description", ""),
                steps=steps, taps=plan, source=str(path), render=render, prompt=data.get("prompt"),
                messages=data.get("messages"), tools=data.get("tools"),
                long_context=data.get("long_context"), requires=tuple(requires), image=image, raw=data)


def check_context(cases: list[Case], built: dict[str, list[int]], context: object, config: str) -> None:
    """Every case's prompt tokens plus its greedy steps within the model's context
    (``max_position_embeddings`` of ``config``, when it gives one), checked before any forward."""
    if not _is_int(context):
        return
    for c in cases:
        if c.name in built and len(built[c.name]) + c.steps > context:
            raise CaseError(f"{c.source}: {len(built[c.name]):,} prompt tokens + {c.steps} steps exceed the model's "
                            f"context, max_position_embeddings {context:,} in {config}")


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
