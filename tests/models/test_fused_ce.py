"""The fused LM head + cross-entropy (`veomni_lite.models.fused_ce`) against the plain head (`F.linear`, then
`masked_mean_cross_entropy`) in float64: per-token losses, the loss of every loss mode's weights and its gradients of
the hidden states, weight and bias; ignore positions, a micro-batch without targets, tied embeddings, the whole
transformers models. And the memory claim: no tensor of the whole [tokens, vocab] size is ever created (the plain
head, the control, creates them)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.models.test_hf_models import PAD, TEXT_SETTINGS, make_vl, text_sample
from tests.models.test_packing import Shapes, text_samples
from veomni_lite.data.collator import pack
from veomni_lite.loss_keys import IGNORE_INDEX
from veomni_lite.models import heads
from veomni_lite.models.fused_ce import linear_cross_entropy, linear_token_cross_entropy
from veomni_lite.models.heads import masked_mean_cross_entropy, token_cross_entropy
from veomni_lite.models.hf_causal_lm import HFCausalLM, hf_config_from_dict
from veomni_lite.utils.loss_utils import LOSS_MODES, LossModes, mark_sequences

TOKENS, HIDDEN, VOCAB = 3 * 37, 16, 211
TOL = 1e-12


def _head(seed: int = 0, bias: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(3, TOKENS // 3, HIDDEN, generator=g, dtype=torch.float64).requires_grad_()
    weight = torch.randn(VOCAB, HIDDEN, generator=g, dtype=torch.float64).requires_grad_()
    b = torch.randn(VOCAB, generator=g, dtype=torch.float64).requires_grad_() if bias else None
    return hidden, weight, b


def _labels(seed: int = 1) -> torch.Tensor:
    labels = torch.randint(0, VOCAB, (3, TOKENS // 3), generator=torch.Generator().manual_seed(seed))
    labels[0, :9] = IGNORE_INDEX
    labels[1, 20:] = IGNORE_INDEX
    labels[2, -1] = IGNORE_INDEX
    return labels


def _mode_weights(labels: torch.Tensor, mode: str) -> torch.Tensor | None:
    """The per-token weights `mark_sequences` writes for `mode` (rows as sequences); None where the mode has none."""
    batch = mark_sequences({"labels": labels}, LossModes(mode, scale_factor=3.0))
    weights = batch.get("foundation_loss_weights")
    return None if weights is None else weights.double()


def _grads(loss: torch.Tensor, inputs: list[torch.Tensor | None]) -> list[torch.Tensor]:
    leaves = [x for x in inputs if x is not None]
    return list(torch.autograd.grad(loss, leaves))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-300))


@pytest.mark.parametrize("chunk", [1, 7, 64, TOKENS, 10 * TOKENS])
def test_per_token_losses_equal_the_plain_head(chunk):
    hidden, weight, bias = _head()
    labels = _labels()
    ours = linear_token_cross_entropy(hidden, weight, labels, bias, chunk_tokens=chunk)
    reference = token_cross_entropy(F.linear(hidden, weight, bias), labels, chunk_tokens=0)
    assert ours.dtype == torch.float64 and ours.shape == (TOKENS,)
    assert _rel(ours.detach(), reference.detach()) < TOL
    assert torch.equal(ours[labels.reshape(-1) == IGNORE_INDEX], torch.zeros(int((labels == IGNORE_INDEX).sum())))
    upstream = torch.rand(TOKENS, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    for got, want in zip(
        _grads((ours * upstream).sum(), [hidden, weight, bias]),
        _grads((reference * upstream).sum(), [hidden, weight, bias]),
    ):
        assert _rel(got, want) < TOL


@pytest.mark.parametrize("mode", LOSS_MODES)
@pytest.mark.parametrize("bias", [True, False])
def test_every_loss_modes_loss_and_gradients_equal_the_plain_head(mode, bias):
    hidden, weight, b = _head(bias=bias)
    labels = _labels()
    weights = _mode_weights(labels, mode)
    assert (weights is not None) == (mode == "seq-mean-token-mean")
    ours = linear_cross_entropy(hidden, weight, labels, weights, b, chunk_tokens=16)
    reference = masked_mean_cross_entropy(F.linear(hidden, weight, b), labels, weights)
    assert abs(float(ours.detach() - reference.detach())) < TOL * abs(float(reference.detach()))
    for got, want in zip(_grads(ours, [hidden, weight, b]), _grads(reference, [hidden, weight, b])):
        assert _rel(got, want) < TOL
    if weights is not None:  # the control: the weights matter at this tolerance
        unweighted = linear_cross_entropy(hidden, weight, labels, None, b, chunk_tokens=16)
        assert abs(float(unweighted.detach() - reference.detach())) > 1e-3 * abs(float(reference.detach()))


def test_a_micro_batch_without_targets_is_an_exact_zero_with_zero_gradients():
    hidden, weight, bias = _head()
    labels = torch.full((3, TOKENS // 3), IGNORE_INDEX)
    loss = linear_cross_entropy(hidden, weight, labels, torch.ones(labels.shape), bias, chunk_tokens=16)
    assert loss.requires_grad and float(loss) == 0.0
    for grad in _grads(loss, [hidden, weight, bias]):
        assert torch.equal(grad, torch.zeros_like(grad))


def test_tied_embeddings_accumulate_both_uses_into_one_parameter():
    """The weight is the embedding's: the gradient is the embedding's plus the head's, as with the plain head."""
    torch.manual_seed(0)
    embedding = torch.nn.Embedding(VOCAB, HIDDEN, dtype=torch.float64)
    ids, labels = torch.randint(0, VOCAB, (2, 40)), torch.randint(0, VOCAB, (2, 40))
    grads = []
    for fused in (True, False):
        embedding.zero_grad()
        hidden = torch.tanh(embedding(ids))
        if fused:
            loss = linear_cross_entropy(hidden, embedding.weight, labels, chunk_tokens=9)
        else:
            loss = masked_mean_cross_entropy(F.linear(hidden, embedding.weight), labels)
        loss.backward()
        grads.append(embedding.weight.grad.clone())
    assert _rel(grads[0], grads[1]) < TOL


