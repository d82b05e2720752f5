"""The fused LM head + token log-probabilities and entropies (`linear_token_logprobs`, `lm_head_logprobs`: what the
policy and preference heads read) against the plain head (`F.linear`, then `token_logprobs`) in float64: values and
gradients of the hidden states, weight and bias through every combination of the two outputs, at a temperature,
with ignored targets and chunks of every size; the whole transformers models (text, VL, tied embeddings, packed rows)
through `LogprobRequest`; and the memory claim (no [tokens, vocab] tensor; the plain head, the control, makes them).
The policy and preference heads' own fused-vs-unfused checks are in tests/rl and tests/pref."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.models.test_fused_ce import HIDDEN, TOKENS, VOCAB, _head, _labels, _lm, _rel, vl_model_and_batch
from tests.models.test_hf_models import PAD
from tests.models.test_packing import Shapes, text_samples
from veomni_lite.data.collator import pack
from veomni_lite.loss_keys import IGNORE_INDEX
from veomni_lite.models import heads
from veomni_lite.models.fused_ce import linear_token_logprobs
from veomni_lite.models.heads import LogprobRequest, token_logprobs

TOL = 1e-11


def _objective(logp: torch.Tensor, entropy: torch.Tensor | None, seed: int = 5) -> torch.Tensor:
    """A loss of both outputs with random per-token coefficients, so every gradient path is exercised."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(logp.shape, generator=g, dtype=logp.dtype)
    out = (a * logp).sum()
    if entropy is not None:
        out = out + (torch.randn(entropy.shape, generator=g, dtype=entropy.dtype) * entropy).sum()
    return out


@pytest.mark.parametrize("chunk", [1, 7, TOKENS, 10 * TOKENS])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("entropy", [False, True])
def test_values_and_gradients_equal_the_plain_head(chunk, temperature, entropy):
    labels = _labels()
    results = []
    for fused in (True, False):
        hidden, weight, bias = _head()
        if fused:
            logp, ent = linear_token_logprobs(hidden, weight, labels, bias, temperature, entropy, chunk_tokens=chunk)
        else:
            logp, ent = token_logprobs(F.linear(hidden, weight, bias), labels, temperature, entropy)
        assert (ent is None) == (not entropy)
        grads = torch.autograd.grad(_objective(logp, ent), [hidden, weight, bias])
        results.append((logp.detach(), None if ent is None else ent.detach(), grads))
    (logp, ent, grads), (plain_logp, plain_ent, plain_grads) = results
    assert torch.equal(logp == 0, plain_logp == 0) and bool((logp[labels == IGNORE_INDEX] == 0).all())
    assert _rel(logp, plain_logp) < TOL
    if entropy:
        assert _rel(ent, plain_ent) < TOL
    for got, want in zip(grads, plain_grads):
        assert _rel(got, want) < TOL


def test_an_unused_entropy_costs_no_gradient_and_a_used_one_changes_it():
    """Negative control of the entropy's backward: the gradient with the entropy in the objective differs from the
    one without (so the test above would see a dropped entropy gradient)."""
    labels = _labels()
    hidden, weight, bias = _head()
    logp, ent = linear_token_logprobs(hidden, weight, labels, bias, 0.9, entropy=True, chunk_tokens=16)
    only_logp = torch.autograd.grad(_objective(logp, None), weight, retain_graph=True)[0]
    both = torch.autograd.grad(_objective(logp, ent), weight)[0]
    assert _rel(both, only_logp) > 1e-3


