"""``k3bundle serve``: an OpenAI-compatible HTTP server over the built-in executor (docs/endpoint.md).

``Engine`` (engine.py) holds the model and runs one request at a time; ``create_app`` (app.py)
is the FastAPI app of routes; ``serve`` runs it with uvicorn.
"""

from k3bundle.serve.engine import FAULT_ENV, FAULTS, Engine
from k3bundle.serve.errors import ServeError


def require_extra() -> None:
    """fastapi and uvicorn come with the serve extra: without them, one line saying how to get them."""
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ModuleNotFoundError as e:
        raise ServeError(f"k3bundle serve needs the {e.name} package: pip install 'k3bundle[serve]'") from None


def create_app(engine: Engine):
    """The FastAPI app of routes over ``engine``."""
    require_extra()
    from k3bundle.serve.app import create_app as _create

    return _create(engine)


def serve(engine: Engine, host: str = "127.0.0.1", port: int = 8000, log_level: str = "warning") -> None:
    """Serve ``engine`` until interrupted."""
    import uvicorn

    uvicorn.run(create_app(engine), host=host, port=port, log_level=log_level)


__all__ = ["FAULTS", "FAULT_ENV", "Engine", "ServeError", "create_app", "require_extra", "serve"]
