"""A real ``k3bundle serve`` app on a free localhost port, in a thread of the test process."""

from k3bundle.serve.local import serving_engine as serving

__all__ = ["serving"]
