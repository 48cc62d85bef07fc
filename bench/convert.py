"""Benchmark ``k3bundle convert`` against ``cp -r`` of the same source, in the same run.

For each synthetic checkpoint (``small``, ~1 GB, and ``big``, ``small`` with 7x the routed
experts, ~4.7 GB) and each repetition, on the same file system:

  1. ``cp -r SRC DST && sync``                      -> t_cp
  2. ``k3bundle convert SRC --target T --out OUT --workers W --json && sync`` under
     ``/usr/bin/time -v``                            -> t_convert, peak RSS, the convert's own seconds

With ``--cold`` the page cache is dropped (``echo 3 > /proc/sys/vm/drop_caches``, root only)
before each step, so both read the source from disk. Reported: medians, source GB/s
(source bytes / time), the ratio t_cp / t_convert (1.0 = as fast as cp) and the peak RSS of the
largest process (``/usr/bin/time`` reports the maximum over the process and its workers).
Convert hashes every source byte (sha256, checked against source.json when present) and every
output byte (for the manifest); cp hashes nothing.

Usage:
    python bench/convert.py --workdir /tmp/k3bench [--target h200-tp16-ep16] [--workers 2]
                            [--repeats 3] [--cold] [--sizes small,big] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BIG_PRESET = """\
# bench-only preset: "small" with 7x the routed experts (~4.7 GB), for the RSS-vs-size check
description: "small with 448 routed experts"
text_config:
  vocab_size: 1024
  hidden_size: 1024
  num_hidden_layers: 13
  num_attention_heads: 16
  num_key_value_heads: 16
  q_lora_rank: 256
  kv_lora_rank: 128
  qk_nope_head_dim: 64
  qk_rope_head_dim: 32
  v_head_dim: 64
  intermediate_size: 2048
  num_experts: 448
  num_experts_per_token: 4
  moe_intermediate_size: 1024
  routed_expert_hidden_size: 512
  attn_res_block_size: 4
  max_position_embeddings: 131072
  linear_attn_config:
    num_heads: 16
    head_dim: 64
vision_config:
  vt_hidden_size: 64
  vt_intermediate_size: 128
  vt_num_hidden_layers: 2
  vt_num_attention_heads: 2
  qkv_hidden_size: 96
  init_pos_emb_height: 8
  init_pos_emb_width: 8
  mm_hidden_size: 64
  text_hidden_size: 1024
"""

K3BUNDLE = [sys.executable, "-m", "k3bundle"]


def _sync() -> None:
    os.sync()


def _drop_caches() -> bool:
    _sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def _dir_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file())


def make_source(workdir: Path, size: str) -> Path:
    """Generate (once) the synthetic checkpoint for ``size``."""
    out = workdir / f"src-{size}"
    if (out / "model.safetensors.index.json").exists():
        return out
    import torch

    from k3bundle import presets
    from k3bundle.synth import write_synthetic

    torch.set_num_threads(1)  # 4x faster on a 2-core VM than OpenMP's 2 threads
    preset = "small"
    if size == "big":
        pdir = workdir / "presets"
        pdir.mkdir(parents=True, exist_ok=True)
        (pdir / "bench-big.yaml").write_text(BIG_PRESET)
        presets.PRESET_DIR = pdir  # bench-only preset, outside the package's preset directory
        preset = "bench-big"
    t = time.monotonic()
    write_synthetic(out, preset=preset, seed=0, force=True)
    print(f"generated {out} ({_dir_bytes(out) / 1e9:.2f} GB) in {time.monotonic() - t:.0f} s", file=sys.stderr)
    return out


def _timed(cmd: list[str], cold: bool) -> tuple[float, str]:
    if cold:
        _drop_caches()
    else:
        _sync()
    t = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True)
    _sync()
    dt = time.monotonic() - t
    if p.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stderr[-2000:]}")
    return dt, p.stdout + p.stderr


def _max_rss_kb(time_v_output: str) -> int:
    for line in time_v_output.splitlines():
        if "Maximum resident set size" in line:
            return int(line.rsplit(":", 1)[1])
    return -1


def bench_one(src: Path, scratch: Path, target: str, workers: int, repeats: int, cold: bool) -> dict:
    src_bytes = _dir_bytes(src)
    rows = []
    for _ in range(repeats):
        dst = scratch / "cp"
        t_cp, _ = _timed(["cp", "-r", str(src), str(dst)], cold)
        shutil.rmtree(dst)
        out = scratch / "bundle"
        cmd = ["/usr/bin/time", "-v", *K3BUNDLE, "convert", str(src), "--target", target, "--out", str(out),
               "--workers", str(workers), "--json"]
        t_cv, text = _timed(cmd, cold)
        own = json.loads(text[text.index("{"): text.rindex("}") + 1])
        rows.append({"cp_s": t_cp, "convert_s": t_cv, "convert_own_s": own["seconds"],
                     "bundle_bytes": own["bundle_bytes"], "max_rss_kb": _max_rss_kb(text)})
        shutil.rmtree(out)
    med = {k: statistics.median(r[k] for r in rows) for k in ("cp_s", "convert_s", "convert_own_s")}
    return {
        "source": str(src), "source_bytes": src_bytes, "bundle_bytes": rows[0]["bundle_bytes"],
        "target": target, "workers": workers, "cold": cold, "repeats": repeats,
        "cp_s": round(med["cp_s"], 3), "convert_s": round(med["convert_s"], 3),
        "convert_own_s": round(med["convert_own_s"], 3),
        "cp_gb_s": round(src_bytes / med["cp_s"] / 1e9, 3),
        "convert_gb_s": round(src_bytes / med["convert_s"] / 1e9, 3),
        "convert_own_gb_s": round(src_bytes / med["convert_own_s"] / 1e9, 3),
        "ratio_vs_cp": round(med["cp_s"] / med["convert_s"], 3),
        "ratio_vs_cp_own": round(med["cp_s"] / med["convert_own_s"], 3),
        "max_rss_mb": round(max(r["max_rss_kb"] for r in rows) / 1024, 1),
        "load_avg_1m_after": round(os.getloadavg()[0], 2),
        "runs": rows,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "k3bench")
    ap.add_argument("--target", default="h200-tp16-ep16")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sizes", default="small,big")
    ap.add_argument("--cold", action="store_true", help="drop the page cache before every step (root)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    if not Path("/usr/bin/time").exists():
        raise SystemExit("/usr/bin/time is missing (apt-get install -y time)")
    if args.cold and not _drop_caches():
        raise SystemExit("--cold needs permission to write /proc/sys/vm/drop_caches")
    args.workdir.mkdir(parents=True, exist_ok=True)
    results = []
    for size in args.sizes.split(","):
        src = make_source(args.workdir, size).resolve()
        scratch = args.workdir / "scratch"
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir()
        r = bench_one(src, scratch, args.target, args.workers, args.repeats, args.cold)
        r["size"] = size
        results.append(r)
        print(f"{size:5s} {r['source_bytes'] / 1e9:5.2f} GB -> {r['bundle_bytes'] / 1e9:5.2f} GB  "
              f"cp {r['cp_s']:6.2f} s ({r['cp_gb_s']:.2f} GB/s)  convert {r['convert_s']:6.2f} s "
              f"({r['convert_gb_s']:.2f} GB/s; {r['convert_own_s']:.2f} s without interpreter start)  "
              f"ratio {r['ratio_vs_cp']:.2f} ({r['ratio_vs_cp_own']:.2f})  peak RSS {r['max_rss_mb']:.0f} MB  "
              f"(load avg {r['load_avg_1m_after']})",
              flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
