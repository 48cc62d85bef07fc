"""Target layouts as data: ``layouts/NAME.yaml``, parsed and checked once.

A layout names the cards (count, memory, peak FLOP/s, bandwidths), the parallel degrees
(TP, attention DP, EP, PP), how experts are placed, the storage format of each tensor role,
the scale layout, and the bundle's file rules. ``docs/layouts.md`` documents every field.

This module checks what a layout says on its own (field types, degrees that cover the cards,
formats that fit the roles they name). Checks that need the model's shapes (TP must divide the
heads, EP the experts, MXFP4 slices on whole blocks, ...) are in ``k3bundle.plan``. Every
check has a rule name, and a failing layout raises one ``LayoutError`` that lists every broken
rule with both numbers, e.g. ``[cards-match-degrees] tp (8) x attention_dp (1) x pp (2) = 16
must equal card.count (8)``.

Lookup: ``layouts/`` at the repository root first (a source checkout), then the copy the wheel
carries as ``k3bundle/_data/layouts``. ``--target`` also accepts a path to a YAML file.
"""

from __future__ import annotations

import fnmatch
import hashlib
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from k3bundle.data_dirs import data_dirs
from k3bundle.errors import K3Error, YamlFileError
from k3bundle.formats import mxfp4
from k3bundle.io.strict_yaml import read_yaml
from k3bundle.schema.roles import ROLES, Role, Section
from k3bundle.storage import (AS_STORED, CONVENTIONS, ENTRY_POINT_GROUP, LAYOUT_NAMES, STORAGE, layout_format,
                              storage_for)

LAYOUT_SCHEMA_VERSION = 1

#: Storage formats a layout may give a role (docs/layouts.md "formats"): the registry's own names;
#: a layout may also name a format of an installed package (``storage.layout_format``).
FORMATS = tuple(sorted(LAYOUT_NAMES))
SCALE_LAYOUTS = ("row-major", "swizzled-128x4")
EXPERT_PLACEMENTS = ("contiguous",)
#: Dimensions whose per-rank size a layout may pad up to a multiple (zero rows / columns).
PADDABLE_DIMS = ("V", "I", "S", "Ie")
#: upper bounds of a layout's numbers, far above any card announced, so that a typo (or ``2^40``)
#: is refused at parse time instead of exhausting memory in convert (docs/layouts.md "Fields")
MAX_CARDS = 65536
MAX_HBM_BYTES = 1 << 50  # 1 PiB per card
MAX_BANDWIDTH = 1e15  # bytes/s, HBM or link: 1 PB/s
MAX_FLOPS = 1e18  # FLOP/s per card and dtype: 1 EFLOP/s
MAX_FILE_BYTES = 1 << 40  # 1 TiB per device file
MAX_ALIGNMENT = 1 << 20  # 1 MiB: the data buffer of a device file starts at a multiple of it
MAX_PAD_MULTIPLE = 65536
#: formats that keep a role's released bytes: the vision tower and projector take only these (their
#: TP rule is ``replicate``, docs/kimi-k3.md §5.1, and every rank of stage 0 holds them verbatim)
VERBATIM_FORMATS = (AS_STORED, "bf16")
PEAK_FLOPS_KEYS = ("fp64", "fp32", "tf32", "bf16", "fp16", "fp8", "int8", "fp6", "fp4", "mxfp4", "nvfp4")



class LayoutError(K3Error):
    """A layout file is malformed or asks for a placement the model cannot take.

    ``rules`` lists the names of the broken rules (docs/layouts.md "Rules").
    """

    def __init__(self, message: str, rules: list[str] | None = None):
        super().__init__(message)
        self.rules = rules or []


@dataclass(frozen=True)
class Card:
    name: str
    count: int
    hbm_bytes: int
    hbm_bandwidth_bytes_per_s: float
    link_bandwidth_bytes_per_s: float
    peak_flops: dict[str, float]


