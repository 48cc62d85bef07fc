"""The convert package's error."""

from k3bundle.errors import K3Error


class ConvertError(K3Error):
    """A conversion cannot proceed: bad source bytes, a full disk, an unusable output directory."""
