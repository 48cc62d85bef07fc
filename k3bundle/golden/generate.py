"""``k3bundle golden``: run the executor in high precision over the case suite.

For each runnable case: build its ids (chat rendering with the checkpoint's tokenizer), then
``executor.case.run_case``: a prefill with every tap recorded at the case's positions, KDA
states snapshotted at chunk boundaries, every expert choice kept, then ``steps`` greedy tokens
with the step logits and the per-step state (KDA recurrent state, the newest MLA latent row)
for drift checks.

Files (``docs/golden.md``): ``golden_inputs.npz`` (ids, greedy tokens, metadata) and
``golden_intermediates.npz`` (zstd; taps, states, logits), both carrying the seed, the
k3bundle version and the content hash of the intermediates; plus ``tolerances.yaml`` copied
from ``tolerances/NAME.yaml``.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from k3bundle import __version__
from k3bundle.bundle.open_weights import open_weights, weights_kind
from k3bundle.executor.case import case_steps, replay_args, run_case, run_cases
from k3bundle.executor.model import drive_lockstep
from k3bundle.executor.kda import CHUNK
from k3bundle.bundle.signoff import manifest_digest
from k3bundle.config import load_config
from k3bundle.file_names import (GOLDEN_FILES, GOLDEN_INPUTS, GOLDEN_INTERMEDIATES, GOLDEN_TOLERANCES,
                                  VALIDATION_DIR)
from k3bundle.golden.cases import Case, check_context, check_long_tokens, load_cases
from k3bundle.golden.errors import GoldenFileError
from k3bundle.golden.noise import (added_noise_arrays, added_noise_steps, noise_arrays, noise_metrics,
                                   sampled_added_noise, sampled_added_noise_steps)
from k3bundle.golden.store import content_hash, meta_array, to_numpy, write_npz
from k3bundle.golden.tolerances import load_tolerances, tolerance_path
from k3bundle.io.files import remove_temps_of, write_atomic
from k3bundle.tokenizer import load_tiktoken

MAX_CHUNK_SNAPSHOTS = 8  # KDA states kept per case at evenly spaced chunk boundaries


@dataclass(frozen=True)
class GoldenResult:
    out: Path
    cases: list[dict]  # per case: name, kind, status ("ok" / "not run"), tokens, positions, seconds, reason
    content_hash: str
    bytes_intermediates: int
    peak_device_bytes: int = 0  # CUDA: the allocator's peak; CPU: the process's peak RSS
    weights: str = "resident"  # "resident" or "streamed" (read ahead one layer: SourceWeights(prefetch))


def source_encoding(source: Path):
    """The tokenizer of a bundle (its tokenizer/) or of a checkpoint (beside its config)."""
    return load_tiktoken(source / "tokenizer" if (source / "tokenizer").is_dir() else source)


def _peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _device_name(device: torch.device) -> str:
    """What made the goldens: the GPU's name, or the CPU's."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return platform.processor() or platform.machine()


def _chunk_boundaries(length: int, chunk: int) -> list[int]:
    grid = list(range(chunk, length + 1, chunk))
    if len(grid) <= MAX_CHUNK_SNAPSHOTS:
        return grid
    step = len(grid) / MAX_CHUNK_SNAPSHOTS
    return sorted({grid[int((i + 1) * step) - 1] for i in range(MAX_CHUNK_SNAPSHOTS)})


def case_arrays(weights, case: Case, ids: list[int], forms: str = "fast") -> dict[str, np.ndarray]:
    """The golden arrays of one case (``executor.case.run_case``: greedy, every expert choice
    recorded, KDA states at chunk boundaries), as numpy."""
    return {k: to_numpy(v) for k, v in run_case(weights, **golden_run_args(case, ids, forms)).arrays.items()}


def golden_run_args(case: Case, ids: list[int], forms: str = "fast") -> dict:
    """The ``case_steps`` arguments of a golden run of ``case``."""
    image = case.image_input()  # an image case: the tower runs on the case's preprocessed image
    images = None if image is None else (image.patches, [image.grid_thw])
    return dict(ids=ids, positions=case.taps.positions(len(ids)), steps=case.steps,
                snapshot_at=_chunk_boundaries(len(ids), CHUNK), record_routes=True, forms=forms, images=images)