@dataclass(frozen=True)
class Parallel:
    tp: int
    attention_dp: int = 1
    ep: int = 1
    pp: int = 1
    pp_layers: tuple[int, ...] | None = None  # decoder layers per stage; None = balanced
    expert_placement: str = "contiguous"

    @property
    def stage_ranks(self) -> int:
        """Ranks in one pipeline stage: tp x attention_dp (= ep x moe_tp)."""
        return self.tp * self.attention_dp

    @property
    def moe_tp(self) -> int:
        """TP degree inside one routed expert: the stage's ranks that EP does not use."""
        return self.stage_ranks // self.ep

    @property
    def world(self) -> int:
        return self.stage_ranks * self.pp


@dataclass(frozen=True)
class FormatRule:
    """``formats`` entry: roles matching ``pattern`` (fnmatch) are stored as ``format``."""

    pattern: str
    format: str
    scale_rule: str | None = None  # formats that take one (mxfp4-from-bf16): floor / rceil / even
    convention: str = "compressed-tensors"  # the layout's tensor convention (names, scale semantics)

    def as_yaml(self) -> Any:
        return {"format": self.format, "scale_rule": self.scale_rule} if self.scale_rule else self.format


@dataclass(frozen=True)
class Layout:
    name: str
    description: str
    card: Card
    parallel: Parallel
    formats: tuple[FormatRule, ...]
    convention: str = "compressed-tensors"
    scale_layout: str = "row-major"
    stack_experts: bool = False
    padding: dict[str, int] = field(default_factory=dict)
    max_file_bytes: int = 5_000_000_000
    data_alignment: int = 8
    runtime_reserve_bytes: int = 0
    path: str = field(default="", compare=False)

    # ---- per-role storage ----
    def rule_for(self, role: Role) -> FormatRule:
        """The first ``formats`` rule whose pattern matches the role name; else ``source``."""
        for rule in self.formats:
            if fnmatch.fnmatchcase(role.role, rule.pattern):
                return rule
        return FormatRule("", AS_STORED, convention=self.convention)

    @property
    def swizzled(self) -> bool:
        return self.scale_layout == "swizzled-128x4"

    # ---- pipeline ----
    def stage_layers(self, num_layers: int) -> tuple[int, ...]:
        """Decoder layers per stage: explicit, or balanced with the first stages taking the
        remainder (TensorRT-LLM ``Mapping.pp_layers``)."""
        if self.parallel.pp_layers is not None:
            return self.parallel.pp_layers
        pp = self.parallel.pp
        base, extra = divmod(num_layers, pp)
        return tuple(base + (1 if s < extra else 0) for s in range(pp))

    def resolved(self, num_layers: int) -> "Layout":
        """This layout with every default written out (``pp_layers`` for ``num_layers``)."""
        return replace(self, parallel=replace(self.parallel, pp_layers=self.stage_layers(num_layers)))

    # ---- serialisation ----
    def to_dict(self) -> dict:
        c, p = self.card, self.parallel
        return {
            "schema_version": LAYOUT_SCHEMA_VERSION,
            "name": self.name,
            "description": self.description,
            "card": {"name": c.name, "count": c.count, "hbm_bytes": c.hbm_bytes,
                     "hbm_bandwidth_bytes_per_s": c.hbm_bandwidth_bytes_per_s,
                     "link_bandwidth_bytes_per_s": c.link_bandwidth_bytes_per_s,
                     "peak_flops": dict(c.peak_flops)},
            "parallel": {"tp": p.tp, "attention_dp": p.attention_dp, "ep": p.ep, "moe_tp": p.moe_tp,
                         "pp": p.pp, "pp_layers": None if p.pp_layers is None else list(p.pp_layers),
                         "expert_placement": p.expert_placement},
            "formats": {r.pattern: r.as_yaml() for r in self.formats},
            "convention": self.convention,
            "scale_layout": self.scale_layout,
            "stack_experts": self.stack_experts,
            "padding": dict(self.padding),
            "files": {"max_bytes": self.max_file_bytes, "data_alignment": self.data_alignment},
            "memory": {"runtime_reserve_bytes": self.runtime_reserve_bytes},
        }

    def to_yaml(self) -> bytes:
        """Deterministic YAML of ``to_dict()`` (the bundle's ``device_weights/layout.yaml``)."""
        text = yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=False,
                              allow_unicode=True, width=100)
        return ("# Resolved k3bundle layout: every default written out. Written by k3bundle "
                "convert; docs/layouts.md.\n" + text).encode("utf-8")

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.to_yaml()).hexdigest()


