"""media's errors: an image that cannot be read or used, an image spec that is malformed (exit 2)."""

from k3bundle.errors import K3Error


class MediaError(K3Error):
    """An image file is not a usable image, or a synthetic image spec is malformed."""
