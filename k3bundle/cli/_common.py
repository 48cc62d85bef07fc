"""Shared pieces of the CLI: option aliases, the output object, the exit helper, progress bars."""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer

JsonOpt = Annotated[bool, typer.Option("--json", help="Print a machine-readable JSON summary on stdout.")]
ConfigOpt = Annotated[Path | None, typer.Option("--config", help="A released-style config.json (no weights needed).")]


class Output:
    """Results go to stdout (text or JSON); progress, hints and warnings to stderr."""

    def __init__(self, json_mode: bool = False):
        self.json_mode = json_mode

    def result(self, text: str, data: Any) -> None:
        if self.json_mode:
            sys.stdout.write(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")
        else:
            sys.stdout.write(text.rstrip("\n") + "\n")

    def info(self, text: str) -> None:
        if not self.json_mode:
            sys.stderr.write(text + "\n")


def exit_with(code: int) -> None:
    """End a command with exit status ``code`` (0 returns). Bad input is not this: a ``K3Error``
    raised from a command is printed as one line and exits with its own code (``cli.app.main``).

    ``SystemExit``, not ``typer.Exit``: click swallows ``typer.Exit`` when not standalone."""
    if code:
        raise SystemExit(code)


@contextmanager
def progress_bar(description: str, enabled: bool = True, stages: bool = False):
    """Progress on stderr; yields ``update(done, total, label)``. On a terminal, a rich bar. Where
    stderr is not a terminal (a log, CI) and ``stages`` is set — each label names the stage that
    starts now, ``done`` counts the stages finished — one plain line as a stage starts and one as
    it ends (``StageLines``): a long run says what it is doing without a terminal to redraw."""
    if not enabled:
        yield lambda done, total, label="": None
        return
    if not sys.stderr.isatty():
        if not stages:
            yield lambda done, total, label="": None
            return
        lines = StageLines(description, sys.stderr)
        yield lines.update
        lines.end()  # not reached when the block raises: its error is the last line, no "done" before it
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.console import Console

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), TextColumn("{task.fields[label]}"),
                  console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(description, total=None, label="")

        def update(done: int, total: int | None, label: str = "") -> None:
            bar.update(task, completed=done, total=total, label=label)

        yield update


class StageLines:
    """``progress_bar``'s lines where stderr is not a terminal: ``validate: case greedy 2/4 ...`` as
    a stage starts, ``validate: case greedy 2/4 done 3.1 s`` as the next one starts or the run
    ends. A stage of no count (``total`` None) reads without ``N/M``."""

    def __init__(self, description: str, stream, clock: Callable[[], float] = time.monotonic):
        self.description, self.stream, self.clock = description, stream, clock
        self.current: str | None = None  # the stage under way, as its lines name it
        self.started = 0.0

    def update(self, done: int, total: int | None, label: str = "") -> None:
        name = None if not label else label if not total else f"{label} {min(done + 1, total)}/{total}"
        if name == self.current:
            return
        self.end()
        if name is not None:
            self.current, self.started = name, self.clock()
            self._write(f"{name} ...")

    def end(self) -> None:
        if self.current is not None:
            self._write(f"{self.current} done {self.clock() - self.started:.1f} s")
            self.current = None

    def _write(self, text: str) -> None:
        self.stream.write(f"{self.description}: {text}\n")
        self.stream.flush()


@contextmanager
def sigterm_raises(make_error: Callable[[], BaseException]):
    """Within the block a plain ``kill`` (SIGTERM) raises ``make_error()`` where the command is, as
    Ctrl-C raises ``KeyboardInterrupt``: the command's clean-up for an interrupted run is the same
    for both. Python runs handlers in the main thread only; elsewhere SIGTERM keeps its action."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_sigterm(signum, frame):
        raise make_error()

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
