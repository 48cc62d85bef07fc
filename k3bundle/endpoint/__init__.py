"""Measuring an OpenAI-compatible endpoint: one client (client.py) and the checks run through it.

``Endpoint`` (client.py) drives ``/v1/chat/completions`` and ``/v1/completions`` of any
OpenAI-compatible server, streaming or not, and times each request; ``parsers`` (parsers.py)
holds the endpoint's reasoning, content and tool-call split against k3bundle's XTML parser.
docs/endpoint.md describes both.

The client needs the ``openai`` package (the ``serve`` extra); it is imported when a client name
is first asked for, so the errors here import without it.
"""

from k3bundle.endpoint.errors import EndpointError, EndpointRejected, EndpointUnreachable

_CLIENT = ("ChatResult", "CompletionResult", "Endpoint", "Timing", "ToolCallOut")


def __getattr__(name: str):
    if name in _CLIENT:
        from k3bundle.endpoint import client

        return getattr(client, name)
    raise AttributeError(f"module 'k3bundle.endpoint' has no attribute {name!r}")


__all__ = [*_CLIENT, "EndpointError", "EndpointRejected", "EndpointUnreachable"]
