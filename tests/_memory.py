"""Peak memory of a child process that measures the program, not glibc's heap policy.

glibc's default mmap threshold is dynamic: once a mmapped block of N bytes is freed, later blocks
up to N (at most 32 MiB) come from the heap, where freed memory stays resident until the top of
the heap happens to be free; per-thread arenas keep their own. A peak RSS then depends on the
order of frees as much as on what the program holds (one run of the executor test grew 107 MB,
another 61 MB). With these settings every block of 128 KiB or more is its own mapping, returned
to the kernel when freed, and the heap gives back what it holds above 128 KiB: the high-water
mark is what was live at the peak, plus small-object slack.
"""

from __future__ import annotations

import os

FIXED_MALLOC = {
    "MALLOC_MMAP_THRESHOLD_": str(128 << 10),  # fixed: disables the dynamic threshold
    "MALLOC_TRIM_THRESHOLD_": str(128 << 10),
    "MALLOC_TOP_PAD_": "0",
    "MALLOC_ARENA_MAX": "1",  # one heap for every thread (OpenMP workers allocate too)
}

# Python expression, for child code: VmHWM of this process image in bytes (ru_maxrss survives
# exec and would include the forking pytest process)
VMHWM = "int(next(l for l in open('/proc/self/status') if l.startswith('VmHWM')).split()[1]) * 1024"


def child_env(**extra: str) -> dict[str, str]:
    return {**os.environ, **FIXED_MALLOC, **extra}
