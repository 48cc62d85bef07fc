"""Assembles the ``k3bundle`` command line; each command lives in its own module."""

from __future__ import annotations

import importlib
import os
import sys

import typer

from k3bundle import __version__, runtime
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


#: The commands, in the order ``--help`` lists them; each is defined in ``k3bundle.cli.<name>`` (a
#: function of the same name, or for a group, ``app``).
COMMANDS = ("synth", "schema", "inspect", "plan", "convert", "verify", "trace", "run", "kernels", "pull",
            "golden", "validate", "calibrate", "demo", "checklist", "report", "serve", "parsers", "perf", "soak",
            "faults")


_registered: set[str] = set()


def register(names) -> None:
    """Add the commands ``names`` to the app. Only the commands a process runs are imported: the
    command modules import their libraries (torch among them) at the top, and a command that needs
    none, such as ``trace``, must not pay the 1-2 s that importing them all costs."""
    for name in names:
        if name in _registered:
            continue
        _registered.add(name)
        module = importlib.import_module(f"k3bundle.cli.{name}")
        if isinstance(getattr(module, "app", None), typer.Typer):
            app.add_typer(module.app, name=name)
        else:
            app.command(name, epilog=_epilog(module.EXAMPLES))(getattr(module, name))


def _invoked(argv: list[str]) -> list[str]:
    """The commands to register for ``argv``: the one named first (options before it are only the
    root's eager ``--version``/``--help``), or all of them for the root's help and usage errors."""
    first = next((a for a in argv if not a.startswith("-")), None)
    return [first] if first in COMMANDS else list(COMMANDS)


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
        register(_invoked(sys.argv[1:]))
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
    except (KeyboardInterrupt, *_click_classes("Abort")):  # Ctrl-C, also while a command's modules import
        sys.stderr.write("aborted\n")
        sys.exit(130)
    except _click_classes("ClickException") as e:  # usage errors, bad parameters, missing arguments
        e.show()
        sys.exit(2)


def main() -> None:
    """Entry point (``k3bundle`` and ``python -m k3bundle``)."""
    _run_app()
