"""Errors of the endpoint client and the checks run through it (exit 2: the endpoint or the input)."""

from k3bundle.errors import K3Error


class EndpointError(K3Error):
    """An endpoint that cannot be used: unreachable, or answering what the checks cannot read."""


class EndpointUnreachable(EndpointError):
    """No connection, a timeout, or a stream that broke off."""


class EndpointRejected(EndpointError):
    """The endpoint answered with an HTTP error status (``status``)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
