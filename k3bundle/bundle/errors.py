"""The bundle package's error."""

from k3bundle.errors import K3Error


class BundleError(K3Error):
    """A bundle file is missing, malformed, or of a schema version this k3bundle cannot read."""
