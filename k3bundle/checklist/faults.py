"""Fault paths and soak: what a target must survive, how to provoke it, what counts as passing.

Why these four faults and these soak criteria: spec/validation-landscape.md §8 (serving engines
that die or deadlock behind a healthy health check, exit 0 after engine death, leak host memory
for hours) and §12 (sign-off covers injected OOM, collective timeout, bad page and device reset,
each followed by re-validation, and 24–72 h soak slopes). The evidence is the bring-up team's
``reports/faults.json`` and ``reports/soak.json``; docs/bring-up.md gives their format.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FaultPath:
    key: str  # the ``fault`` value in reports/faults.json
    title: str
    inject: str  # how to provoke it
    clear_error: str  # what a clear error path means for this fault

    def to_dict(self) -> dict:
        return dict(self.__dict__)


FAULT_PATHS: tuple[FaultPath, ...] = (
    FaultPath("oom", "out of memory",
              "admit requests past the capacity section's concurrency, or cap the runtime's memory fraction",
              "the request that does not fit is rejected or preempted with an error naming the memory that ran "
              "out; the server keeps serving the others; no rank dies"),
    FaultPath("collective_timeout", "collective timeout",
              "stop one rank (SIGSTOP) or cut its link in the middle of a decode step",
              "every rank reports the timed-out collective and the missing rank within the configured timeout; "
              "the engine exits non-zero and health turns unhealthy (no silent hang behind a healthy /health)"),
    FaultPath("bad_page", "bad memory page",
              "inject an uncorrectable ECC error / poison a page (vendor error injection, DCGM diag level 4)",
              "the runtime reports the page, fails the requests whose KV/state or weights used it, retires the "
              "page, and serves nothing computed from it"),
    FaultPath("device_reset", "device reset",
              "reset one card under load (vendor SMI)",
              "in-flight requests fail with an error naming the lost device; the engine exits non-zero so its "
              "supervisor restarts it (not exit 0), and re-validation passes after the restart"),
)

#: Soak criteria (reports/soak.json). Growth is measured after warm-up, end minus start.
SOAK_MIN_HOURS = 24
SOAK_MAX_HOURS = 72
#: Host memory: RssAnon + VmSwap (a leak can hide in swap, validation-landscape §8).
SOAK_HOST_GROWTH_LIMIT_BYTES = 256 << 20
#: Device memory: a serving runtime preallocates; anything beyond allocator noise is a leak.
SOAK_DEVICE_GROWTH_LIMIT_BYTES = 64 << 20

SOAK_REQUIREMENTS: tuple[tuple[str, str], ...] = (
    ("duration", f"{SOAK_MIN_HOURS}–{SOAK_MAX_HOURS} h of mixed traffic (short chat, tool calls, long context, "
                 "images) at the capacity section's concurrency"),
    ("no_leak", f"host RssAnon + VmSwap grows ≤ {SOAK_HOST_GROWTH_LIMIT_BYTES >> 20} MiB and device memory ≤ "
                f"{SOAK_DEVICE_GROWTH_LIMIT_BYTES >> 20} MiB over the run (after warm-up)"),
    ("no_page_corruption", "periodic golden re-checks (`k3bundle validate --dumps`) during the soak all pass"),
    ("no_silent_hang", "every request completes or errors within its timeout; zero hangs detected by a "
                       "step-progress heartbeat"),
)
