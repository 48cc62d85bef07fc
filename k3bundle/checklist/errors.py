"""The checklist package's error."""

from k3bundle.errors import K3Error


class ChecklistError(K3Error):
    """The checklist cannot be made as asked (flags, a bundle for another target)."""
