"""The fused LM head under FSDP2 on 2 real gloo ranks: each block and the root `fully_shard`-ed as the trainer does,
the head's weight is the all-gathered parameter inside forward, and its gradient reaches the shards. Float64 Qwen2
(untied and tied embeddings), each rank its own packed row: the sharded gradients, gathered, equal one process's
plain-head gradient of the two ranks' mean loss. A log-probability pass under FSDP2 returns no view tensor (FSDP2 warns
of one: an in-place op on it would skip the pre-backward hook)."""

from __future__ import annotations

import pytest
import torch

from tests.dist_helpers import run_distributed
from tests.models.test_fused_ce import _lm
from tests.models.test_hf_models import PAD
from tests.models.test_packing import text_samples
from veomni_lite.data.collator import pack
from veomni_lite.models.heads import LogprobRequest

TOL = 1e-12


def _batch(rank: int) -> dict[str, torch.Tensor]:
    return pack(text_samples()[rank::2], pad_to_multiple_of=8, pad_id=PAD)


def _sharded_grads(rank: int, world: int) -> dict[bool, tuple[float, list[torch.Tensor]]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from veomni_lite.models import heads

    calls: list[int] = []
    original = heads.linear_cross_entropy
    heads.linear_cross_entropy = lambda *a, **k: calls.append(1) or original(*a, **k)
    out = {}
    mesh = init_device_mesh("cpu", (world,))
    for tied in (False, True):
        model = _lm(tied)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        assert model.fused_lm_head
        loss = model(**_batch(rank))["foundation_loss"]
        loss.backward()
        out[tied] = (float(loss.detach()), [p.grad.full_tensor() for p in model.parameters()])
    assert calls == [1, 1], "the head went through the fused path"
    return out


@pytest.mark.slow
def test_fused_head_under_fsdp2_gives_the_plain_heads_gradients():
    ranks = run_distributed(_sharded_grads, 2)
    for tied in (False, True):
        model = _lm(tied)
        model.fused_lm_head = False
        losses = [model(**_batch(rank))["foundation_loss"] for rank in range(2)]
        (sum(losses) / 2).backward()  # FSDP2 averages the ranks' gradients
        for rank, loss in enumerate(losses):
            assert abs(ranks[rank][tied][0] - float(loss.detach())) < TOL * abs(float(loss.detach()))
        for name_param, got in zip(model.named_parameters(), ranks[0][tied][1]):
            name, param = name_param
            scale = param.grad.abs().max()
            assert float((got - param.grad).abs().max()) <= TOL * float(scale), (tied, name)


@pytest.mark.slow
def test_split_invariance_with_the_fused_head_unpacked_in_every_mode():
    """The harness on padded micro-batches (GA 8 x 1, DP=2, SP=2, DP=2 x SP=2) for every mode, the fused head on (the
    packed layouts run in tests/distributed/test_packing_distributed.py, fused too, as the default)."""
    from tests.distributed import packing_fixtures as fx
    from tests.distributed.test_packing_distributed import TEXT_MODES
    from veomni_lite.split_invariance import check_split_invariance, default_layouts

    assert fx.build_text().fused_lm_head
    report = check_split_invariance(fx.build_text, fx.text_samples(), fx.collate_text, TEXT_MODES, default_layouts(8))
    print(f"\nfused head, padded layouts:\n{report}")
    assert report.worst() < 1e-10


VIEW_WARNING = "returned a view tensor"


def _fsdp2_warnings(rank: int, world: int) -> dict[str, list[str]]:
    """FSDP2's warnings of a log-probability forward/backward of the fused-head model (each block and the root
    sharded) and, the control, of a sharded module that returns a view."""
    import warnings

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    class ViewReturning(torch.nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x).view(-1)

    mesh = init_device_mesh("cpu", (world,))
    model, control = _lm(False), ViewReturning(4, 4)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    fully_shard(control, mesh=mesh)
    batch = _batch(rank)
    request = LogprobRequest(labels=batch.pop("labels"), entropy=True, mean_logits=True)
    seen = {}
    for name, run in (("model", lambda: sum(v.sum() for v in model(**batch, logprobs=request).values())),
                      ("control", lambda: control(torch.ones(2, 4)).sum())):  # fmt: skip
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run().backward()
        seen[name] = [str(w.message) for w in caught]
    assert model.fused_lm_head and all(p.grad is not None for p in model.parameters())
    return seen


@pytest.mark.slow
def test_a_logprob_pass_under_fsdp2_returns_no_view_tensor():
    (seen,) = run_distributed(_fsdp2_warnings, 1)
    assert any(VIEW_WARNING in message for message in seen["control"]), seen["control"]  # the check sees one
    assert not [message for message in seen["model"] if VIEW_WARNING in message]
