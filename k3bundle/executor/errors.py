"""The executor's errors."""

from k3bundle.errors import K3Error


class ExecutorError(K3Error):
    """The executor was asked for something impossible (bad token id, dtype, device)."""
