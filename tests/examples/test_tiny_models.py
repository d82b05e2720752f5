from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from examples.attention import causal_attention
from examples.synthetic_data import SyntheticVLMDataset
from examples.tiny_lm import TinyCausalLM, TinyLMConfig, set_attention_fn
from examples.tiny_vlm import TinyVLM, TinyVLMConfig
from veomni_lite.data.collator import collate
from veomni_lite.loss_keys import IGNORE_INDEX

LM_CONFIG = TinyLMConfig(vocab_size=32, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64)


def make_lm(seed: int = 0) -> TinyCausalLM:
    torch.manual_seed(seed)
    return TinyCausalLM(LM_CONFIG)


def make_vlm(dataset: SyntheticVLMDataset, seed: int = 0) -> TinyVLM:
    torch.manual_seed(seed)
    lm = TinyLMConfig(vocab_size=dataset.vocab_size, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64)
    config = TinyVLMConfig(
        lm=lm,
        image_size=dataset.image_size,
        patch_size=dataset.patch_size,
        num_image_codes=dataset.num_image_codes,
        vision_hidden_size=32,
        image_token_id=dataset.image_token_id,
    )
    return TinyVLM(config)


def text_batch(batch: int = 3, seq: int = 10, seed: int = 1) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, LM_CONFIG.vocab_size, (batch, seq), generator=g)
    labels = torch.randint(0, LM_CONFIG.vocab_size, (batch, seq), generator=g)
    labels[:, -3:] = IGNORE_INDEX
    return {"input_ids": input_ids, "labels": labels, "position_ids": torch.arange(seq).expand(batch, seq)}


class Capture:
    """An attention fn that records its inputs and counts calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[Tensor, Tensor, Tensor]] = []

    def __call__(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        self.calls.append((q.detach(), k.detach(), v.detach()))
        return causal_attention(q, k, v)


def test_causal_attention_matches_reference() -> None:
    q, k, v = torch.randn(3, 2, 5, 4, 8).unbind(0)  # [B, S, H, D]
    out = causal_attention(q, k, v)
    assert out.shape == (2, 5, 4, 8)
    scores = torch.einsum("bshd,bthd->bhst", q, k) / 8**0.5
    scores = scores.masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), float("-inf"))
    expected = torch.einsum("bhst,bthd->bshd", scores.softmax(-1), v)
    torch.testing.assert_close(out, expected)


def test_lm_shapes_and_keys() -> None:
    model = make_lm()
    batch = text_batch()
    assert model(batch["input_ids"], batch["position_ids"])["logits"].shape == (3, 10, LM_CONFIG.vocab_size)
    out = model(**batch)
    assert tuple(out) == model.loss_keys == ("foundation_loss",)
    assert out["foundation_loss"].shape == ()
    assert len(model.layers) == LM_CONFIG.num_layers


def test_lm_loss_matches_cross_entropy() -> None:
    model = make_lm()
    batch = text_batch()
    logits = model(batch["input_ids"], batch["position_ids"])["logits"]
    expected = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE_INDEX)
    torch.testing.assert_close(model(**batch)["foundation_loss"], expected)


def test_lm_all_ignored_loss_is_exact_zero_with_finite_grads() -> None:
    model = make_lm()
    batch = text_batch()
    batch["labels"] = torch.full_like(batch["labels"], IGNORE_INDEX)
    loss = model(**batch)["foundation_loss"]
    assert loss.requires_grad and torch.equal(loss.detach(), torch.tensor(0.0))
    loss.backward()
    for p in model.parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and not p.grad.any()


def test_lm_attention_inputs_of_a_slice_match_the_full_sequence() -> None:
    """Under SP a rank sees a slice with global positions: q, k, v of layer 0 must equal the full run's slice."""
    model = make_lm()
    batch = text_batch()
    full, part = Capture(), Capture()
    set_attention_fn(model, full)
    model(batch["input_ids"], batch["position_ids"])
    set_attention_fn(model, part)
    model(batch["input_ids"][:, 4:8], batch["position_ids"][:, 4:8])
    for full_t, part_t in zip(full.calls[0], part.calls[0]):
        torch.testing.assert_close(part_t, full_t[:, 4:8])
    # A prefix needs no other shard, so its outputs match exactly (causality).
    prefix = model(batch["input_ids"][:, :6], batch["position_ids"][:, :6])["logits"]
    torch.testing.assert_close(prefix, model(batch["input_ids"], batch["position_ids"])["logits"][:, :6])


