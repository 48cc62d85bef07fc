"""Embedding and the output head (docs/kimi-k3.md §3.1 E0, §3.8 F1).

(E0) h⁰ = embed_tokens[token]   (the weight source reads only the rows asked for); at the
     positions of the image placeholder ``<|media_pad|>``, the projector's rows instead, in order
(F1) logits = W_lm · RMSNorm_{model.norm}(h_final);  logit_scale 1.0, no soft-cap, lm_head untied

h_final is the output AttnRes (``attnres.BlockResidual.output``); the final norm is applied
here, after it, as vLLM's ``compute_logits`` does (so a draft model would see pre-norm states).

Legend: T tokens, D model width, V vocabulary.
"""

from __future__ import annotations

import torch

from k3bundle.executor.errors import ExecutorError
from k3bundle.executor.norms import compute_dtype, linear, rms_norm


def embed(ids_T: torch.Tensor, source) -> torch.Tensor:
    return source.embed(ids_T)  # (E0)


def splice(h0_TD: torch.Tensor, ids_T: torch.Tensor, media_MD: torch.Tensor, placeholder: int) -> torch.Tensor:
    """(E0) the placeholder positions' rows replaced by the media rows, in order (§3.1)."""
    at = (ids_T.to(h0_TD.device) == placeholder).nonzero().flatten()
    if at.numel() != media_MD.shape[0]:
        raise ExecutorError(f"the prompt has {at.numel()} <|media_pad|> positions (id {placeholder}) but the images "
                            f"give {media_MD.shape[0]} rows")
    out = h0_TD.clone()
    out[at] = media_MD.to(device=h0_TD.device, dtype=h0_TD.dtype)  # (E0) image rows in the order they come
    return out


def logits(h_TD: torch.Tensor, w_norm_D: torch.Tensor, w_lm_VD: torch.Tensor, eps: float) -> torch.Tensor:
    """(F1); returned in the compute dtype (FP32, FP64 in the float64 policy)."""
    logits_TV = linear(rms_norm(h_TD, w_norm_D, eps), w_lm_VD)  # (F1)
    # logits leave the model in FP32 for sampling and comparison (vLLM upcasts them too)
    return logits_TV.to(compute_dtype(h_TD))
