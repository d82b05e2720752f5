"""The default attention kernel and the signature every replacement must keep.

Contract: `fn(q, k, v) -> out`, all four shaped [batch, seq, heads, head_dim] (sequence-major, so a sequence-parallel
wrapper can all-to-all along dim 1 and 2 without reshaping). Causal; padding is always on the right, so a plain causal
mask never lets a real token attend to padding.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.nn.functional as F
from torch import Tensor

AttentionFn = Callable[[Tensor, Tensor, Tensor], Tensor]

__all__ = ["AttentionFn", "causal_attention"]


def causal_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Causal SDPA on [B, S, H, D] inputs; returns [B, S, H, D]."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    return out.transpose(1, 2)
