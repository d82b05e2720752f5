"""Shared prefixes in packed rows (`pack(..., share_prefixes=True)`): consecutive samples keep their common untrained
first tokens once, and every trained position computes what it computes unshared, logits and gradients (float64,
one process). Negative controls: a branch that does not see its prefix, or restarts its positions, differs."""

from __future__ import annotations

import pytest
import torch

from tests.models import varlen_reference
from tests.models.test_hf_models import PAD, VOCAB, float64_norms, make_lm
from veomni_lite.data.collator import pack, shared_prefixes
from veomni_lite.loss_keys import ATTENTION_SEQUENCE_IDS, IGNORE_INDEX, SEQUENCE_IDS
from veomni_lite.models import hf_attention
from veomni_lite.models.hf_attention import packed_segments


def sample(ids: list[int], prompt: int) -> dict[str, torch.Tensor]:
    """`ids` whose first `prompt` tokens train nothing."""
    input_ids = torch.tensor(ids)
    labels = input_ids.clone()
    labels[:prompt] = IGNORE_INDEX
    return {"input_ids": input_ids, "labels": labels}


def groups_of_prompts(seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Two prompts with three and two responses, then a lone sample: what an RL micro-batch or two preference pairs
    hold."""
    g = torch.Generator().manual_seed(seed)

    def tokens(n: int) -> list[int]:
        return torch.randint(10, VOCAB, (n,), generator=g).tolist()

    first, second = tokens(9), tokens(6)
    return [
        *(sample(first + tokens(n), 9) for n in (4, 7, 1)),
        *(sample(second + tokens(n), 6) for n in (5, 3)),
        sample(tokens(8), 3),
    ]


def test_the_prefix_is_kept_once_and_each_branch_starts_at_its_last_untrained_token():
    samples = [sample([1, 2, 3, 4, 5, 6], 4), sample([1, 2, 3, 4, 7, 8, 9], 4), sample([5, 5, 5], 1)]
    assert shared_prefixes(samples) == [(2, 3), (1, 0)]
    batch = pack(samples, pad_to_multiple_of=4, pad_id=0, share_prefixes=True)
    # the lone sample first (sample 2), then the prefix and the two branches (samples 0 and 1), then the padding
    assert batch["input_ids"].tolist() == [[5, 5, 5, 1, 2, 3, 4, 5, 6, 4, 7, 8, 9, 0, 0, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 4, 5, 3, 4, 5, 6, 7, 8, 9]]
    assert batch[SEQUENCE_IDS].tolist() == [[2, 2, 2, -2, -2, -2, 0, 0, 0, 1, 1, 1, 1, -1, -1, -1]]
    assert batch[ATTENTION_SEQUENCE_IDS].tolist() == [[2, 2, 2, -2, -2, -2, 0, 0, 0, 1, 1, 1, 1, -1, -1, -1]]
    ignore = IGNORE_INDEX
    assert batch["labels"].tolist() == [[5, 5, ignore] + [ignore] * 3 + [5, 6, ignore, 7, 8, 9] + [ignore] * 4]
    # a sample trained from its first target on shares nothing
    trained = [sample([1, 2, 3], 0), sample([1, 2, 3], 0)]
    assert shared_prefixes(trained) == [(1, 0), (1, 0)]
    # a third sample sharing less than the group's prefix starts its own group (here a lone one)
    assert shared_prefixes([*samples[:2], sample([1, 2, 9, 9], 3)]) == [(2, 3), (1, 0)]
    assert shared_prefixes([*samples[:2], sample([1, 2, 3, 4, 0], 4)]) == [(3, 3)]
    unshared, kept = pack(samples), pack(samples, share_prefixes=True)
    assert (unshared["input_ids"].shape[1], kept["input_ids"].shape[1]) == (6 + 7 + 3, 6 + 7 + 3 - 3)
    assert (unshared[ATTENTION_SEQUENCE_IDS] >= -1).all(), "unshared, no prefix ids"


def tree_mask(attention_ids: torch.Tensor) -> torch.Tensor:
    """The reference: [B, 1, S, S] bool, written from the definition: query q attends key k <= q of its own run, or of
    the prefix run (id <= -2) its sample run continues (the nearest prefix before it with only samples between)."""
    rows, length = attention_ids.shape
    mask = torch.zeros(rows, 1, length, length, dtype=torch.bool)
    for b in range(rows):
        ids = attention_ids[b].tolist()
        for q in range(length):
            prefix = None
            if ids[q] >= 0:
                j = q
                while j >= 0 and ids[j] >= 0:
                    j -= 1
                prefix = ids[j] if j >= 0 and ids[j] <= -2 else None
            for k in range(q + 1):
                mask[b, 0, q, k] = ids[k] == ids[q] or (prefix is not None and ids[k] == prefix)
    return mask


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_segment_attention_with_shared_prefixes_equals_sdpa_under_the_tree_mask(kv_heads):
    g = torch.Generator().manual_seed(0)
    samples = groups_of_prompts()
    rows = torch.cat(
        [pack(samples, pad_to_multiple_of=64, share_prefixes=True)[ATTENTION_SEQUENCE_IDS],
         pack(samples[2:], pad_to_multiple_of=64, share_prefixes=True)[ATTENTION_SEQUENCE_IDS]]
    )  # fmt: skip
    length = rows.shape[1]
    q = torch.randn(2, 4, length, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, kv_heads, length, 8, generator=g, dtype=torch.float64) for _ in range(2))
    expand = 4 // kv_heads
    reference = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(expand, 1), v.repeat_interleave(expand, 1), attn_mask=tree_mask(rows)
    ).transpose(1, 2)
    ours = hf_attention.segment_attention(q, k, v, packed_segments(rows, torch.device("cpu")))
    assert (ours - reference).abs().max() < 1e-14
    alone = rows.clamp(min=-1)  # the prefixes as padding: the branches no longer see them
    cut = hf_attention.segment_attention(q, k, v, packed_segments(alone, torch.device("cpu")))
    assert (cut - reference).abs().max() > 1e-3


def trained_outputs(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(the logits at the trained positions, sample by sample; the gradient of their summed cross-entropy,
    flattened)."""
    model.zero_grad()
    logits = model(**{k: v for k, v in batch.items() if k != "labels"})["logits"][0]
    labels, ids = batch["labels"][0], batch[SEQUENCE_IDS][0]
    trained = labels != IGNORE_INDEX
    loss = torch.nn.functional.cross_entropy(logits[trained], labels[trained], reduction="sum")
    loss.backward()
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    by_sample = [logits[trained & (ids == sid)] for sid in range(int(ids.max()) + 1)]
    return torch.cat(by_sample).detach(), grads


def test_shared_prefix_logits_and_gradients_equal_the_unshared_and_the_controls_differ():
    model = float64_norms(make_lm().double())
    samples = groups_of_prompts()
    plain = pack(samples, pad_id=PAD)
    shared = pack(samples, pad_id=PAD, share_prefixes=True)
    saved = plain["input_ids"].shape[1] - shared["input_ids"].shape[1]
    assert saved == 2 * 8 + 5, "each extra response keeps its prompt but the last token once"
    want_logits, want_grads = trained_outputs(model, plain)
    logits, grads = trained_outputs(model, shared)
    assert logits.shape == want_logits.shape
    assert (logits - want_logits).abs().max() / want_logits.abs().max() < 1e-12
    assert (grads - want_grads).abs().max() / want_grads.abs().max() < 1e-12

    restarted = dict(shared)  # a branch's positions restarting at 0, as a plain packed sample's would
    positions = shared["position_ids"].clone()
    for sid in range(len(samples)):
        where = shared[SEQUENCE_IDS][0] == sid
        positions[0, where] = torch.arange(int(where.sum()))
    restarted["position_ids"] = positions
    cut = {**shared, ATTENTION_SEQUENCE_IDS: shared[ATTENTION_SEQUENCE_IDS].clamp(min=-1)}
    for name, control in (("positions restarted", restarted), ("prefix not attended", cut)):
        leaked, _ = trained_outputs(model, control)
        difference = float((leaked - want_logits).abs().max() / want_logits.abs().max())
        print(f"\nshared-prefix control {name!r}: relative logit difference {difference:.3f}")
        assert difference > 1e-3, name


def test_flash_attention_refuses_a_row_with_shared_prefixes():
    varlen_reference.register()
    try:
        model = make_lm()
        model.config._attn_implementation = varlen_reference.VarlenReference.name
        batch = pack(groups_of_prompts(), share_prefixes=True)
        with pytest.raises(ValueError, match=r"shared prefixes \(data.shared_prefix\) need SDPA"):
            model(**{k: v for k, v in batch.items() if k != "labels"})
    finally:
        varlen_reference.unregister()
