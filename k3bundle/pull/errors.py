"""The one error ``k3bundle pull`` raises for bad input, a bad transfer or a refused file."""

from k3bundle.errors import K3Error


class PullError(K3Error):
    """A pull cannot go on: one line naming the file (or repo) and what is wrong.

    Raised for an unknown repo or revision, a file name that is unsafe, a hash or size that
    disagrees with the Hub's record, a transfer that stayed short after its retries, or an
    existing file in ``--out`` that differs from what the pull would write. The CLI prints
    ``error: <message>`` and exits 2.
    """
