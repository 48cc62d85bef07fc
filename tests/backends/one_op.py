"""A third-party backend as a user writes one: a module with one op (the others fall back)."""

from k3bundle.kernels.torch_ops import gated_mla_prefill  # noqa: F401  (re-exported as this backend's op)

NAME = "one-op example"
