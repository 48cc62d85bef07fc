"""golden's errors: bad case, golden or tolerance files (exit 2)."""

from k3bundle.errors import K3Error


class CaseError(K3Error):
    """A golden case file is malformed."""


class GoldenFileError(K3Error):
    """A golden file is missing, unreadable or inconsistent."""


class ToleranceError(K3Error):
    """A tolerance file is malformed."""
