"""Write `k3bundle validate --dumps` files that also carry the runtime's own serving paths, with
numpy and zstandard only (docs/dump-format.md "Serving paths").

    python write_serving_dumps.py BUNDLE/validation DUMPS

Each case file holds the runtime's uninterrupted run (the required taps and `step_logits`) and,
beside it, what the runtime computed for the same request along each serving path, as
`serving.PATH.TAP`. `run_path` is the one function a runtime replaces: here it stands in for a
correct runtime by returning the goldens' own values, so every path equals the uninterrupted run.
Uses write_dumps.py (same folder) for reading the goldens and writing BF16 safetensors.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from write_dumps import cases_that_ran, read_golden, required_taps, write_safetensors_bf16  # noqa: E402

CHUNK = 64  # the KDA chunk: a prefix cache keeps states only at chunk boundaries


def run_path(case: str, path: str, at: int | None, golden: dict[str, np.ndarray],
             names: list[str]) -> dict[str, np.ndarray]:
    """Your runtime goes here: run the case's request along ``path`` and return ``names``.

    - ``resume_chunk`` / ``resume_turn``: restore the prefix cache of the first ``at`` prompt
      tokens, prefill the rest, decode the golden tokens; prompt taps only at the tapped
      positions from ``at`` on;
    - ``handoff``: prefill, move the cache to the decoder, decode there (``step_logits`` only);
    - ``batching``: the request in one batch with other requests (here: every case's prompt).

    This stand-in is a correct runtime: the goldens' values of the case."""
    positions = golden[f"{case}/positions"]
    keep = slice(None) if at is None else positions >= at
    return {n: golden[f"{case}/{n}"] if n == "step_logits" else golden[f"{case}/{n}"][keep] for n in names}


def write_serving_dumps(validation: Path, out: Path) -> list[Path]:
    inputs = read_golden(validation / "golden_inputs.npz")
    golden = read_golden(validation / "golden_intermediates.npz")
    out.mkdir(parents=True, exist_ok=True)
    cases = cases_that_ran(inputs)
    lengths = np.array([inputs[f"{c}/ids"].size for c in cases], dtype=np.int64)  # the batch: every prompt
    written = []
    for case in cases:
        T = int(inputs[f"{case}/ids"].size)
        num_layers = 1 + max(int(k.split(".")[1]) for k in golden
                             if k.startswith(f"{case}/layers.") and k.endswith(".mixer_out"))
        prompt = required_taps(num_layers)
        tensors = {n: golden[f"{case}/{n}"] for n in prompt + ["step_logits"]}  # the uninterrupted run
        ints = {}
        resumes = {"resume_chunk": (T - 1) // CHUNK * CHUNK, "resume_turn": T * 3 // 4}  # where it resumed
        for path, at in [*resumes.items(), ("handoff", None), ("batching", None)]:
            if at == 0:
                continue  # a prompt within one chunk has no chunk boundary to resume at
            names = ["step_logits"] if path == "handoff" else prompt + ["step_logits"]
            tensors.update({f"serving.{path}.{n}": v for n, v in run_path(case, path, at, golden, names).items()})
            if at is not None:
                ints[f"serving.{path}.at"] = np.array([at], dtype=np.int64)
        ints["serving.batching.lengths"] = lengths
        path = out / f"{case}.safetensors"
        write_safetensors_bf16(path, tensors, ints)
        written.append(path)
    return written


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[3].strip(), file=sys.stderr)
        return 2
    for path in write_serving_dumps(Path(argv[0]), Path(argv[1])):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
