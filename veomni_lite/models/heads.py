"""What every loss head shares: the local mean over valid targets, and the FLOPs estimate of a decoder."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from veomni_lite.loss_keys import IGNORE_INDEX


def masked_mean_cross_entropy(logits: Tensor, labels: Tensor, weights: Tensor | None = None) -> Tensor:
    """Mean over entries with `labels != IGNORE_INDEX` of the cross-entropy, times `weights` where given (the
    per-token weights of a loss mode, `<name>_loss_weights`); an exact graph-keeping 0 when there are none.

    (transformers' own causal-LM loss is NaN on a micro-batch without targets, and divides by its own count.)
    """
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_logits = flat_logits if flat_logits.dtype == torch.float64 else flat_logits.float()
    if weights is None:
        total = F.cross_entropy(flat_logits, labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")
    else:
        per_token = F.cross_entropy(flat_logits, labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="none")
        total = (per_token * weights.reshape(-1).to(per_token.dtype)).sum()
    count = (labels != IGNORE_INDEX).sum()
    return total / count.clamp(min=1)


def decoder_flops_per_token(
    model: nn.Module, num_layers: int, hidden_size: int, seq_len: int, exclude: Iterable[Tensor] = ()
) -> float:
    """6N + 12 L d T (the PaLM estimate): N = parameters taking part in matmuls, T = sequence length."""
    excluded = {id(p) for p in exclude}
    num_params = sum(p.numel() for p in model.parameters() if id(p) not in excluded)
    return float(6 * num_params + 12 * num_layers * hidden_size * seq_len)