def test_position_ids_are_used_not_recomputed() -> None:
    model = make_lm()
    batch = text_batch()
    capture = Capture()
    set_attention_fn(model, capture)
    ids = batch["input_ids"][:, :4]
    model(ids, torch.arange(4).expand(3, 4))
    model(ids, torch.arange(20, 24).expand(3, 4))
    assert not torch.allclose(capture.calls[0][0], capture.calls[2][0])  # layer-0 q differs with position


def test_set_attention_fn_replaces_every_layer() -> None:
    model = make_lm()
    capture = Capture()
    assert set_attention_fn(model, capture) == LM_CONFIG.num_layers
    batch = text_batch()
    model(**batch)
    assert len(capture.calls) == LM_CONFIG.num_layers
    q = capture.calls[0][0]
    assert q.shape == (3, 10, LM_CONFIG.num_heads, LM_CONFIG.head_dim)
    with pytest.raises(ValueError, match="no Attention"):
        set_attention_fn(torch.nn.Linear(2, 2), capture)


def plain_causal_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Causal attention as two explicit batched matmuls over the whole [S, S] score matrix (what 12 L d T counts)."""
    s = q.shape[1]
    scores = torch.einsum("bshd,bthd->bhst", q, k) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("bhst,bthd->bshd", scores.softmax(-1), v)


def counted_flops_per_token(model: TinyCausalLM, seq: int) -> float:
    """torch's FlopCounterMode over one forward + backward of a [1, seq] batch, per token: every matmul, counted."""
    from torch.utils.flop_counter import FlopCounterMode

    ids = torch.randint(0, LM_CONFIG.vocab_size, (1, seq), generator=torch.Generator().manual_seed(seq))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=ids, position_ids=torch.arange(seq)[None])["foundation_loss"].backward()
    return counter.get_total_flops() / seq


@pytest.mark.parametrize("frozen_head", [False, True])
@pytest.mark.parametrize("seq", [16, 64])
def test_flops_per_token_matches_a_count_of_the_matmuls(seq: int, frozen_head: bool) -> None:
    """The estimate against torch's own count of every matmul in a forward + backward. The estimate also counts the
    norm weights at 6 FLOPs each (they take part in no matmul), so exactly that much is the difference; a frozen
    parameter (the LM head here) has no weight gradient and counts 4."""
    model = make_lm()
    set_attention_fn(model, plain_causal_attention)
    model.lm_head.weight.requires_grad_(not frozen_head)
    norms = sum(p.numel() for name, p in model.named_parameters() if "norm" in name)
    counted = counted_flops_per_token(model, seq)
    assert model.flops_per_token(seq) - 6 * norms == counted
    # negative controls: the count does see what the formula's terms stand for
    unfrozen = make_lm()
    set_attention_fn(unfrozen, plain_causal_attention)
    head = model.lm_head.weight.numel()
    assert counted_flops_per_token(unfrozen, seq) - counted == (2 * head if frozen_head else 0)
    d, layers = LM_CONFIG.hidden_size, LM_CONFIG.num_layers
    assert counted_flops_per_token(unfrozen, 2 * seq) - counted_flops_per_token(unfrozen, seq) == 12 * layers * d * seq


def vlm_batch(dataset: SyntheticVLMDataset, indices: range) -> dict[str, Tensor]:
    return collate([dataset[i] for i in indices])


def test_vlm_shapes_loss_keys_and_reference_losses() -> None:
    dataset = SyntheticVLMDataset(num_samples=16)
    model = make_vlm(dataset)
    batch = vlm_batch(dataset, range(6))
    out = model(batch["input_ids"], batch["position_ids"], batch["pixel_values"])
    b, s = batch["input_ids"].shape
    assert out["logits"].shape == (b, s, dataset.vocab_size)
    assert out["image_logits"].shape == (b, s, dataset.num_image_codes)
    losses = model(**batch)
    assert tuple(losses) == model.loss_keys == ("foundation_loss", "image_decoder_loss")
    for key, logits, labels in (
        ("foundation_loss", out["logits"], batch["labels"]),
        ("image_decoder_loss", out["image_logits"], batch["image_decoder_labels"]),
    ):
        assert (labels != IGNORE_INDEX).any()
        expected = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
        torch.testing.assert_close(losses[key], expected)
    assert model.flops_per_token(s) > 0


