"""k3bundle: bring Kimi K3 up on serving targets and new accelerators.

Pull and hash the upstream checkpoint, repack it into per-device bundles, run a
layer-by-layer PyTorch executor against golden intermediates, and sign off.
"""

__version__ = "0.1.0"