# ------------------------------------------------------------------------------------------
# Parsing: one pass, every problem collected, one error.


class _Problems:
    def __init__(self, source: str):
        self.source = source
        self.items: list[tuple[str, str]] = []

    def add(self, rule: str, message: str) -> None:
        self.items.append((rule, message))

    def raise_if_any(self) -> None:
        if self.items:
            text = "; ".join(f"[{r}] {m}" for r, m in self.items)
            raise LayoutError(f"{self.source}: {text}", [r for r, _ in self.items])


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _section(data: Any, where: str, allowed: tuple[str, ...], p: _Problems) -> dict:
    if data is None:
        return {}
    if not isinstance(data, dict):
        p.add("layout-field", f"{where} must be a mapping, got {type(data).__name__}")
        return {}
    for key in data:
        if key not in allowed:
            p.add("layout-field", f"unknown field {where}.{key} (allowed: {', '.join(allowed)})"
                  if where else f"unknown field {key} (allowed: {', '.join(allowed)})")
    return data


def _absent(key: str, where: str, p: _Problems, default: Any) -> Any:
    """The value of an absent field: its default, or 1 after reporting it as missing."""
    if default is ...:
        p.add("layout-field", f"required field {where}.{key} is missing")
        return 1
    return default


def _positive_int(d: dict, key: str, where: str, p: _Problems, default: Any = ..., hi: int = 1 << 62) -> int:
    if key not in d:
        return _absent(key, where, p, default)
    v = d[key]
    if not _is_int(v) or not 0 < v <= hi:
        p.add("layout-field", f"{where}.{key} must be a positive integer up to {hi:,}, got {v!r}")
        return 1
    return v


def _number(d: dict, key: str, where: str, p: _Problems, hi: float, default: Any = ...,
            allow_zero: bool = False) -> Any:
    if key not in d:
        return _absent(key, where, p, default)
    v = d[key]
    if isinstance(v, str):
        p.add("layout-field", f"{where}.{key} must be a number, got the string {v!r} "
                              "(YAML needs a sign in float exponents: write 8.0e+12, or 8_000_000_000_000)")
        return 1
    # a NaN passes every comparison below false and an Infinity is not JSON: both are refused
    if not _is_number(v) or not math.isfinite(v) or v < 0 or (v == 0 and not allow_zero) or v > hi:
        p.add("layout-field", f"{where}.{key} must be a finite {'non-negative' if allow_zero else 'positive'} "
                              f"number up to {hi:,.0f}, got {v!r}")
        return 1
    return int(v) if float(v).is_integer() else float(v)


def _card(data: Any, p: _Problems) -> Card:
    d = _section(data, "card", ("name", "count", "hbm_bytes", "hbm_bandwidth_bytes_per_s",
                                "link_bandwidth_bytes_per_s", "peak_flops"), p)
    if not d:
        p.add("layout-field", "required section card is missing")
    name = d.get("name")
    if not isinstance(name, str) or not name:
        p.add("layout-field", f"card.name must be a non-empty string, got {name!r}")
        name = "?"
    flops = _section(d.get("peak_flops"), "card.peak_flops", PEAK_FLOPS_KEYS, p)
    if not flops:
        p.add("layout-field", "card.peak_flops must give at least one dtype (e.g. bf16)")
    peak = {k: _number(flops, k, "card.peak_flops", p, MAX_FLOPS) for k in flops if k in PEAK_FLOPS_KEYS}
    return Card(name, _positive_int(d, "count", "card", p, hi=MAX_CARDS),
                _number(d, "hbm_bytes", "card", p, MAX_HBM_BYTES),
                _number(d, "hbm_bandwidth_bytes_per_s", "card", p, MAX_BANDWIDTH),
                _number(d, "link_bandwidth_bytes_per_s", "card", p, MAX_BANDWIDTH), peak)


