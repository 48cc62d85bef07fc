"""calibrate's errors (exit 2: nothing calibrated, no tolerance file written)."""

from k3bundle.errors import K3Error


class CalibrateError(K3Error):
    """calibrate cannot run: a bad preset, layout, seed list, fault, device or backend; a job that failed."""
