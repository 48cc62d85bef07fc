"""The built-in PyTorch executor: Kimi K3's text model, layer by layer, stateful, with taps.

Numerical ground truth of k3bundle (docs/kimi-k3.md §3; docs/executor.md). One module per
block: ``norms`` (N1), ``attnres`` (A1-A2), ``kda`` (K1-K7), ``mla`` (M1-M5), ``situ_glu``
(S1-S3, D1), ``latent_moe`` (R1-R7), ``head`` (E0, F1); ``model`` runs the layer loop,
``weights`` reads one layer at a time, ``cache`` holds per-sequence state, ``taps`` records
named intermediates.

Example:
    >>> from k3bundle.executor import Executor, SourceWeights
    >>> ex = Executor(SourceWeights("/tmp/k3-tiny", dtype="float32"))
    >>> logits, cache = ex.prefill([1, 2, 3])
    >>> next_logits = ex.decode(int(logits[-1].argmax()), cache)
"""

from k3bundle.executor.cache import CacheBytes, KDAState, MLAState, ModelCache, cache_bytes
from k3bundle.executor.model import Executor, Generation
from k3bundle.executor.taps import TapRecorder, tap_names
from k3bundle.executor.weights import (
    POLICIES, DtypePolicy, ExecutorError, LayerWeights, SourceWeights, WeightSource, policy,
)

__all__ = ["Executor", "Generation", "SourceWeights", "WeightSource", "LayerWeights", "DtypePolicy",
           "POLICIES", "policy", "ExecutorError", "TapRecorder", "tap_names", "ModelCache", "KDAState",
           "MLAState", "CacheBytes", "cache_bytes"]