def _parallel(data: Any, card_count: int, p: _Problems) -> Parallel:
    d = _section(data, "parallel", ("tp", "attention_dp", "ep", "moe_tp", "pp", "pp_layers",
                                    "expert_placement"), p)
    if not d:
        p.add("layout-field", "required section parallel is missing")
    tp = _positive_int(d, "tp", "parallel", p, hi=MAX_CARDS)
    dp = _positive_int(d, "attention_dp", "parallel", p, 1, hi=MAX_CARDS)
    ep = _positive_int(d, "ep", "parallel", p, 1, hi=MAX_CARDS)
    pp = _positive_int(d, "pp", "parallel", p, 1, hi=MAX_CARDS)
    placement = d.get("expert_placement", "contiguous")
    if placement not in EXPERT_PLACEMENTS:
        p.add("expert-placement", f"parallel.expert_placement {placement!r} is not supported "
                                  f"(supported: {', '.join(EXPERT_PLACEMENTS)})")
    layers = d.get("pp_layers")
    if layers is not None:
        if not isinstance(layers, list) or not all(_is_int(x) and x > 0 for x in layers):
            p.add("pp-covers-layers", f"parallel.pp_layers must be a list of positive integers, got {layers!r}")
            layers = None
        elif len(layers) != pp:
            p.add("pp-covers-layers", f"parallel.pp_layers has {len(layers)} entries but pp is {pp}")
            layers = None
        else:
            layers = tuple(layers)
    if tp * dp * pp != card_count:
        p.add("cards-match-degrees", f"tp ({tp}) x attention_dp ({dp}) x pp ({pp}) = {tp * dp * pp} "
                                     f"must equal card.count ({card_count})")
    if (tp * dp) % ep:
        p.add("ep-divides-stage", f"ep ({ep}) must divide the ranks of a pipeline stage, "
                                  f"tp ({tp}) x attention_dp ({dp}) = {tp * dp}")
    par = Parallel(tp, dp, ep, pp, layers, placement if placement in EXPERT_PLACEMENTS else "contiguous")
    if "moe_tp" in d and (tp * dp) % ep == 0 and d["moe_tp"] != par.moe_tp:
        p.add("ep-divides-stage", f"parallel.moe_tp ({d['moe_tp']!r}) must equal tp x attention_dp / ep "
                                  f"({par.moe_tp}); it is derived and may be left out")
    return par


