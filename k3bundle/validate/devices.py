"""The devices under test, behind one interface: per case, the candidate's taps and the
teacher-forced layer outputs. ``validate.run.validate`` only loops over cases and judges.

- ``InProcess``: the built-in executor on a bundle's device weights (every rank merged) or on
  a source checkpoint, in this process, in the BF16 device policy.
- ``Distributed`` (``distributed.py``): one ``torch.distributed`` process per TP/EP rank, each
  running the same ``run_case`` and ``teacher_forced`` on its own shard.
- ``Dumps``: intermediates an external runtime dumped (docs/dump-format.md); its layer outputs
  are k3bundle's emulation of each layer in the dump's precision, fed the dump's own inputs.

All three run the executor's one case runner (``executor.case.run_case``) or read what an
external runtime wrote; none has a layer loop of its own.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from k3bundle.executor import Executor
from k3bundle.executor.case import replay_case
from k3bundle.executor.taps import tap_kind
from k3bundle.file_names import GOLDEN_INPUTS
from k3bundle.golden.store import as_tensor
from k3bundle.validate.dump_serving import DumpServing
from k3bundle.validate.dumps import check_dumps, read_dump
from k3bundle.validate.recompute import EXACT, recomputed_layer_checks  # EXACT: outputs judged to the float32 floor

DEVICE_POLICY = "bfloat16"  # the built-in device emulates a serving engine's dtypes
EXACT_POLICY = "float32"  # ... and, for the exact check, runs in the goldens' precision
EXACT_SAME, EXACT_GPU = "exact", "exact_gpu"  # tolerance sections: CPU against CPU goldens, a GPU on either side


@dataclass
class CaseOutput:
    """What a device produced for one golden case."""

    cand: dict[str, torch.Tensor]  # free-running taps and steps, named like the golden's
    layers: dict[str, torch.Tensor] | None  # teacher-forced layer outputs; None = not computed
    layer_mode: str  # "added" (fed the goldens) or "emulation" (fed a dump's own outputs)
    layer_ref: Callable[[str], object]  # what the layer outputs are compared with
    routes_replayed: bool  # the candidate replayed the golden expert choices
    skipped: str = ""  # why the layer checks did not run
    exact_section: str = EXACT_SAME  # the tolerance section ``exact.…`` outputs are judged by
    # the serving paths' runs (``validate.serving.ServingRun``, or a dump's ``dump_serving.DumpServing``),
    # judged by their ``judge(case, tol)``; None: not run
    serving: object | None = None


def full_positions(golden: dict, ids: np.ndarray) -> bool:
    """Teacher-forced layer checks need every position (a layer's input depends on all of them)."""
    return int(golden["positions"].size) == int(ids.size)


def device_arrays(weights, golden: dict, ids: np.ndarray, after_step=None,
                  exact_weights=None, reference_weights=None) -> tuple[dict, dict | None]:
    """The built-in device on one case: the golden run replayed (golden routes, decode fed the
    golden tokens) and every layer fed the reference's inputs, at the prompt and at each decode
    step. ``after_step``: the device's cache handling between decode steps
    (``executor.case.run_case``), in every run.

    With every position tapped the goldens are the feed, and ``exact_weights`` (the same weights
    in the goldens' precision) runs the teacher-forced pass once more, its outputs named
    ``exact.…``. On the weights the goldens were made from, that run reproduces them to the
    float32 floor, so any difference in the weights or the cache — a byte, a scale, a shard, a
    row — is seen far below the BF16 noise (the *exact* check).

    With sampled positions the feed is recomputed (``recompute.recomputed_layer_checks``) on
    ``reference_weights`` (the goldens' own weights in float32; without them, no layer checks).
    """
    run = replay_case(weights, golden, ids.tolist(), after_step)
    layers = None
    if full_positions(golden, ids):
        feed = lambda n: as_tensor(golden.get(n))  # noqa: E731
        layers = Executor(weights).teacher_forced(feed, decode=True, after_step=after_step)
        if exact_weights is not None:
            exact = Executor(exact_weights).teacher_forced(feed, decode=True, after_step=after_step)
            layers.update({EXACT + k: v for k, v in exact.items() if not k.startswith(("own.", "noise."))})
    elif reference_weights is not None:
        layers = recomputed_layer_checks(weights, reference_weights, golden, ids, after_step)
    return run.arrays, layers


def builtin_output(cand: dict, layers: dict | None, golden: dict, exact_section: str = EXACT_SAME,
                   reference: str = "") -> CaseOutput:
    """What the built-in device yields, in one process or from every rank: golden routes
    replayed, layer outputs judged against the goldens ("added"). ``reference``: whether the
    reference's layer inputs could be recomputed (``exact_applies``), which says why a case of
    sampled positions has no layer checks."""
    return CaseOutput(cand, layers, "added", lambda n: as_tensor(golden.get(n)), True,
                      "" if layers is not None else sampled_skip(reference), exact_section)


def sampled_skip(reference: str) -> str:
    """Why a case of sampled positions has no layer checks on the built-in device: its layer
    inputs at every position are recomputed only on the weights the goldens were made from."""
    why = ("the device run did not recompute them" if reference.startswith("ran")
           else reference.removeprefix("not run: ") or "the device has no weights path")
    return ("sampled positions: every position's layer inputs are recomputed only on the weights the "
            f"goldens were made from, and {why}")


class Device(ABC):
    mode = "device"  # "device" (the built-in executor) or "dumps" (an external runtime)
    exact_status = "not run: only the built-in device in one process runs it"
    kernels = None  # the backend whose ops it runs (``ops.contract.Backend``); None: the reference's
    runs_cases_in_prepare = False  # True where ``prepare`` runs every case (progress names it a stage)

    def __init__(self, name: str):
        self.name = name  # for the report: cpu, cuda, 2 ranks on cuda, ...

    def prepare(self, validation: Path, cases: list[str]) -> None:
        """Called once before the cases (a distributed device runs every rank here)."""

    def check(self, goldens: dict[str, dict]) -> None:
        """Called once before the cases with each case's golden arrays: bad input the device
        can see up front is raised here, all of it at once (a dump's problems)."""

    @abstractmethod
    def case(self, name: str, golden: dict, ids: np.ndarray) -> CaseOutput: ...


class InProcess(Device):
    def __init__(self, weights_for: Callable[[str], object], name: str, after_step=None,
                 source: Path | None = None):
        super().__init__(name)
        self.weights_for = weights_for
        self.weights = weights_for(DEVICE_POLICY)
        self.exact_weights = None
        self.exact_section = EXACT_SAME
        self.source = source  # the bundle or checkpoint the weights come from
        self.after_step = after_step  # a serving engine's cache handling between decode steps
        # ``validate --serving``: (weights, golden, ids, others=, case=) -> the serving paths' runs
        # (validate.serving.run_paths); ``others``: every judged case's (name, ids, golden), for the batch
        self.serving = None
        self.peers: list[tuple[str, list[int], dict]] = []
        self._goldens: dict[str, dict] = {}

    def check(self, goldens):
        self._goldens = goldens if self.serving is not None else {}

    def prepare(self, validation, cases):
        """The exact check runs on the weights the goldens were made from, in float32: judged by
        the ``exact`` limits on the CPU against CPU goldens (the same arithmetic: clean value 0),
        by the ``exact_gpu`` limits where a GPU is on either side (its measured floor)."""
        if self._goldens:  # the serving batch takes prefixes of the other judged cases' prompts
            from k3bundle.golden.store import read_npz

            inputs = read_npz(Path(validation) / GOLDEN_INPUTS)
            self.peers = [(n, [int(i) for i in inputs[f"{n}/ids"]], self._goldens[n]) for n in cases]
        self.exact_status, section = exact_applies(self.source, validation, self.weights.device)
        if section is not None:
            no_tf32()
            self.exact_section = section
            self.exact_weights = self.weights_for(EXACT_POLICY)

    def case(self, name, golden, ids):
        arrays = device_arrays(self.weights, golden, ids, self.after_step, self.exact_weights, self.exact_weights)
        out = builtin_output(*arrays, golden, self.exact_section, self.exact_status)
        if self.serving is not None:
            others = [p for p in self.peers if p[0] != name]
            out.serving = self.serving(self.weights, golden, ids.tolist(), others=others, case=name)
        return out


def no_tf32() -> None:
    """Float32 means float32: no TF32 shortcut in cuBLAS/cuDNN (the goldens have none either)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def exact_applies(source: Path | None, validation: Path, device) -> tuple[str, str | None]:
    """Whether the exact check applies to this device and these goldens: ("ran", section) with
    the tolerance section that judges it, or (why not, None)."""
    from k3bundle.bundle.signoff import manifest_digest
    from k3bundle.golden.store import read_meta, read_npz

    if source is None:
        return "not run: the device has no weights path", None
    meta = read_meta(read_npz(Path(validation) / GOLDEN_INPUTS))
    digest = manifest_digest(source)
    if digest is not None:
        if meta.get("weights_manifest_sha256") != digest:
            return "not run: the goldens were made from other weights (manifest differs)", None
    elif meta.get("source") != str(Path(source).resolve()):
        return "not run: the goldens were made from another checkpoint", None
    golden_type, own = str(meta.get("device", "cpu")).split(":")[0], torch.device(device).type
    if (golden_type, own) == ("cpu", "cpu"):
        return "ran", EXACT_SAME
    if {golden_type, own} <= {"cpu", "cuda"}:
        return f"ran: float32 on {own} against goldens made on {golden_type} ({EXACT_GPU} limits)", EXACT_GPU
    return f"not run: goldens made on {golden_type}, device {own}: no calibrated floor for that pair", None


class Dumps(Device):
    mode = "dumps"

    def __init__(self, directory: Path, weights_for: Callable[[str], object], name: str,
                 vocab: int | None = None, experts: int | None = None):
        super().__init__(name)
        self.directory = Path(directory)
        self.vocab, self.experts = vocab, experts  # the id ranges a dump's tokens and router ids must lie in
        self.weights_for = weights_for
        self.reference: dict[str, object] = {}  # emulation weights per dtype policy, made on demand

    def check(self, goldens):
        check_dumps(self.directory, goldens, self.vocab, self.experts)

    def case(self, name, golden, ids):
        cand = read_dump(self.directory, name, golden, self.vocab, self.experts)
        if not full_positions(golden, ids):
            return CaseOutput(cand, None, "emulation", golden.get, False,
                              "sampled positions: emulation layer checks need every position",
                              serving=DumpServing(cand, golden["positions"]))
        feed = {**cand, "embed": as_tensor(golden["embed"])}
        routes = golden_routes(golden)
        layers = self._emulate("float32", feed, routes)
        if cand["logits"].dtype == torch.bfloat16:
            # a BF16 dump may come from BF16 arithmetic or from FP32 arithmetic stored in BF16:
            # emulate both and judge each output against the closer (a fault is far from both)
            in_bf16 = self._emulate("bfloat16", feed, routes)
            stored = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in layers.items()}
            layers = {k: _closer(feed.get(_tap_of(k)), in_bf16[k], stored[k]) for k in in_bf16}
        return CaseOutput(cand, layers, "emulation", feed.get, False, serving=DumpServing(cand, golden["positions"]))

    def _emulate(self, dtype: str, feed: dict, routes: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if dtype not in self.reference:
            self.reference[dtype] = self.weights_for(dtype)
        return Executor(self.reference[dtype], forced_routes=routes).teacher_forced(feed.get)


def golden_routes(golden: dict) -> dict[str, torch.Tensor]:
    """The goldens' expert choices at every prompt position, which the emulation replays in each
    MoE layer whose ``router_ids`` the dump lacks (a dumped ``router_ids`` is replayed instead).

    Without the device's own choice, re-routing on the dump's rounded values flips near ties
    that the device itself need not have flipped: one flipped expert moves a correct
    ``ffn_out`` by far more than the emulation limit, and the first failure lands on that
    layer instead of a real fault downstream. The goldens' choice is the one the reference
    made on unrounded inputs; a runtime whose own choice may differ at a near tie dumps
    ``router_ids`` (then its choice is replayed and the router check judges it)."""
    return {k: as_tensor(v).long() for k, v in golden.items()
            if k.startswith("layers.") and tap_kind(k) == "router_ids"}


def _tap_of(name: str) -> str:
    return name.split(".", 1)[1] if name.startswith(("own.", "noise.")) else name


def _closer(ref, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Of two emulations of one output, the one nearer the dumped value (ids: the first)."""
    if ref is None or not a.is_floating_point():
        return a
    r = as_tensor(ref).double()
    return a if float((a.double() - r).pow(2).sum()) <= float((b.double() - r).pow(2).sum()) else b
