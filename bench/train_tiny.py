"""Train ``synth --preset tiny-trained``: the tiny Kimi K3 with the executor's own forward.

    python bench/train_tiny.py --data .train-data/corpus.safetensors --corpus-only   # the corpus
    python bench/train_tiny.py --data .train-data/corpus.safetensors --out OUT --device cuda --minutes 8
    python bench/train_tiny.py --data /tmp/c.safetensors --out /tmp/t --steps 3 --no-ship   # smoke

What it does, in order (every choice fixed by ``--seed``; the corpus is what every Python
install has offline):

1. **Corpus.** Three token streams, encoded with the synthetic tokenizer (768 BPE ranks +
   256 specials, ``k3bundle.synth.tokenizer``):
   - English: the tokenizer's own corpus (``k3bundle/data/tokenizer_corpus.txt``, model
     conversion and serving prose, the domain of the golden cases' prompts);
   - Python: the standard library's ``.py`` files (sorted, tests and vendored packages left
     out), every 20th file held out;
   - chat: conversations made from consecutive English sentences and from tool-call
     templates, rendered with the XTML chat renderer (``k3bundle.chat.render``), so the
     special tokens and the think/response/tool structure of every golden case are seen.
2. **Model.** Every text tensor starts from synth's rules for seed 0 drawn with the former
   torch generator (``logical_values(..., TorchDraw)``: the shipped model was trained from it)
   as a float32 parameter; routed experts are
   float32 master weights. The forward is ``k3bundle.executor.Executor`` under the float32
   policy, through ``TrainWeights`` (a ``WeightSource`` whose tensors are the parameters), so
   the trained function is exactly the one the executor evaluates; autograd does the rest.
3. **Router bias.** The selection bias (R2) gets no gradient (it does not enter the weights,
   R3); after each step it moves as in auxiliary-loss-free load balancing: every expert's
   bias by ``--bias-rate`` toward the mean load (up if under-loaded, down if over-loaded).
4. **MXFP4.** For the last ``--qat`` fraction of steps the routed experts run fake-quantized
   (MXFP4 FLOOR rule, straight-through gradient), so the shipped, quantized model is the one
   that was trained.
5. **Save.** The text model's tensors as the release stores them (BF16, F32, MXFP4 pairs)
   in one safetensors file, zstd level 19 → ``k3bundle/data/trained/`` (with ``--ship``),
   plus ``train_log.json`` (loss curve, held-out loss, wall time, versions) in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import re
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from k3bundle.executor import Executor  # noqa: E402
from k3bundle.executor.weights import POLICIES, LayerWeights, WeightSource  # noqa: E402
from k3bundle.formats import mxfp4  # noqa: E402
from k3bundle.presets import preset_config  # noqa: E402
from k3bundle.schema import Format, Schema, Section  # noqa: E402
from k3bundle.synth.tokenizer import load_corpus, write_tokenizer  # noqa: E402
from k3bundle.synth.weights import TorchDraw, logical_values, stored_form  # noqa: E402
from k3bundle.tokenizer import load_tiktoken  # noqa: E402

PRESET = "tiny-trained"
SHIP = REPO / "k3bundle" / "data" / "trained" / "tiny-trained.safetensors.zst"


# ---------------------------------------------------------------- corpus
def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = re.compile(r"(^|/)(test|tests|idle_test|site-packages|lib2to3|ensurepip|_vendor)(/|$)")
    return sorted(p for p in root.rglob("*.py") if not skip.search(p.relative_to(root).as_posix()))


def sentences(text: str) -> list[str]:
    flat = re.sub(r"\s+", " ", text)
    return [s.strip() for s in re.split(r"(?<=[.!?])\s+", flat) if len(s.strip()) > 20]


TOOLS = [{"type": "function", "function": {
    "name": "get_gpu_memory", "description": "Report free memory on one accelerator.",
    "parameters": {"type": "object", "properties": {
        "device": {"type": "integer", "description": "device index"},
        "unit": {"type": "string", "enum": ["GiB", "MiB"]}}, "required": ["device"]}}}]


def chats(sents: list[str], rng: random.Random) -> list[dict]:
    """Conversations from consecutive sentences, plus tool-call templates (render kwargs)."""
    out = []
    for i in range(len(sents) - 3):
        u, r, a, u2 = sents[i:i + 4]
        thinking = rng.random() < 0.7
        msgs = [{"role": "user", "content": u}, {"role": "assistant", "reasoning_content": r, "content": a}]
        if rng.random() < 0.4:
            msgs += [{"role": "user", "content": u2},
                     {"role": "assistant", "reasoning_content": a, "content": sents[(i + 4) % len(sents)]}]
        out.append({"messages": msgs, "thinking": thinking,
                    "thinking_effort": rng.choice(["low", "medium", "high", "max"])})
    for _ in range(len(sents) // 4):
        dev, unit = rng.randrange(8), rng.choice(["GiB", "MiB"])
        free, total = round(rng.uniform(1, 140), 1), 141.0
        msgs = [{"role": "user", "content": f"How much memory is free on GPU {dev}, in {unit}?"},
                {"role": "assistant", "reasoning_content": f"I should ask the tool for device {dev}.",
                 "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
                     "name": "get_gpu_memory", "arguments": json.dumps({"device": dev, "unit": unit})}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": json.dumps({"free": free, "total": total})},
                {"role": "assistant", "reasoning_content": "The tool answered.",
                 "content": f"GPU {dev} has {free} {unit} free of {total}."}]
        out.append({"messages": msgs, "tools": TOOLS, "thinking": True, "thinking_effort": "high"})
    return out


def build_corpus(enc, rng: random.Random, python_bytes: int) -> dict[str, dict[str, list[int]]]:
    from k3bundle.chat.render import render_ids
    english = load_corpus()
    sents = sentences(english)
    eos = enc.encode("<|end_of_msg|>", allowed_special="all")
    streams = {"train": {}, "heldout": {}}
    cut = int(len(english) * 0.9)
    streams["train"]["english"] = enc.encode(english[:cut], disallowed_special=())
    streams["heldout"]["english"] = enc.encode(english[cut:], disallowed_special=())
    train_py, held_py, used = [], [], 0
    for i, p in enumerate(stdlib_files()):
        if used >= python_bytes:
            break
        text = p.read_text(encoding="utf-8", errors="replace")
        ids = enc.encode(text, disallowed_special=()) + eos
        (held_py if i % 20 == 19 else train_py).extend(ids)
        used += len(text)
    streams["train"]["python"], streams["heldout"]["python"] = train_py, held_py
    convs = chats(sents, rng)
    rng.shuffle(convs)
    chat_ids = [render_ids(c.pop("messages"), enc, add_generation_prompt=False, **c) + eos for c in convs]
    n_held = max(1, len(chat_ids) // 10)
    streams["train"]["chat"] = [i for c in chat_ids[n_held:] for i in c]
    streams["heldout"]["chat"] = [i for c in chat_ids[:n_held] for i in c]
    return streams


MIX = {"python": 0.6, "english": 0.1, "chat": 0.3}


def save_corpus(path: Path, streams: dict) -> None:
    from safetensors.torch import save_file
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({f"{s}.{k}": torch.tensor(v, dtype=torch.int16) for s, d in streams.items() for k, v in d.items()},
              str(path), metadata={"python": platform.python_version(), "stdlib": sysconfig.get_paths()["stdlib"]})


def load_corpus_file(path: Path) -> dict[str, dict[str, list[int]]]:
    from safetensors.torch import load_file
    streams: dict[str, dict[str, list[int]]] = {"train": {}, "heldout": {}}
    for key, t in load_file(str(path)).items():
        split, kind = key.split(".")
        streams[split][kind] = t.to(torch.long).tolist()
    return streams


def sample_windows(stream: dict[str, list[int]], n: int, T: int, rng: random.Random) -> list[torch.Tensor]:
    out = []
    for _ in range(n):
        kind = rng.choices(list(MIX), weights=list(MIX.values()))[0]
        ids = stream[kind]
        s = rng.randrange(0, len(ids) - T - 1)
        out.append(torch.tensor(ids[s:s + T + 1]))
    return out


def fixed_windows(ids: list[int], T: int, limit: int) -> list[torch.Tensor]:
    return [torch.tensor(ids[s:s + T + 1]) for s in range(0, len(ids) - T - 1, T)][:limit]


# ---------------------------------------------------------------- model
def fake_mxfp4(w: torch.Tensor, block: int) -> torch.Tensor:
    """MXFP4 round trip in the forward, identity in the backward (straight-through)."""
    with torch.no_grad():
        packed, scale = mxfp4.quantize(w, scale_rule="floor")
        q = mxfp4.dequantize(packed, scale, torch.float32, block=block)
    return w + (q - w).detach()


class TrainWeights(WeightSource):
    """The executor's weights as trainable float32 tensors (one per logical tensor)."""

    def __init__(self, schema: Schema, seed: int, device: str = "cpu"):
        self.config, self.schema = schema.config, schema
        self.policy, self.device = POLICIES["float32"], torch.device(device)
        self.params: dict[tuple[str, int | None, int | None], torch.Tensor] = {}
        experts: dict[tuple[str, int], list[torch.Tensor]] = {}
        for spec in schema.tensors():
            if spec.role.section is not Section.TEXT or spec.part == "scale":
                continue
            t = logical_values(schema, spec, seed, TorchDraw)
            if spec.expert is not None:  # one stacked [E, out, in] tensor per layer and role
                experts.setdefault((spec.role.role, spec.layer), []).append(t)
                continue
            t = t.to(self.device).requires_grad_(spec.role.role != "moe.router_bias")  # R2: no gradient
            self.params[(spec.role.role, spec.layer, None)] = t
        for (role, layer), ts in experts.items():
            self.params[(role, layer, None)] = torch.stack(ts).to(self.device).requires_grad_()
        self.fake_quant = False
        self.loads: dict[int, torch.Tensor] = {}

    def trainable(self) -> list[torch.Tensor]:
        return [p for p in self.params.values() if p.requires_grad]

    def layer(self, layer: int, decode: bool = False) -> LayerWeights:
        roles = [r.role for r in self.schema.layer_roles(layer) if r.fmt is not Format.MXFP4]
        tensors = {r: self.params[(r, layer, None)] for r in roles}
        block = self.config.text.mxfp4_group

        if not self.config.text.is_moe(layer):
            return LayerWeights(layer, tensors)
        stacks = {}
        for role in ("moe.expert.w1", "moe.expert.w2", "moe.expert.w3"):
            w = self.params[(role, layer, None)]  # [E, out, in]; quantized once per layer call
            stacks[role] = fake_mxfp4(w, block) if self.fake_quant else w
        return LayerWeights(layer, tensors, lambda e: {role: w[e] for role, w in stacks.items()})

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.params[("embed", None, None)][ids]

    def global_tensor(self, role: str) -> torch.Tensor:
        return self.params[(role, None, None)]