def _formats(data: Any, conv: str, p: _Problems) -> tuple[FormatRule, ...]:
    if data is None:
        return (FormatRule("*", AS_STORED, convention=conv),)
    if not isinstance(data, dict):
        p.add("layout-field", f"formats must be a mapping of role pattern -> format, got {type(data).__name__}")
        return ()
    rules = []
    for pattern, spec in data.items():
        where = f"formats[{pattern!r}]"
        opts: dict = {}
        if isinstance(spec, dict):
            opts = _section(spec, where, ("format", "scale_rule"), p)
            fmt = opts.get("format")
        else:
            fmt = spec
        if not isinstance(fmt, str) or layout_format(fmt) is None:
            p.add("format-name", f"{where}: unknown format {fmt!r} (known: {', '.join(sorted(LAYOUT_NAMES))}; "
                                 f"another package's format joins by an entry point of group {ENTRY_POINT_GROUP})")
            continue
        rule = opts.get("scale_rule")
        choices = LAYOUT_NAMES[fmt].scale_rules
        if choices:
            if rule not in choices:
                p.add("format-name", f"{where}: {fmt} needs scale_rule, one of "
                                     f"{', '.join(choices)} (got {rule!r})")
                continue
        elif rule is not None:
            ruled = sorted(n for n, f in LAYOUT_NAMES.items() if f.scale_rules)
            p.add("format-name", f"{where}: scale_rule applies only to {', '.join(ruled)}, not {fmt}")
        if not isinstance(pattern, str) or not any(fnmatch.fnmatchcase(r.role, pattern) for r in ROLES):
            p.add("format-pattern-unused", f"{where} matches no tensor role (roles look like "
                                           "'kda.q_proj', 'moe.expert.w1'; docs/layouts.md lists them)")
            continue
        rules.append(FormatRule(pattern, fmt, rule, conv))
    out = tuple(rules)
    # every role gets the format of its first matching rule; that format must fit the role and
    # be one the layout's convention can name
    probe = Layout("", "", Card("", 1, 1, 1, 1, {}), Parallel(1), out, conv)
    recoded_vision: dict[str, list[str]] = {}  # pattern -> the vision / projector roles it would recode
    for role in ROLES:
        r = probe.rule_for(role)
        why = LAYOUT_NAMES[r.format].fits(r.format, role)
        if role.section is not Section.TEXT and r.format not in VERBATIM_FORMATS:
            recoded_vision.setdefault(r.pattern, []).append(role.role)
        elif why:
            p.add("format-source-dtype", f"formats[{r.pattern!r}]: {why}")
        elif conv in CONVENTIONS and not storage_for(r.format, role).named_under(conv):
            names = ", ".join(f.name for f in STORAGE.values() if f.named_under(conv))
            p.add("format-convention", f"formats[{r.pattern!r}]: {role.role} would be stored "
                                       f"{storage_for(r.format, role).name}, which the {conv} convention cannot "
                                       f"name (it names {names})")
    for pattern, roles in recoded_vision.items():
        p.add("vision-as-released", f"formats[{pattern!r}] would recode {', '.join(roles)}; the vision tower "
                                    f"and projector are kept as released (BF16, replicated): put "
                                    f"'vit.*': source and 'proj.*': source before it")
    return out


