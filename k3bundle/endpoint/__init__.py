"""Measuring an OpenAI-compatible endpoint: one client (client.py) and the checks run through it.

``Endpoint`` (client.py) drives ``/v1/chat/completions`` and ``/v1/completions`` of any
OpenAI-compatible server, streaming or not, and times each request; ``parsers`` (parsers.py)
holds the endpoint's reasoning, content and tool-call split against k3bundle's XTML parser.
docs/endpoint.md describes both.
"""

from k3bundle.endpoint.client import ChatResult, CompletionResult, Endpoint, Timing, ToolCallOut
from k3bundle.endpoint.errors import EndpointError, EndpointRejected, EndpointUnreachable

__all__ = ["ChatResult", "CompletionResult", "Endpoint", "EndpointError", "EndpointRejected",
           "EndpointUnreachable", "Timing", "ToolCallOut"]
