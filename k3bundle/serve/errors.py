"""Errors of ``k3bundle serve``: each carries the HTTP status an OpenAI-compatible server answers with."""

from k3bundle.errors import K3Error


class ServeError(K3Error):
    """A request the server refuses (4xx), or a model it cannot open (exit 2 at start)."""

    def __init__(self, message: str, status: int = 400, kind: str = "invalid_request_error",
                 param: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.param = status, kind, param
