"""Progress where stderr is not a terminal: one plain line as each stage starts and one as it ends
(``cli._common.progress_bar`` with ``stages``), nothing where it has no stages, and no "done" line
before the error of a run that fails."""

from __future__ import annotations

import io
import sys

import pytest

from k3bundle.cli._common import StageLines, progress_bar


class _Clock:
    def __init__(self, *times: float):
        self.times = list(times)

    def __call__(self) -> float:
        return self.times.pop(0)


def test_each_stage_reads_as_a_start_line_and_a_done_line_with_its_seconds():
    out = io.StringIO()
    lines = StageLines("validate", out, clock=_Clock(10.0, 13.14, 13.14, 20.0, 20.0, 20.5))
    lines.update(0, 4, "case greedy")
    lines.update(0, 4, "case greedy")  # the same stage again: no line
    lines.update(1, 4, "case thinking")
    lines.update(3, None, "writing the goldens")  # a stage of no count
    lines.update(4, 4, "")  # the run's end: closes the stage under way
    lines.end()  # nothing left to close
    assert out.getvalue().splitlines() == [
        "validate: case greedy 1/4 ...",
        "validate: case greedy 1/4 done 3.1 s",
        "validate: case thinking 2/4 ...",
        "validate: case thinking 2/4 done 6.9 s",
        "validate: writing the goldens ...",
        "validate: writing the goldens done 0.5 s",
    ]


class _Pipe(io.StringIO):
    def isatty(self) -> bool:
        return False


@pytest.mark.parametrize("stages,want", [(True, ["golden: case greedy 1/2 ...", "golden: case greedy 1/2 done"]),
                                         (False, [])])
def test_a_stage_that_raises_gets_no_done_line(monkeypatch, stages, want):
    err = _Pipe()
    monkeypatch.setattr(sys, "stderr", err)
    with pytest.raises(RuntimeError):
        with progress_bar("golden", stages=stages) as update:
            update(0, 2, "case greedy")
            update(1, 2, "case thinking")
            raise RuntimeError("the run stops here")
    got = [l.rsplit(" ", 2)[0] if l.endswith(" s") else l for l in err.getvalue().splitlines()]
    assert got == want + (["golden: case thinking 2/2 ..."] if stages else [])


def test_disabled_progress_prints_nothing(monkeypatch):
    err = _Pipe()
    monkeypatch.setattr(sys, "stderr", err)
    with progress_bar("validate", enabled=False, stages=True) as update:
        update(0, 1, "case greedy")
    assert err.getvalue() == ""
