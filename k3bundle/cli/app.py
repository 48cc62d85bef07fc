"""Assembles the ``k3bundle`` command line; each command lives in its own module."""

from __future__ import annotations

import importlib
import os
import sys

import typer

from k3bundle import __version__, runtime
from k3bundle.cli import demo as demo_cmd
from k3bundle.cli import golden as golden_cmd
from k3bundle.cli import inspect as inspect_cmd
from k3bundle.cli import pull as pull_cmd
from k3bundle.cli import run as run_cmd
from k3bundle.cli import schema as schema_cmd
from k3bundle.cli import synth as synth_cmd
from k3bundle.cli import validate as validate_cmd
from k3bundle.cli import plan as plan_cmd
from k3bundle.cli import convert as convert_cmd
from k3bundle.cli import verify as verify_cmd
from k3bundle.cli import trace as trace_cmd
from k3bundle.cli import checklist as checklist_cmd
from k3bundle.cli import kernels as kernels_cmd
from k3bundle.cli import report as report_cmd
from k3bundle.errors import K3Error

app = typer.Typer(
    name="k3bundle",
    help="Bring Kimi K3 up on serving targets and new accelerators: pull, convert, validate, sign off.\n\n"
         "CPU: torch uses K3BUNDLE_THREADS threads (default: the CPUs this process may use) and OpenMP waits "
         "passively unless OMP_WAIT_POLICY, GOMP_SPINCOUNT or KMP_BLOCKTIME is set (docs/performance.md).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _epilog(examples: list[str]) -> str:
    return "Examples:\n\n" + "\n\n".join(f"  $ {e}" for e in examples)


app.command("synth", epilog=_epilog(synth_cmd.EXAMPLES))(synth_cmd.synth)
app.command("schema", epilog=_epilog(schema_cmd.EXAMPLES))(schema_cmd.schema)
app.command("inspect", epilog=_epilog(inspect_cmd.EXAMPLES))(inspect_cmd.inspect)
app.command("plan", epilog=_epilog(plan_cmd.EXAMPLES))(plan_cmd.plan)
app.command("convert", epilog=_epilog(convert_cmd.EXAMPLES))(convert_cmd.convert)
app.command("verify", epilog=_epilog(verify_cmd.EXAMPLES))(verify_cmd.verify)
app.command("trace", epilog=_epilog(trace_cmd.EXAMPLES))(trace_cmd.trace)
app.command("run", epilog=_epilog(run_cmd.EXAMPLES))(run_cmd.run)
app.command("kernels", epilog=_epilog(kernels_cmd.EXAMPLES))(kernels_cmd.kernels)
app.command("pull", epilog=_epilog(pull_cmd.EXAMPLES))(pull_cmd.pull)
app.command("golden", epilog=_epilog(golden_cmd.EXAMPLES))(golden_cmd.golden)
app.command("validate", epilog=_epilog(validate_cmd.EXAMPLES))(validate_cmd.validate)
app.command("demo", epilog=_epilog(demo_cmd.EXAMPLES))(demo_cmd.demo)
app.command("checklist", epilog=_epilog(checklist_cmd.EXAMPLES))(checklist_cmd.checklist)
app.add_typer(report_cmd.app, name="report")


def _version(value: bool) -> None:
    if value:
        print(f"k3bundle {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print the version and exit.")) -> None:
    pass


def _click_classes(name: str) -> tuple[type[BaseException], ...]:
    """click's exception class ``name`` wherever the installed typer keeps it: typer itself, plain
    click, or the copy of click that typer >= 0.17 vendors as ``typer._click``."""
    modules = [typer]
    for name_ in ("click.exceptions", "typer._click.exceptions"):
        try:
            modules.append(importlib.import_module(name_))
        except ImportError:
            pass
    return tuple({c for m in modules if isinstance(c := getattr(m, name, None), type)})


def _run_app() -> None:
    """Run the app: known errors become one line on stderr and exit code 2; a usage error prints
    the usage and exits 2, whatever typer or click version is installed."""
    try:
        runtime.apply()  # torch's thread count; the wait policy was set in k3bundle/cli/__init__.py
        rc = app(standalone_mode=False)  # click returns typer.Exit's code here instead of exiting
        if isinstance(rc, int) and rc:
            sys.exit(rc)
    except K3Error as e:
        if os.environ.get("K3BUNDLE_DEBUG"):
            raise
        sys.stderr.write(f"error: {e}\n")
        sys.exit(e.exit_code)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except _click_classes("Abort"):
        sys.stderr.write("aborted\n")
        sys.exit(130)
    except _click_classes("ClickException") as e:  # usage errors, bad parameters, missing arguments
        e.show()
        sys.exit(2)


def main() -> None:
    """Entry point (``k3bundle`` and ``python -m k3bundle``)."""
    _run_app()
