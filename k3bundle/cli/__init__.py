"""The k3bundle command line: thin typer commands over library calls."""