def test_no_target_gives_exact_zeros_and_zero_gradients():
    hidden, weight, bias = _head()
    labels = torch.full((3, TOKENS // 3), IGNORE_INDEX)
    logp, _ = linear_token_logprobs(hidden, weight, labels, bias)
    assert torch.equal(logp, torch.zeros_like(logp))
    grads = torch.autograd.grad(logp.sum(), [hidden, weight, bias])
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)


@pytest.mark.parametrize("fused", [True, False])
def test_no_tensor_of_the_whole_logits_size_is_created(fused):
    hidden, weight, bias = _head()
    labels = _labels()
    with Shapes() as recorder:
        if fused:
            logp, ent = linear_token_logprobs(hidden, weight, labels, bias, 0.8, entropy=True, chunk_tokens=16)
        else:  # the control: the plain head builds the logits and their gradient whole
            logp, ent = token_logprobs(F.linear(hidden, weight, bias), labels, 0.8, entropy=True)
        _objective(logp, ent).backward()
    largest = max(torch.Size(shape).numel() for shape in recorder.shapes)
    if fused:
        assert largest <= max(16 * VOCAB, VOCAB * HIDDEN), sorted(recorder.shapes, key=torch.Size.numel)[-3:]
    else:
        assert largest >= TOKENS * VOCAB


def _model_outputs(model: torch.nn.Module, batch: dict, request: LogprobRequest, fused: bool) -> tuple:
    model.zero_grad()
    model.fused_lm_head = fused
    inputs = {k: v for k, v in batch.items() if "labels" not in k}
    out = model(**inputs, logprobs=request)
    _objective(out["logprobs"], out.get("entropy")).backward()
    grads = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in model.parameters()]
    return out["logprobs"].detach(), out.get("entropy"), grads


@pytest.mark.parametrize("tied", [False, True])
def test_the_causal_lm_gives_the_plain_heads_logprobs_on_packed_rows(tied):
    model = _lm(tied)
    samples = text_samples()
    samples[1]["labels"] = torch.full_like(samples[1]["labels"], IGNORE_INDEX)
    batch = pack(samples, pad_to_multiple_of=8, pad_id=PAD)
    request = LogprobRequest(batch["labels"], temperature=0.6, entropy=True)
    fused = _model_outputs(model, batch, request, True)
    plain = _model_outputs(model, batch, request, False)
    assert _rel(fused[0], plain[0]) < TOL and _rel(fused[1].detach(), plain[1].detach()) < TOL
    for got, want in zip(fused[2], plain[2]):
        assert _rel(got, want) < TOL


def test_qwen2_vl_logprobs_are_fused_by_default_and_equal_the_plain_ones(monkeypatch):
    model, batch = vl_model_and_batch()
    calls: list[int] = []
    original = heads.linear_token_logprobs
    monkeypatch.setattr(heads, "linear_token_logprobs", lambda *a, **k: calls.append(1) or original(*a, **k))
    request = LogprobRequest(batch["labels"], entropy=True)
    fused = _model_outputs(model, batch, request, True)
    assert calls == [1], "fused by default"
    plain = _model_outputs(model, batch, request, False)
    assert _rel(fused[0], plain[0]) < TOL
    for got, want in zip(fused[2], plain[2]):
        assert _rel(got, want) < TOL


@pytest.mark.parametrize("bias", [True, False])
def test_mean_logits_fused_equal_the_plain_heads_and_leave_the_logprobs_and_gradients_alone(bias):
    """`LogprobRequest(mean_logits=True)` (KTO's `logits/*`): the fused head's hidden . mean(W) + mean(b) equals the
    mean over the vocabulary of the whole logits, detached, and the log-probabilities and their gradients are those
    of a request without it."""
    labels = _labels()
    hidden, weight, b = _head(bias=bias)
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=bias, dtype=torch.float64)
    with torch.no_grad():
        head.weight.copy_(weight)
        if bias:
            head.bias.copy_(b)
    outputs = {}
    for fused in (True, False):
        for mean in (True, False):
            out = heads.lm_head_logprobs(head, hidden, LogprobRequest(labels, mean_logits=mean), fused)
            assert ("mean_logits" in out) == mean
            grad = torch.autograd.grad(_objective(out["logprobs"], None), [hidden])[0]
            outputs[fused, mean] = (out["logprobs"].detach(), grad, out.get("mean_logits"))
    plain = head(hidden).detach().mean(-1)
    for fused in (True, False):
        logp, grad, mean_logits = outputs[fused, True]
        assert not mean_logits.requires_grad and _rel(mean_logits, plain) < TOL
        assert torch.equal(logp, outputs[fused, False][0]) and torch.equal(grad, outputs[fused, False][1])
