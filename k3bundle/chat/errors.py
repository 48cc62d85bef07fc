"""The chat package's error."""

from k3bundle.errors import K3Error


class ChatError(K3Error, ValueError):
    """A conversation cannot be rendered as asked (bad role, arguments, option)."""
