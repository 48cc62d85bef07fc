"""validate's errors (exit 2: the run cannot be judged)."""

from k3bundle.errors import K3Error


class ValidateError(K3Error):
    """validate cannot run: missing goldens, bad arguments, a device run that failed."""


class DumpError(ValidateError):
    """A dump directory or file is unusable (missing file or tap, wrong shape, NaN/Inf)."""


class Terminated(ValidateError):
    """SIGTERM during a run: no verdict, an earlier one removed (exit 143, as a killed process)."""

    exit_code = 128 + 15