def parse_layout(data: Any, source: str = "layout") -> Layout:
    """Check a layout mapping (the parsed YAML) and build a ``Layout``.

    Raises ``LayoutError`` listing every broken rule at once.
    """
    p = _Problems(source)
    if not isinstance(data, dict):
        raise LayoutError(f"{source}: a layout must be a YAML mapping, got {type(data).__name__}", ["layout-field"])
    d = _section(data, "", ("schema_version", "name", "description", "card", "parallel", "formats",
                            "convention", "scale_layout", "stack_experts", "padding", "files", "memory"), p)
    if d.get("schema_version") != LAYOUT_SCHEMA_VERSION:
        p.add("layout-field", f"schema_version must be {LAYOUT_SCHEMA_VERSION}, got {d.get('schema_version')!r}")
    name = d.get("name")
    if not isinstance(name, str) or not name:
        p.add("layout-field", f"name must be a non-empty string, got {name!r}")
        name = "?"
    description = d.get("description", "")
    if not isinstance(description, str):
        p.add("layout-field", "description must be a string")
        description = ""
    card = _card(d.get("card"), p)
    par = _parallel(d.get("parallel"), card.count, p)
    conv = d.get("convention", "compressed-tensors")  # the release's own convention
    if conv not in CONVENTIONS:
        p.add("layout-field", f"convention must be one of {', '.join(CONVENTIONS)} (the names and scale "
                              f"semantics of the device tensors), got {conv!r}")
        conv = "compressed-tensors"
    formats = _formats(d.get("formats"), conv, p)
    scale_layout = d.get("scale_layout", "row-major")
    if scale_layout not in SCALE_LAYOUTS:
        p.add("layout-field", f"scale_layout {scale_layout!r} is not one of {', '.join(SCALE_LAYOUTS)}")
    stack = d.get("stack_experts", False)
    if not isinstance(stack, bool):
        p.add("layout-field", f"stack_experts must be true or false, got {stack!r}")
    padding = _section(d.get("padding"), "padding", PADDABLE_DIMS, p)
    pads = {}
    for dim, mult in padding.items():
        if dim not in PADDABLE_DIMS:
            p.add("padding-dim", f"padding.{dim}: only the per-rank sizes of {', '.join(PADDABLE_DIMS)} "
                                 "can be padded (heads cannot)")
        elif not _is_int(mult) or not 0 < mult <= MAX_PAD_MULTIPLE:
            p.add("padding-dim", f"padding.{dim} must be a positive integer multiple up to {MAX_PAD_MULTIPLE:,}, "
                                 f"got {mult!r}")
        else:
            pads[dim] = mult
    if "Ie" in pads and pads["Ie"] % mxfp4.BLOCK:
        p.add("padding-mxfp4-block", f"padding.Ie ({pads['Ie']}) must be a multiple of the MXFP4 block "
                                     f"({mxfp4.BLOCK}): routed experts are stored in 32-element blocks")
    files = _section(d.get("files"), "files", ("max_bytes", "data_alignment"), p)
    max_bytes = _positive_int(files, "max_bytes", "files", p, 5_000_000_000, hi=MAX_FILE_BYTES)
    align = _positive_int(files, "data_alignment", "files", p, 8, hi=MAX_ALIGNMENT)
    if align % 8 or align & (align - 1):
        p.add("layout-field", f"files.data_alignment ({align}) must be a power of two and a multiple of 8")
    memory = _section(d.get("memory"), "memory", ("runtime_reserve_bytes",), p)
    reserve = _number(memory, "runtime_reserve_bytes", "memory", p, MAX_HBM_BYTES, 0, allow_zero=True)
    if _is_number(reserve) and _is_number(card.hbm_bytes) and reserve >= card.hbm_bytes:
        p.add("layout-field", f"memory.runtime_reserve_bytes ({reserve}) must be below card.hbm_bytes "
                              f"({card.hbm_bytes})")
    p.raise_if_any()
    return Layout(name, description, card, par, formats, conv, scale_layout, stack, pads, max_bytes, align,
                  int(reserve), path=source)


# ------------------------------------------------------------------------------------------
# Lookup


def layout_dirs() -> list[Path]:
    """Where named layouts are looked up, in order (repository root first)."""
    return data_dirs("layouts")


def layout_names() -> list[str]:
    names: set[str] = set()
    for d in layout_dirs():
        names.update(p.name[:-5] for p in d.glob("*.yaml"))
    return sorted(names)


def find_layout(target: str) -> Path:
    """The YAML file for a layout name (or a path to a YAML file)."""
    if target.endswith((".yaml", ".yml")) or "/" in target:
        path = Path(target)
        if not path.is_file():
            raise LayoutError(f"layout file {target} not found", ["layout-not-found"])
        return path
    for d in layout_dirs():
        path = d / f"{target}.yaml"
        if path.is_file():
            return path
    raise LayoutError(f"layout {target!r} not found; available: {', '.join(layout_names()) or 'none'} "
                      f"(searched {', '.join(str(d) for d in layout_dirs()) or 'no layout directory'})",
                      ["layout-not-found"])


def load_layout(target: str) -> Layout:
    """Find, read and check a layout by name or path."""
    path = find_layout(target)
    try:
        data = read_yaml(path)
    except YamlFileError as e:
        raise LayoutError(str(e), ["layout-field"]) from None
    layout = parse_layout(data, source=str(path))
    stem = path.name.rsplit(".", 1)[0]
    if not (target.endswith((".yaml", ".yml")) or "/" in target) and layout.name != stem:
        raise LayoutError(f"{path}: name {layout.name!r} must equal the file name {stem!r}", ["layout-field"])
    return layout
