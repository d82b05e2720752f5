"""A stand-in for flash-attention's varlen kernel on the CPU, importable by spawned processes: `VarlenReference`,
registered under a test name that the models and transformers' mask code take for flash-attention."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


class VarlenReference:
    """Takes packed rows as flash-attention's varlen kernel does: no mask, `cu_seq_lens_q/k` and `max_length_q/k`;
    causal SDPA within each span (each row one span without them). `use_boundaries=False` is the negative control
    (one causal span over the whole row)."""

    name = "varlen_reference"

    def __init__(self, use_boundaries: bool = True) -> None:
        self.use_boundaries = use_boundaries
        self.calls: list[tuple[list[int], Any]] = []

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        assert attention_mask is None
        repeats = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(repeats, dim=1), value.repeat_interleave(repeats, dim=1)
        bounds = kwargs.get("cu_seq_lens_q")
        if bounds is None:  # unpacked: plain causal attention over each row
            out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling)
            return out.transpose(1, 2).contiguous(), None
        assert bounds.dtype == torch.int32 and torch.equal(bounds, kwargs["cu_seq_lens_k"])
        assert kwargs["max_length_q"] == kwargs["max_length_k"]
        self.calls.append((bounds.tolist(), kwargs["max_length_q"]))
        spans = bounds.tolist() if self.use_boundaries else [0, query.shape[2]]
        out = torch.cat(
            [
                F.scaled_dot_product_attention(
                    query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], is_causal=True, scale=scaling
                )
                for a, b in zip(spans[:-1], spans[1:])
            ],
            dim=2,
        )
        return out.transpose(1, 2).contiguous(), None


def register(use_boundaries: bool = True) -> VarlenReference:
    """Register a `VarlenReference` with transformers' attention and mask registries (as flash-attention) and add its
    name to the models' `VARLEN_ATTENTION`, in this process; returns it. A test undoes it with `unregister`."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    from veomni_lite.models import hf_attention

    attention = VarlenReference(use_boundaries)
    AttentionInterface.register(VarlenReference.name, attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(VarlenReference.name, ALL_MASK_ATTENTION_FUNCTIONS["flash_attention_2"])
    hf_attention.VARLEN_ATTENTION.add(VarlenReference.name)
    return attention


def unregister() -> None:
    """Undo `register` in this process."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    from veomni_lite.models import hf_attention

    ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.pop(VarlenReference.name, None)
    hf_attention.VARLEN_ATTENTION.discard(VarlenReference.name)
