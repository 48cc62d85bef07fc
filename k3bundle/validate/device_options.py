"""Which device ``k3bundle validate`` judges, from its options (``open_device``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from k3bundle.bundle.errors import BundleError
from k3bundle.bundle.open_weights import open_weights, weights_kind
from k3bundle.config import load_config
from k3bundle.validate.devices import DEVICE_POLICY, Device, Dumps, InProcess
from k3bundle.validate.distributed import COLLECTIVE_TIMEOUT_S, Distributed
from k3bundle.validate.errors import ValidateError


def weights_for(path: Path, device: str = "cpu") -> Callable[[str], object]:
    """dtype policy -> the executor's weights for ``path``: a bundle's device weights, every
    rank merged, or a source checkpoint (which checks the executor and the goldens against
    each other). Decoded tensors stay resident while they fit (``resident_budget``): the
    teacher-forced run asks for every layer again at each decode step."""
    try:
        weights_kind(path)  # at once: a path that is neither is refused before anything runs
    except BundleError as e:
        raise ValidateError(str(e)) from None
    return lambda dtype: open_weights(path, dtype, device)


def with_backend(factory: Callable[[str], object], backend) -> Callable[[str], object]:
    """``factory`` whose device-policy weights run ``backend``'s kernels; the exact check's float32
    weights keep the reference (it judges the weights and the cache to the float32 floor)."""
    def make(dtype: str):
        w = factory(dtype)
        if dtype == DEVICE_POLICY:
            w.backend = backend
        return w

    return make


def backend_label(device: str, backend) -> str:
    if backend is None:
        return device
    own = sorted(backend.ops)
    return f"{device}, backend {backend.name} ({', '.join(own)}; the rest reference)"


def open_device(path: str | Path, device: str = "cpu", ranks: str = "merged", nproc: int | None = None,
                dumps: str | Path | None = None, rank_results: str | Path | None = None,
                backend: str | None = None, serving: bool = False,
                collective_timeout: float = COLLECTIVE_TIMEOUT_S) -> Device:
    """The device under test: ``dumps`` (an external runtime), one process per rank
    (``ranks="distributed"``), or the built-in executor in this process; with ``backend``, the
    built-in executor runs that backend's kernels (``k3bundle.kernels``) in place of the reference's.
    ``serving``: the built-in device in this process also runs the serving paths (``validate.serving``)."""
    path = Path(path)
    kern = None
    if backend is not None:
        if dumps is not None:
            raise ValidateError("--backend runs kernels in the built-in executor; --dumps judges an external "
                                "runtime's intermediates: give one of them")
        from k3bundle.kernels.backend import load, print_warnings

        kern = load(backend)
        print_warnings(kern)
        kern.setup(device)
    if ranks not in ("merged", "distributed"):
        raise ValidateError(f"--ranks must be merged or distributed, got {ranks!r}")
    if serving and (dumps is not None or ranks == "distributed"):
        raise ValidateError("--serving runs the serving paths on the built-in device in this process; "
                            "it cannot be combined with --dumps or --ranks distributed")
    if dumps is not None and not Path(dumps).is_dir():
        raise ValidateError(f"{dumps}: --dumps must be a folder of CASE.safetensors files, and this is "
                            f"{'not a folder' if Path(dumps).exists() else 'missing'}")
    factory = weights_for(path, device)
    if dumps is not None:
        dumps = Path(dumps)
        text = load_config(path).text
        return Dumps(dumps, factory, device, vocab=text.vocab_size, experts=text.num_experts)
    if ranks == "distributed":
        if weights_kind(path) != "bundle":
            raise ValidateError(f"{path}: --ranks distributed needs a bundle (a checkpoint has no ranks)")
        dut = Distributed(path, device=device, nproc=nproc, results=rank_results, backend=backend,
                          name=backend_label(device, kern), collective_timeout=collective_timeout)
    else:
        if rank_results is not None:
            raise ValidateError("--rank-results needs --ranks distributed")
        dut = InProcess(factory if kern is None else with_backend(factory, kern), backend_label(device, kern),
                        source=path)
    dut.kernels = kern  # a failure's report names the backend's ops that ran there
    if serving:
        from functools import partial

        from k3bundle.validate.serving import Handoff, run_paths

        # the decoding process opens the same weights; it runs the reference kernels, so not under --backend
        dut.serving = partial(run_paths, handoff=None if kern else Handoff(str(path), DEVICE_POLICY, device))
    return dut
