"""Presets: the released config with other widths (``k3bundle/data/presets/*.yaml``).

A preset file overrides fields of the released ``config.json``; everything the release
derives from a rule is derived here the same way, so a preset cannot contradict it:
the 1-based ``full_attn_layers``/``kda_layers`` lists (MLA where (l+1) % 4 == 0 and on
the last layer, docs/kimi-k3.md §1.2) and the special-token ids (same offsets from the end of the
vocabulary as the release, docs/kimi-k3.md §1.1 and docs/chat.md).

Presets are config, below everything that uses them: ``schema``/``plan``/``checklist`` read the
config of a preset, ``synth`` writes a checkpoint of one.
"""

from __future__ import annotations

import copy
import json
from importlib import resources

import yaml

from k3bundle.config import K3Config, parse_config, release_config_path
from k3bundle.errors import ConfigError
from k3bundle.tokenizer_specials import special_tokens

PRESET_DIR = resources.files("k3bundle") / "data" / "presets"


def preset_names() -> list[str]:
    return sorted(p.name[:-5] for p in PRESET_DIR.iterdir() if p.name.endswith(".yaml"))


def release_config_dict() -> dict:
    return json.loads(release_config_path().read_text(encoding="utf-8"))


def _merge(base: dict, over: dict, where: str) -> None:
    for key, value in over.items():
        if key not in base:
            raise ConfigError(f"preset field {where}{key} is not a field of the released config")
        if isinstance(value, dict):
            _merge(base[key], value, f"{where}{key}.")
        else:
            base[key] = value


def mla_layers_1based(num_layers: int) -> list[int]:
    """The release rule: layer l (0-based) is MLA iff (l+1) % 4 == 0 or it is the last."""
    return [l + 1 for l in range(num_layers) if (l + 1) % 4 == 0 or l == num_layers - 1]


def preset_config_dict(name: str) -> dict:
    """The config.json content of a preset, as a dict in the release's field order."""
    if name == "full":
        return release_config_dict()
    path = PRESET_DIR / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(f"unknown preset {name!r}; available: {', '.join(preset_names() + ['full'])}")
    over = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    over.pop("description", None)
    over.pop("weights", None)
    cfg = copy.deepcopy(release_config_dict())
    _merge(cfg, over, "")
    text = cfg["text_config"]
    n = text["num_hidden_layers"]
    full = mla_layers_1based(n)
    text["linear_attn_config"]["full_attn_layers"] = full
    text["linear_attn_config"]["kda_layers"] = [i for i in range(1, n + 1) if i not in full]
    ids = special_tokens(text["vocab_size"])
    cfg["bos_token_id"] = ids["[BOS]"]
    cfg["eos_token_id"] = ids["<|end_of_msg|>"]
    cfg["pad_token_id"] = ids["[PAD]"]
    cfg["media_placeholder_token_id"] = ids["<|media_pad|>"]
    return cfg


def preset_weights(name: str) -> str | None:
    """The shipped trained-weights file a preset names (``weights:``, under k3bundle/data), if any."""
    path = PRESET_DIR / f"{name}.yaml"
    if name == "full" or not path.is_file():
        return None
    return (yaml.safe_load(path.read_text(encoding="utf-8")) or {}).get("weights")


def preset_config(name: str) -> K3Config:
    return parse_config(preset_config_dict(name), source=f"preset {name}")