@pytest.mark.parametrize("fused", [True, False])
def test_no_tensor_of_the_whole_logits_size_is_created(fused):
    hidden, weight, bias = _head()
    labels = _labels()
    with Shapes() as recorder:
        if fused:
            loss = linear_cross_entropy(hidden, weight, labels, bias=bias, chunk_tokens=16)
        else:  # the control: the plain head builds the logits and their gradient whole
            loss = masked_mean_cross_entropy(F.linear(hidden, weight, bias), labels)
        loss.backward()
    largest = max(torch.Size(shape).numel() for shape in recorder.shapes)
    if fused:
        assert largest <= max(16 * VOCAB, VOCAB * HIDDEN), sorted(recorder.shapes, key=torch.Size.numel)[-3:]
    else:
        assert largest >= TOKENS * VOCAB


def _lm(tied: bool) -> HFCausalLM:
    torch.manual_seed(0)
    return HFCausalLM.from_config(hf_config_from_dict({**TEXT_SETTINGS, "tie_word_embeddings": tied})).double()


def _model_grads(model: torch.nn.Module, batch: dict[str, torch.Tensor], fused: bool) -> tuple[float, list]:
    model.zero_grad()
    model.fused_lm_head = fused
    loss = sum(model(**batch).values())
    loss.backward()
    return float(loss), [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("mode", LOSS_MODES)
@pytest.mark.parametrize("tied", [False, True])
def test_the_causal_lm_trains_alike_fused_and_unfused_on_packed_rows(mode, tied):
    """Qwen2 (tied embeddings too) on a packed row with a sample without targets, every mode's weights: the loss and
    every parameter's gradient equal the plain head's."""
    model = _lm(tied)
    assert (model.hf_model.lm_head.weight is model.hf_model.get_input_embeddings().weight) == tied
    samples = text_samples()
    samples[1]["labels"] = torch.full_like(samples[1]["labels"], IGNORE_INDEX)
    batch = mark_sequences(pack(samples, pad_to_multiple_of=8, pad_id=PAD), LossModes(mode, scale_factor=3.0))
    fused_loss, fused = _model_grads(model, batch, True)
    plain_loss, plain = _model_grads(model, batch, False)
    assert abs(fused_loss - plain_loss) < TOL * abs(plain_loss)
    for got, want in zip(fused, plain):
        assert _rel(got, want) < TOL


def vl_model_and_batch() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """A float64 Qwen2-VL and a packed micro-batch of image and text samples."""
    from tests.models.test_packing import vl_samples
    from veomni_lite.models.qwen2_vl import collate_qwen2_vl

    samples = [*vl_samples(), text_sample(5, seed=9)]
    samples = [{**s, **({"pixel_values": s["pixel_values"].double()} if "pixel_values" in s else {})} for s in samples]
    return make_vl().double(), collate_qwen2_vl(samples, 6, 2, PAD, packing=True)


def test_qwen2_vl_foundation_head_is_fused_by_default_and_equals_the_plain_one(monkeypatch):
    model, batch = vl_model_and_batch()
    calls: list[int] = []
    original = heads.linear_cross_entropy
    monkeypatch.setattr(heads, "linear_cross_entropy", lambda *a, **k: calls.append(1) or original(*a, **k))
    assert model.fused_lm_head, "on by default"
    with torch.no_grad():
        model(**batch)
    assert calls == [1], "the foundation head is fused by default"
    fused_loss, fused = _model_grads(model, batch, True)
    plain_loss, plain = _model_grads(model, batch, False)
    assert abs(fused_loss - plain_loss) < TOL * abs(plain_loss)
    for got, want in zip(fused, plain):
        assert _rel(got, want) < TOL
