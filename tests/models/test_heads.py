"""The loss heads' cross-entropy, chunked over tokens: the same per-token values and gradients as one unchunked call,
and no float32 tensor of the whole micro-batch's size kept for backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from veomni_lite.loss_keys import IGNORE_INDEX
from veomni_lite.models.heads import token_cross_entropy

TOKENS, VOCAB = 96, 500


def _inputs(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, TOKENS // 2, VOCAB, generator=generator, dtype=torch.float64).to(dtype)
    labels = torch.randint(0, VOCAB, (2, TOKENS // 2), generator=generator)
    labels[0, :7] = IGNORE_INDEX
    return logits.requires_grad_(), labels


@pytest.mark.parametrize("chunk", [0, 16, 40, TOKENS])
def test_chunked_cross_entropy_equals_the_plain_one(chunk):
    logits, labels = _inputs(torch.float64)
    weights = torch.rand(labels.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    expected = F.cross_entropy(logits.detach().reshape(-1, VOCAB), labels.reshape(-1), reduction="none")
    per_token = token_cross_entropy(logits, labels, chunk_tokens=chunk)
    assert torch.equal(per_token.detach(), expected), "per-token values are those of one unchunked call"
    (per_token * weights.reshape(-1)).sum().backward()
    reference = logits.detach().clone().requires_grad_()
    F.cross_entropy(reference.reshape(-1, VOCAB), labels.reshape(-1), reduction="none").mul(
        weights.reshape(-1)
    ).sum().backward()
    torch.testing.assert_close(logits.grad, reference.grad, rtol=0, atol=1e-15)


def _saved_bytes_outside_the_logits(chunk: int) -> int:
    """Bytes autograd keeps for backward in tensors that are not views of the logits themselves."""
    logits, labels = _inputs(torch.bfloat16)
    saved = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.untyped_storage().data_ptr() != logits.untyped_storage().data_ptr():
            saved.append(tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = token_cross_entropy(logits, labels, chunk).sum()
    loss.backward()
    return sum(saved)


def test_no_float32_copy_of_the_whole_logits_is_kept_for_backward():
    whole = TOKENS * VOCAB * 4
    assert _saved_bytes_outside_the_logits(0) >= whole, "control: one unchunked call keeps float32 log-probabilities"
    assert _saved_bytes_outside_the_logits(16) < whole / 4