def all_case_arrays(weights, bf16, runnable: list[tuple[Case, list[int]]], forms: str) -> list[dict]:
    """Every runnable case's golden arrays (and BF16 noise), layer-major: all cases' forwards
    share each layer's read (``executor.case.run_cases``); the same arrays as case by case."""
    runs = run_cases(weights, [golden_run_args(c, ids, forms) for c, ids in runnable])
    arrays = [{k: to_numpy(v) for k, v in r.arrays.items()} for r in runs]
    if bf16 is not None:  # the reference's own BF16 noise: free-running replays, teacher-forced passes
        tapped = [a for a, (_, ids) in zip(arrays, runnable) if taps_every_position(a, ids)]
        sampled = [(a, ids) for a, (_, ids) in zip(arrays, runnable) if not taps_every_position(a, ids)]
        runs = [case_steps(bf16, **replay_args(a, ids, forms=forms)) for a, (_, ids) in zip(arrays, runnable)]
        runs += [added_noise_steps(bf16, a) for a in tapped]
        sources = [bf16] * len(runs)
        for a, ids in sampled:  # fed a float32 replay of itself, which runs first at each layer
            runs += sampled_added_noise_steps(bf16, weights, a, ids)
            sources += [weights, bf16]
        done = drive_lockstep(runs, sources)
        for a, r in zip(arrays, done):
            a.update(noise_metrics(a, r.arrays))
        added = done[len(arrays):len(arrays) + len(tapped)] + done[len(arrays) + len(tapped) + 1::2]
        for a, noise in zip(tapped + [a for a, _ in sampled], added):
            a.update(noise)
    return arrays


def taps_every_position(arrays: dict, ids: list[int]) -> bool:
    """Whether a case's goldens tap every prompt position: what a teacher-forced pass is fed."""
    return arrays["positions"].size == len(ids)


def bf16_added_noise(bf16, weights, arrays: dict, ids: list[int]) -> dict[str, np.ndarray]:
    """The reference's own teacher-forced BF16 noise, what added limits widen to: fed the goldens
    where the case taps every position, else fed a replay of the case on the goldens' ``weights``
    at every position, as validate feeds it (``golden.noise.sampled_added_noise``)."""
    if taps_every_position(arrays, ids):
        return added_noise_arrays(bf16, arrays)
    return sampled_added_noise(bf16, weights, arrays, ids)


def _refuse_links(out: Path) -> None:
    if out.is_symlink() or any((out / n).is_symlink() for n in GOLDEN_FILES):
        raise GoldenFileError(f"{out}: a symbolic link where goldens would be written; goldens are never "
                              "written through links: remove it or choose another --out")


