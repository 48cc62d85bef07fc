"""Synthetic checkpoints faithful to the Kimi K3 release in everything but size."""

from k3bundle.synth.checkpoint import SynthResult, write_synthetic

__all__ = ["SynthResult", "write_synthetic"]
