"""Write `k3bundle validate --dumps` files for every golden case, with numpy and zstandard only.

    python write_dumps.py BUNDLE/validation DUMPS [--scale TAP=FACTOR]

The format is docs/dump-format.md. `run_runtime` is the one function a runtime replaces: here
it stands in for a correct runtime by returning the goldens' own values, which the writer then
rounds to BF16, as a BF16 runtime stores them. `--scale layers.5.mixer_out=1.01` multiplies one
tap by a factor: a planted fault, which validate locates to that layer and tap.
"""

from __future__ import annotations

import io
import json
import struct
import sys
from pathlib import Path

import numpy as np
import zstandard


def read_golden(path: Path) -> dict[str, np.ndarray]:
    """A golden npz: golden_inputs.npz is a plain npz, golden_intermediates.npz one zstd frame
    around an npz. Either way it holds numbers only (allow_pickle=False)."""
    data = path.read_bytes()
    if data[:4] == b"\x28\xb5\x2f\xfd":  # the zstd magic
        data = zstandard.ZstdDecompressor().decompress(data)
    with np.load(io.BytesIO(data), allow_pickle=False) as z:
        return {name: z[name] for name in z.files}


def cases_that_ran(inputs: dict[str, np.ndarray]) -> list[str]:
    """The case names whose goldens were computed (``__meta__`` is JSON stored as uint8 bytes)."""
    meta = json.loads(bytes(inputs["__meta__"]).decode())
    return [c["name"] for c in meta["cases"] if c.get("status") == "ok"]


def required_taps(num_layers: int) -> list[str]:
    """What every dump must carry (docs/dump-format.md, "Taps": required = yes)."""
    per_layer = [f"layers.{l}.{kind}" for l in range(num_layers) for kind in ("mixer_out", "ffn_out")]
    return per_layer + ["final_hidden", "logits"]


def run_runtime(case: str, ids: np.ndarray, positions: np.ndarray, golden: dict[str, np.ndarray],
                names: list[str]) -> dict[str, np.ndarray]:
    """Your runtime goes here: prefill ``ids`` once (teacher-forced) and return each tap in
    ``names`` at the prompt ``positions``, rows in that order ([P, ...] float arrays).

    This stand-in is a correct runtime: it returns the goldens' values of the case."""
    return {name: golden[f"{case}/{name}"] for name in names}


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> BF16 bit patterns (uint16), rounded to nearest even; numpy has no bfloat16."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def write_safetensors_bf16(path: Path, tensors: dict[str, np.ndarray], ints: dict[str, np.ndarray] | None = None) -> None:
    """The safetensors layout written directly (BF16 has no numpy dtype): an 8-byte little-endian
    header length, the JSON header, then each tensor's raw little-endian bytes. For F16 or F32
    dumps ``safetensors.numpy.save_file`` does the same. ``ints``: integer tensors, stored as I64."""
    header, blobs, offset = {}, [], 0
    entries = [(n, "BF16", bf16_bits(x)) for n, x in tensors.items()]
    entries += [(n, "I64", np.ascontiguousarray(x, dtype="<i8")) for n, x in (ints or {}).items()]
    for name, dtype, x in entries:
        raw = x.tobytes()
        header[name] = {"dtype": dtype, "shape": list(x.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(struct.pack("<Q", len(head)) + head + b"".join(blobs))
    tmp.replace(path)  # a file either complete or absent


def write_dumps(validation: Path, out: Path, scale: tuple[str, float] | None = None) -> list[Path]:
    inputs = read_golden(validation / "golden_inputs.npz")
    golden = read_golden(validation / "golden_intermediates.npz")
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for case in cases_that_ran(inputs):
        ids, positions = inputs[f"{case}/ids"], golden[f"{case}/positions"]
        num_layers = 1 + max(int(k.split(".")[1]) for k in golden
                             if k.startswith(f"{case}/layers.") and k.endswith(".mixer_out"))
        taps = run_runtime(case, ids, positions, golden, required_taps(num_layers))
        if scale is not None and scale[0] in taps:
            taps[scale[0]] = taps[scale[0]] * np.float32(scale[1])
        path = out / f"{case}.safetensors"
        write_safetensors_bf16(path, taps)
        written.append(path)
    return written


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 4) or (len(argv) == 4 and argv[2] != "--scale"):
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    scale = None
    if len(argv) == 4:
        tap, _, factor = argv[3].partition("=")
        scale = (tap, float(factor))
    for path in write_dumps(Path(argv[0]), Path(argv[1]), scale):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