def test_vlm_head_without_targets_gives_exact_zero_with_finite_grads() -> None:
    dataset = SyntheticVLMDataset(num_samples=8, generation_ratio=0.0)  # understanding only: no image codes
    model = make_vlm(dataset)
    batch = vlm_batch(dataset, range(2))
    losses = model(**batch)
    assert torch.equal(losses["image_decoder_loss"].detach(), torch.tensor(0.0))
    assert losses["image_decoder_loss"].requires_grad and losses["foundation_loss"] > 0
    batch["labels"] = torch.full_like(batch["labels"], IGNORE_INDEX)
    losses = model(**batch)
    total = losses["foundation_loss"] + losses["image_decoder_loss"]
    assert torch.equal(total.detach(), torch.tensor(0.0))
    total.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    # A missing label key counts as all-ignored; both keys are still returned.
    del batch["image_decoder_labels"]
    assert set(model(**batch)) == {"foundation_loss", "image_decoder_loss"}


def test_vlm_fills_placeholders_by_global_position() -> None:
    dataset = SyntheticVLMDataset(num_samples=8, generation_ratio=0.0)
    model = make_vlm(dataset)
    batch = vlm_batch(dataset, range(2))
    embeds = model.embed(batch["input_ids"], batch["position_ids"], batch["pixel_values"])
    features = model.image_features(batch["pixel_values"])
    num_patches = dataset.num_patches
    torch.testing.assert_close(embeds[:, 1 : 1 + num_patches], features)
    text = model.decoder.embed(batch["input_ids"])
    torch.testing.assert_close(embeds[:, 0], text[:, 0])
    torch.testing.assert_close(embeds[:, 1 + num_patches :], text[:, 1 + num_patches :])


@pytest.mark.parametrize(("s0", "s1"), [(0, 5), (5, 11), (11, 22), (3, 19)])
def test_vlm_slice_matches_full_sequence(s0: int, s1: int) -> None:
    """SP property: embeddings and layer-0 q/k/v of a slice equal the full sequence's slice; pixels are not sliced."""
    dataset = SyntheticVLMDataset(num_samples=8, generation_ratio=0.5)
    model = make_vlm(dataset)
    batch = collate([dataset[i] for i in range(4)], pad_to_multiple_of=22)
    ids, pos, pixels = batch["input_ids"], batch["position_ids"], batch["pixel_values"]
    full_embeds = model.embed(ids, pos, pixels)
    torch.testing.assert_close(model.embed(ids[:, s0:s1], pos[:, s0:s1], pixels), full_embeds[:, s0:s1])
    full, part = Capture(), Capture()
    set_attention_fn(model, full)
    model(ids, pos, pixels)
    set_attention_fn(model, part)
    model(ids[:, s0:s1], pos[:, s0:s1], pixels)
    for full_t, part_t in zip(full.calls[0], part.calls[0]):
        torch.testing.assert_close(part_t, full_t[:, s0:s1])


def test_vlm_learns_quickly() -> None:
    dataset = SyntheticVLMDataset(num_samples=16)
    model = make_vlm(dataset)
    batch = vlm_batch(dataset, range(16))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = None
    for _ in range(15):
        losses = model(**batch)
        total = losses["foundation_loss"] + losses["image_decoder_loss"]
        first = total.item() if first is None else first
        optimizer.zero_grad()
        total.backward()
        optimizer.step()
    assert total.item() < 0.6 * first


def test_vlm_config_defaults_fit_the_dataset_defaults() -> None:
    config, dataset = TinyVLMConfig(), SyntheticVLMDataset()
    assert config.lm.vocab_size >= dataset.vocab_size
    assert (config.image_size, config.patch_size, config.num_patches) == (
        dataset.image_size,
        dataset.patch_size,
        dataset.num_patches,
    )
    assert (config.num_image_codes, config.image_token_id) == (dataset.num_image_codes, dataset.image_token_id)
    assert TinyVLMConfig(lm={"vocab_size": 40}).lm.vocab_size == 40
