"""``k3bundle serve``: an OpenAI-compatible HTTP server over the built-in executor."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from k3bundle.executor import POLICIES, ExecutorError
from k3bundle.serve import FAULT_ENV, Engine, require_extra, serve as run_server

EXAMPLES = [
    "k3bundle serve /tmp/k3-tt --port 8000",
    "k3bundle serve /tmp/k3-tt-bundle --host 0.0.0.0 --port 8000 --max-model-len 8192",
]


def serve(
    source: Annotated[Path, typer.Argument(help="A bundle or a source checkpoint directory.")],
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
    dtype: Annotated[str, typer.Option(help="float32, bfloat16 or float64.")] = "float32",
    device: Annotated[str, typer.Option(help="Any torch device: cpu, cuda, ...")] = "cpu",
    max_model_len: Annotated[int | None, typer.Option(help="Context length (default: the config's "
                                                           "max_position_embeddings).")] = None,
    served_model_name: Annotated[str | None, typer.Option(help="The model id clients name (default: the "
                                                               "directory's name).")] = None,
    fault: Annotated[str | None, typer.Option(hidden=True, help=f"Test hook: plant a fault (also {FAULT_ENV}).")] = None,
) -> None:
    """Serve /v1/chat/completions, /v1/completions and /v1/models, greedily, one request at a time."""
    require_extra()  # before the model is read
    if dtype not in POLICIES:
        raise ExecutorError(f"--dtype {dtype!r} is not one of {', '.join(POLICIES)}")
    engine = Engine(source, dtype=dtype, device=device, max_model_len=max_model_len,
                    fault=fault or os.environ.get(FAULT_ENV) or None, name=served_model_name)
    planted = f" (planted fault: {engine.fault})" if engine.fault else ""
    sys.stderr.write(f"serving {engine.name} at http://{host}:{port}/v1, context {engine.max_model_len}{planted}\n")
    run_server(engine, host, port)
