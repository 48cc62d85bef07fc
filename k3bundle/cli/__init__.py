"""The k3bundle command line: thin typer commands over library calls."""

from k3bundle import runtime

# OpenMP reads its wait policy once, when torch loads it: set it before any command module imports
# torch (docs/performance.md "Under load"); the thread count is chosen in app.main.
runtime.prepare_environment()