class LoadCounter:
    """A tap recorder that only counts, per MoE layer, how many tokens chose each expert."""

    def __init__(self, experts: int):
        self.experts, self.counts = experts, {}

    def record(self, name: str, value: torch.Tensor, start: int) -> None:
        if name.endswith(".router_ids"):
            layer = int(name.split(".")[1])
            c = torch.bincount(value.reshape(-1), minlength=self.experts).float()
            self.counts[layer] = self.counts.get(layer, 0) + c

    def record_state(self, name, value) -> None:
        pass


def loss_of(ex: Executor, window: torch.Tensor) -> torch.Tensor:
    window = window.to(ex.w.device)
    logits, _ = ex.prefill(window[:-1])
    return F.cross_entropy(logits, window[1:])


def evaluate(ex: Executor, windows: list[torch.Tensor]) -> float:
    with torch.no_grad():
        return sum(float(loss_of(ex, w)) for w in windows) / len(windows)


# ---------------------------------------------------------------- save
def stored_tensors(w: TrainWeights) -> dict[str, torch.Tensor]:
    """Every text tensor as the release stores it (synth's one rule, ``stored_form``)."""
    out = {}
    for spec in w.schema.tensors():
        if spec.role.section is not Section.TEXT or spec.name in out:
            continue
        v = w.params[(spec.role.role, spec.layer, None)].detach().float().cpu()
        out.update(stored_form(spec, v if spec.expert is None else v[spec.expert]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", type=Path, required=True, help="corpus file (built here if missing)")
    ap.add_argument("--corpus-only", action="store_true", help="build --data and stop")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--minutes", type=float, help="set --steps from the speed of the first 5 steps")
    ap.add_argument("--batch", type=int, default=16, help="sequences per step")
    ap.add_argument("--seq", type=int, default=512, help="tokens per sequence")
    ap.add_argument("--eval-seq", type=int, default=512, help="tokens per held-out window (8 per stream)")
    ap.add_argument("--chunk", type=int, default=64, help="KDA chunk (the chunked form is exact for any)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=60)
    ap.add_argument("--bias-rate", type=float, default=1e-3)
    ap.add_argument("--qat", type=float, default=0.2, help="fraction of steps run with MXFP4 experts")
    ap.add_argument("--python-bytes", type=int, default=12_000_000)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ship", action=argparse.BooleanOptionalAction, default=True)
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    config = preset_config(PRESET)
    schema = Schema(config)
    t0 = time.monotonic()
    if not args.data.exists():
        import tempfile
        with tempfile.TemporaryDirectory() as tok_dir:
            write_tokenizer(Path(tok_dir), config.text.vocab_size)
            save_corpus(args.data, build_corpus(load_tiktoken(tok_dir), rng, args.python_bytes))
    streams = load_corpus_file(args.data)
    sizes = {s: {k: len(v) for k, v in d.items()} for s, d in streams.items()}
    print(f"corpus tokens {sizes} ({time.monotonic() - t0:.0f} s)", flush=True)
    if args.corpus_only:
        return
    args.out.mkdir(parents=True, exist_ok=True)
    held = [w for k in MIX for w in fixed_windows(streams["heldout"][k], args.eval_seq, 8)]

    w = TrainWeights(schema, seed=0, device=args.device)
    counter = LoadCounter(config.text.num_experts)
    ex = Executor(w, taps=[counter], chunk=args.chunk)
    params = w.trainable()
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    qat_from = int(args.steps * (1 - args.qat))
    log = {"preset": PRESET, "seed": args.seed, "args": {k: str(v) for k, v in vars(args).items()},
           "python": platform.python_version(), "torch": torch.__version__, "threads": torch.get_num_threads(),
           "device": torch.cuda.get_device_name() if w.device.type == "cuda" else platform.processor() or "cpu",
           "corpus_tokens": sizes, "curve": [], "heldout": []}
    log["heldout"].append({"step": 0, "loss": evaluate(ex, held)})
    print(f"step 0 held-out {log['heldout'][-1]['loss']:.3f}", flush=True)
    t_train = time.monotonic()
    step = 0
    while step < args.steps:
        step += 1
        lr = args.lr * min(1.0, step / args.warmup) * \
            (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, step / args.steps))))
        for g in opt.param_groups:
            g["lr"] = lr
        w.fake_quant = step > qat_from
        counter.counts = {}
        total = 0.0
        for win in sample_windows(streams["train"], args.batch, args.seq, rng):
            loss = loss_of(ex, win) / args.batch
            loss.backward()
            total += loss.item()
        gnorm = float(torch.nn.utils.clip_grad_norm_(params, 1.0))
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():  # auxiliary-loss-free balancing of the selection bias (R2)
            for layer, c in counter.counts.items():
                bias = w.params[("moe.router_bias", layer, None)]
                bias += args.bias_rate * torch.sign(c.mean() - c)
        log["curve"].append({"step": step, "loss": round(total, 4), "lr": lr, "grad_norm": round(gnorm, 3),
                             "seconds": round(time.monotonic() - t_train, 1)})
        if step == 1:
            t_first = time.monotonic()
        if args.minutes and step == 6:  # fit the schedule to the time budget (logged); QAT is slower
            rate = (time.monotonic() - t_first) / 5
            args.steps = max(10, int(0.85 * args.minutes * 60 / rate))
            log["steps"] = args.steps
            qat_from = int(args.steps * (1 - args.qat))
            print(f"{args.steps} steps fit in {args.minutes} min", flush=True)
        if step % 10 == 0:
            print(f"step {step} loss {total:.3f} lr {lr:.2e} |g| {gnorm:.2f} "
                  f"{time.monotonic() - t_train:.0f} s", flush=True)
        if step % args.eval_every == 0 or step == args.steps:
            log["heldout"].append({"step": step, "loss": evaluate(ex, held), "mxfp4": w.fake_quant})
            print(f"step {step} held-out {log['heldout'][-1]['loss']:.3f}", flush=True)
            (args.out / "train_log.json").write_text(json.dumps(log, indent=1))
        if args.minutes and time.monotonic() - t_train > 1.1 * args.minutes * 60:
            log["stopped_early_at"] = step  # the wall-clock guard: save what there is
            print(f"time budget spent: stopping at step {step}", flush=True)
            break
    log["train_seconds"] = round(time.monotonic() - t_train, 1)
    w.fake_quant = False
    log["heldout_float_experts"] = evaluate(ex, held)
    w.fake_quant = True
    log["heldout_mxfp4_experts"] = evaluate(ex, held)
    print(f"held-out: float experts {log['heldout_float_experts']:.4f}, "
          f"MXFP4 experts {log['heldout_mxfp4_experts']:.4f}", flush=True)

    from safetensors.torch import save_file
    raw = args.out / "tiny-trained.safetensors"
    save_file(stored_tensors(w), str(raw), metadata={"format": "pt", "preset": PRESET})
    import zstandard
    blob = zstandard.ZstdCompressor(level=19).compress(raw.read_bytes())
    (args.out / SHIP.name).write_bytes(blob)
    log["shipped_bytes"] = len(blob)
    (args.out / "train_log.json").write_text(json.dumps(log, indent=1))
    if args.ship:
        SHIP.parent.mkdir(parents=True, exist_ok=True)
        SHIP.write_bytes(blob)
    print(f"wrote {raw} and {SHIP.name} ({len(blob) / 1e6:.1f} MB compressed)", flush=True)


if __name__ == "__main__":
    main()