def _write_goldens(out: Path, inter: dict, inputs: dict, tolerances: bytes) -> None:
    """Write the three files, each atomically, never through a link; a failure (a full disk) is a
    one-line error. The two npz files carry the same content hash, so a run cut between them is
    refused by ``validate`` as goldens "from different runs", never judged; both record the sha256
    of the tolerance file, written last, so a run cut before it leaves goldens beside another run's
    tolerance file that ``validate`` refuses (``check_tolerance_file``). Temp files a killed run
    left are removed first."""
    _refuse_links(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        remove_temps_of(out, GOLDEN_FILES)
        write_npz(out / GOLDEN_INTERMEDIATES, inter, compress=True)
        write_npz(out / GOLDEN_INPUTS, inputs)
        write_atomic(out / GOLDEN_TOLERANCES, tolerances)
    except OSError as e:
        raise GoldenFileError(f"{out}: cannot write the goldens: {e.strerror or e}; free space and rerun") from None


def generate_goldens(source: str | Path, out: str | Path | None = None, cases_dir: str | Path | None = None,
                     dtype: str = "float32", device: str = "cpu", tolerance: str = "bf16",
                     long_tokens: int | None = None, seed: int = 0, noise: bool = True,
                     progress: Callable[[int, int | None, str], None] | None = None, forms: str = "fast",
                     schedule: str = "auto") -> GoldenResult:
    """Write the golden files for ``source`` (a checkpoint or a bundle directory) into ``out``.

    A bundle's goldens come from its device weights merged over ranks, in high precision: for
    a pass-through bundle these are the source's values bit for bit (``verify`` proves it).
    ``forms`` picks the executor's batched ("fast") or as-written ("readable") forms of the
    same equations (docs/executor.md "Forms"); it is recorded in the goldens' metadata.
    ``schedule`` "case" runs the cases one after another; "layer" runs them together,
    layer-major, so that each layer is read once per pass for all of them (streamed weights:
    one pass instead of one per case); "auto" is "layer" where the weights stream. Both write
    the same bytes.
    """
    if schedule not in ("auto", "case", "layer"):
        raise GoldenFileError(f"schedule must be auto, case or layer, not {schedule!r}")
    source = Path(source)
    weights_kind(source)  # a path that is neither a bundle nor a checkpoint is refused before anything else
    out = Path(out) if out else source / VALIDATION_DIR
    _refuse_links(out)
    torch.manual_seed(seed)
    # goldens are exact float32/float64 arithmetic: no TF32 shortcuts on GPUs (cuBLAS, cuDNN)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cases = load_cases(cases_dir)
    if long_tokens is not None:
        check_long_tokens(long_tokens)
    tol_file = tolerance_path(tolerance)
    load_tolerances(tol_file)  # the file the goldens will carry is checked before any work
    tolerance_bytes = tol_file.read_bytes()  # read once: the bytes written are the bytes whose digest is recorded
    encoding = source_encoding(source)
    weights = open_weights(source, dtype, device, resident=None)  # a checkpoint too big to keep streams
    if weights.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(weights.device)
    if schedule == "auto":
        schedule = "layer" if getattr(weights, "prefetch", False) else "case"
    # the same weights under the bfloat16 policy (validate's built-in device), for the noise run
    bf16 = open_weights(source, "bfloat16", device) if noise else None

    inputs: dict[str, np.ndarray] = {}
    inter: dict[str, np.ndarray] = {}
    summary, seconds = [], {}  # timings stay out of the files: same inputs, same bytes
    built = {c.name: c.build_ids(encoding, long_tokens if c.kind == "long_context" else None)
             for c in cases if c.runnable}
    check_context(cases, built, (load_config(source).raw.get("text_config") or {}).get("max_position_embeddings"),
                  str(source / "config.json"))
    together = {}
    if schedule == "layer" and built:
        if progress:
            progress(0, None, "all cases, layer-major")
        t0 = time.perf_counter()
        runnable = [(c, built[c.name]) for c in cases if c.runnable]
        together = dict(zip(built, all_case_arrays(weights, bf16, runnable, forms)))
        seconds["all"] = round(time.perf_counter() - t0, 3)
    for i, case in enumerate(cases):
        entry = {"name": case.name, "kind": case.kind, "description": case.description,
                 "steps": case.steps, "source": Path(case.source).name}
        if not case.runnable:
            summary.append({**entry, "status": "not run", "reason": case.not_run_reason})
            continue
        if progress and schedule == "case":  # a stage per case run (one that cannot run takes no time)
            progress(i, len(cases), f"case {case.name}")
        ids = built[case.name]
        t0 = time.perf_counter()
        if case.name in together:
            arrays = together[case.name]
        else:
            arrays = case_arrays(weights, case, ids, forms)
            if bf16 is not None:  # the reference's own BF16 noise, what free-running limits widen to
                arrays.update(noise_arrays(bf16, arrays, ids, forms))
                arrays.update(bf16_added_noise(bf16, weights, arrays, ids))
        inputs[f"{case.name}/ids"] = np.asarray(ids, dtype=np.int64)
        inputs[f"{case.name}/greedy_tokens"] = arrays["greedy_tokens"]
        for k in ("media.patches", "media.grid_thws"):  # an image case's vision input (docs/dump-format.md)
            if k in arrays:
                inputs[f"{case.name}/{k}"] = arrays[k]
        for k, v in arrays.items():
            inter[f"{case.name}/{k}"] = v
        if schedule == "case":
            seconds[case.name] = round(time.perf_counter() - t0, 3)
        summary.append({**entry, "status": "ok", "tokens": len(ids),
                        "tapped_positions": int(arrays["positions"].size),
                        "all_positions": bool(case.taps.all or arrays["positions"].size == len(ids))})
    if progress:
        progress(len(cases), len(cases), "")
        progress(len(cases), None, "writing the goldens")

    digest = content_hash(inter)
    meta = {"schema_version": 1, "k3bundle_version": __version__, "seed": seed, "dtype": dtype,
            "device": str(weights.device), "device_name": _device_name(weights.device),
            "torch_version": torch.__version__, "tolerance": tol_file.name, "content_hash": digest,
            "cases": summary, "source": str(source.resolve()), "chunk": CHUNK, "forms": forms,
            "weights_manifest_sha256": manifest_digest(source),
            "tolerances_sha256": hashlib.sha256(tolerance_bytes).hexdigest()}
    for name in sorted(inter):  # a NaN golden would make every device "fail": refuse to write it
        a = inter[name]
        if a.dtype.kind == "f" and not np.isfinite(a).all():
            raise GoldenFileError(f"{source}: the forward gave NaN/Inf in {name!r}; check the checkpoint's "
                                  "weights and config")
    inter["__meta__"] = meta_array(meta)
    inputs["__meta__"] = meta_array(meta)
    _write_goldens(out, inter, inputs, tolerance_bytes)
    timed = [{**c, "seconds": seconds[c["name"]]} if c["name"] in seconds else c for c in summary]
    if "all" in seconds:  # layer-major: one time for every case together
        timed = [{**c, "seconds_all_cases": seconds["all"]} if c.get("status") == "ok" else c for c in timed]
    return GoldenResult(out, timed, digest, (out / GOLDEN_INTERMEDIATES).stat().st_size,
                        _peak_bytes(weights.device), "streamed" if getattr(weights, "prefetch", False) else "resident")
