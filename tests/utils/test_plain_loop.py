"""`veomni_lite.plain_loop.normalized`: a loop of one's own trains on each mode's exact value, one all-reduce a step."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.distributed.modes_fixtures import (
    MODE_PLANS,
    SCALE_FACTOR,
    build_model,
    collate_samples,
    hand_reference,
    samples,
)
from veomni_lite.plain_loop import normalized
from veomni_lite.utils import loss_utils
from veomni_lite.utils.loss_utils import LossModes


@pytest.mark.parametrize("plan", MODE_PLANS[:3], ids=lambda plan: "+".join(plan))
def test_a_plain_loop_over_micro_batches_equals_the_hand_written_reference(monkeypatch, plan):
    calls = []
    original = loss_utils.all_reduce
    monkeypatch.setattr(loss_utils, "all_reduce", lambda *a, **k: calls.append(1) or original(*a, **k))
    model = build_model()
    micro_batches = [collate_samples([sample]) for sample in samples()]  # GA 8 x 1 sample
    modes = LossModes(plan[0], {"image_decoder": plan[1]}, SCALE_FACTOR)
    for batch, scale in normalized(micro_batches, modes):
        scale(model(**batch)).backward()
    expected, _ = hand_reference(plan)
    worst = max(float((p.grad - e).abs().max()) for p, e in zip(model.parameters(), expected))
    assert worst < 1e-12 * max(float(e.abs().max()) for e in expected)
    assert len(calls) == 1, "one all-reduce for the whole step"


def test_scale_takes_a_tensor_a_loss_dict_or_an_output_with_loss():
    batch = {"labels": torch.tensor([[1, 2, -100]])}
    ((_, scale),) = list(normalized([batch]))
    loss = torch.tensor(3.0, requires_grad=True)
    assert scale(loss).item() == pytest.approx(3.0)
    assert scale(SimpleNamespace(loss=loss)).item() == pytest.approx(3.0)
    assert scale({"foundation_loss": loss, "logits": torch.zeros(2)}).item() == pytest.approx(3.0)
    with pytest.raises(TypeError, match="not a loss tensor"):
        scale({"logits": torch.zeros(2)})
