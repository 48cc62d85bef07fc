"""Write a synthetic checkpoint laid out exactly like the Kimi K3 release (docs/kimi-k3.md §2.1).

Files: ``config.json`` (release fields and nesting), ``generation_config.json``,
``preprocessor_config.json``, ``tiktoken.model`` + ``tokenizer_config.json``, the
release's Python files as inert data (k3bundle never executes them; the synthetic ones
raise if anything does), one shard per decoder layer then text globals, projector and
vision shards named ``model-0000N-of-0000NN.safetensors``, and
``model.safetensors.index.json``.

Output is staged in a hidden sibling directory and renamed into place at the end, so an
interrupted run never leaves a directory that looks like a complete checkpoint.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from k3bundle.config import parse_config
from k3bundle.errors import SynthError
from k3bundle.file_names import CONFIG, SOURCE_INDEX
from k3bundle.io import write_index, write_safetensors
from k3bundle.presets import preset_config_dict, preset_weights
from k3bundle.schema import Schema
from k3bundle.synth.tokenizer import write_tokenizer
from k3bundle.synth.trained import load_trained
from k3bundle.synth.weights import make_tensors

# The release ships Python sources (docs/kimi-k3.md §2.1); they are copied as data, never imported.
# The synthetic stand-ins fail loudly if anything ever executes them.
CODE_FILES = ("configuration_kimi_k3.py", "modeling_kimi_k3.py", "modeling_kimi_linear.py",
              "encoding_k3.py", "tokenization_kimi.py")
_CODE_STUB = ('"""Synthetic stand-in for the release file of this name: data only."""\n'
              'raise RuntimeError("code shipped in a model repo must never be executed")\n')


@dataclass(frozen=True)
class SynthResult:
    out: Path
    preset: str
    seed: int
    files: list[str]
    tensors: int
    total_size: int  # sum of tensor bytes, as in the index's metadata.total_size


def _json_text(obj) -> str:
    return json.dumps(obj, indent=2, ensure_ascii=False) + "\n"


def _side_files(cfg: dict) -> dict[str, str]:
    vision = cfg.get("vision_config") or {}
    return {
        CONFIG: _json_text(cfg),
        "generation_config.json": _json_text({  # release defaults (docs/kimi-k3.md §2.1)
            "bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"],
            "temperature": 1.0, "top_p": 1.0}),
        "preprocessor_config.json": _json_text({  # MoonViT-V2 preprocessing (docs/kimi-k3.md §3.9, V0)
            "image_processor_type": "KimiK3ImageProcessor",
            "patch_size": vision.get("patch_size", 14),
            "merge_kernel_size": vision.get("merge_kernel_size", [2, 2]),
            "in_patch_limit": 65536, "patch_limit_on_one_side": 512,
            "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}),
        **{name: _CODE_STUB for name in CODE_FILES},
    }


def write_synthetic(out: str | Path, preset: str = "tiny", seed: int = 0, force: bool = False,
                    progress: Callable[[int, int, str], None] | None = None) -> SynthResult:
    """Write the synthetic checkpoint of ``preset`` to ``out``.

    Args:
        out (`Path`): destination directory; must not exist unless ``force``.
        preset (`str`): "tiny", "tiny-trained", "small", "full-depth" or "full-width" ("full" is
            refused: 1.56 TB).
        seed (`int`): same seed => byte-identical files. A trained preset is one fixed model:
            its text tensors come from the package and the seed must stay 0.
        progress (`callable`, optional): called as ``progress(done, total, file_name)``.
    """
    if preset == "full":
        raise SynthError("preset 'full' is the real 1.56 TB model; use it with plan/checklist "
                         "(--config); synth writes its narrow stand-ins, e.g. 'tiny', or 'full-depth' "
                         "(every released tensor name at narrow widths)")
    out = Path(out)
    if out.exists() and not force and (not out.is_dir() or any(out.iterdir())):
        raise SynthError(f"{out}: already exists and is not empty (pass --force to replace it)")
    cfg = preset_config_dict(preset)
    config = parse_config(cfg, source=f"preset {preset}")
    schema = Schema(config)
    trained_file = preset_weights(preset)
    if trained_file is not None and seed != 0:
        raise SynthError(f"preset {preset} is one trained model (k3bundle/data/{trained_file}); "
                         f"--seed {seed} does not apply to it (leave it at 0)")
    fixed = load_trained(trained_file, schema) if trained_file else None

    stage = out.parent / f".{out.name}.partial"
    if stage.exists():
        shutil.rmtree(stage)
    stage.mkdir(parents=True)
    try:
        files = []
        for name, text in _side_files(cfg).items():
            (stage / name).write_text(text, encoding="utf-8")
            files.append(name)
        files += write_tokenizer(stage, config.text.vocab_size)

        weight_map: dict[str, str] = {}
        total = count = 0
        n = schema.num_shards
        for i in range(1, n + 1):
            shard = schema.shard_name(i)
            if progress:
                progress(i - 1, n, shard)
            specs = list(schema.shard_tensors(i))
            write_safetensors(stage / shard, make_tensors(schema, specs, seed, fixed), metadata={"format": "pt"})
            for spec in specs:
                weight_map[spec.name] = shard
                total += spec.nbytes
            count += len(specs)
            files.append(shard)
        write_index(stage, weight_map, total)
        files.append(SOURCE_INDEX)
        if progress:
            progress(n, n, "")

        if out.exists():
            shutil.rmtree(out) if out.is_dir() else out.unlink()
        stage.rename(out)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return SynthResult(out, preset, seed, sorted(files), count, total)
