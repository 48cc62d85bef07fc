"""The endpoint a measuring command runs against: ``--endpoint URL``, or BUNDLE served here.

``perf``, ``soak`` and ``faults`` take exactly one of the two. With BUNDLE (a bundle or a
checkpoint) the command starts ``k3bundle serve`` on it in this process (``serve.local``), runs
against it and stops it on the way out; its report goes to BUNDLE/reports unless ``--out`` says.
``parsers`` shares the client options and checks (``require_client``, ``connect``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import typer

from k3bundle.endpoint.errors import EndpointError
from k3bundle.errors import K3Error
from k3bundle.file_names import REPORTS_DIR

EndpointOpt = Annotated[str | None, typer.Option(help="The OpenAI-compatible base URL, e.g. http://host:8000/v1 "
                                                      "(or give BUNDLE instead).")]
BundleArg = Annotated[Path | None, typer.Argument(help="A bundle or checkpoint to serve here with `k3bundle serve` "
                                                       "and run against (instead of --endpoint); the report goes "
                                                       "to BUNDLE/reports.", metavar="BUNDLE",
                                                       show_default=False)]
DeviceOpt = Annotated[str, typer.Option(help="With BUNDLE: the torch device it is served on (cpu, cuda, ...).")]
ModelOpt = Annotated[str | None, typer.Option(help="The model id to ask for (default: the endpoint's first).")]
ApiKeyOpt = Annotated[str | None, typer.Option(envvar="OPENAI_API_KEY", help="Bearer token, if the endpoint needs one.")]
CasesOpt = Annotated[Path | None, typer.Option(help="Golden cases folder (default: the shipped golden/cases).")]
WatchdogOpt = Annotated[float, typer.Option(help="Watchdog: seconds a request may take before it is a hang.")]


def require_client(command: str) -> None:
    """The client is the openai package, in the serve extra: without it every other command still
    runs, and this one says what to install (one line, exit 2) before anything starts."""
    try:
        import openai  # noqa: F401
    except ModuleNotFoundError as e:
        raise K3Error(f"k3bundle {command} needs the {e.name} package: pip install 'k3bundle[serve]'") from None


def connect(url: str, model: str | None, api_key: str | None):
    """An ``Endpoint`` at ``url`` whose ``/v1/models`` answered and lists ``model`` (where given):
    an unreachable endpoint or an unknown model is one line, exit 2, before anything is sent."""
    from k3bundle.endpoint import Endpoint

    ep = Endpoint(url, model=model, api_key=api_key)
    served = ep.models()
    if model is not None and model not in served:
        raise EndpointError(f"{ep.base_url}: model {model!r} is not served there (models: {', '.join(served)})")
    return ep


def named_requests(requests: list, names: list[str] | None, command: str) -> list:
    """``requests`` (golden requests) restricted to ``names`` (None: all); an unknown name is an error."""
    if not names:
        return requests
    known = [r.name for r in requests]
    bad = next((n for n in names if n not in known), None)
    if bad is not None:
        raise EndpointError(f"--case {bad!r} is not a case {command} sends (known: {', '.join(known)})")
    return [r for r in requests if r.name in names]


def check_one(command: str, endpoint: str | None, bundle: Path | None) -> None:
    """Exactly one of --endpoint and BUNDLE, else one line (exit 2) before anything starts."""
    if endpoint is not None and bundle is not None:
        raise EndpointError(f"k3bundle {command}: give --endpoint URL or BUNDLE, not both")
    if endpoint is None and bundle is None:
        raise EndpointError(f"k3bundle {command}: give --endpoint URL, or BUNDLE to serve here and run against")
    if bundle is not None and not bundle.is_dir():
        raise EndpointError(f"{bundle}: not a directory (BUNDLE is a bundle or checkpoint folder)")


def report_dir(out: Path | None, bundle: Path | None, fallback: Path | None = None) -> Path:
    """``--out``, else BUNDLE/reports (where the checklist reads it), else ``fallback``."""
    if out is not None:
        return out
    if bundle is not None:
        return bundle / REPORTS_DIR
    if fallback is None:
        raise EndpointError("give --out DIR for the report, or BUNDLE (the report then goes to BUNDLE/reports)")
    return fallback


@contextlib.contextmanager
def endpoint_url(endpoint: str | None, bundle: Path | None, device: str, say=None) -> Iterator[str]:
    """The URL to run against: ``endpoint`` as given, or BUNDLE served here until the block ends."""
    if endpoint is not None:
        yield endpoint
        return
    from k3bundle.serve.local import serving

    if say is not None:
        say(f"serving {bundle} on {device} with k3bundle serve (127.0.0.1, a free port)")
    with serving(bundle, device=device) as url:
        yield url
