"""Synthetic checkpoints faithful to the Kimi K3 release in everything but size."""

from k3bundle.synth.checkpoint import SynthResult, write_synthetic
from k3bundle.synth.presets import preset_config, preset_config_dict, preset_names

__all__ = ["SynthResult", "write_synthetic", "preset_config", "preset_config_dict", "preset_names"]
