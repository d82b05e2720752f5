"""The loss contract on real gloo process groups: DP=4 and DP=2 x SP=2, GA 4, two loss keys.

Each rank trains its dp share, SP-sliced, with the plain local-mean cross-entropy (NaN on all-ignored shards),
scales it with `mean_global_loss`, backpropagates, and averages gradients over the mesh as FSDP does. The result
must equal one process's `F.cross_entropy(reduction="mean")` over the whole global batch.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.dist_helpers import counting_calls, run_distributed, run_ranks
from veomni_lite.distributed.parallel_state import get_parallel_state, init_parallel_state
from veomni_lite.distributed.sequence_parallel import slice_micro_batch
from veomni_lite.utils.loss_utils import IGNORE_INDEX, LossKeyMismatchError, count_loss_token, mean_global_loss

VOCAB, HIDDEN, SEQ, GLOBAL_BATCH, GA = 13, 8, 12, 16, 4
HOST_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")


class PerTokenModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1234)
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, VOCAB)
        self.aux_head = torch.nn.Linear(HIDDEN, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, aux_labels: torch.Tensor) -> dict:
        hidden = torch.tanh(self.embed(input_ids))
        ce = lambda logits, target: F.cross_entropy(  # noqa: E731 - the plain mean: NaN when all ignored
            logits.reshape(-1, VOCAB), target.reshape(-1), ignore_index=IGNORE_INDEX
        )
        return {"foundation_loss": ce(self.head(hidden), labels), "aux_loss": ce(self.aux_head(hidden), aux_labels)}


@contextlib.contextmanager
def forbid_host_reads() -> Iterator[list[str]]:
    """Record every .item()/.tolist()/bool()/int()/float() of a tensor (the model's own loss has none)."""
    reads: list[str] = []
    originals = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def recorder(name: str):
        def read(self, *args, **kwargs):
            reads.append(name)
            return originals[name](self, *args, **kwargs)

        return read

    for name in HOST_READS:
        setattr(torch.Tensor, name, recorder(name))
    try:
        yield reads
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def global_batch(step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    input_ids = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=gen)
    aux = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=gen)
    labels[torch.rand(labels.shape, generator=gen) < 0.3] = IGNORE_INDEX
    aux[torch.rand(aux.shape, generator=gen) < 0.7] = IGNORE_INDEX
    labels[0:2, SEQ // 2 :] = IGNORE_INDEX  # an all-ignored second-half shard under SP=2 (mbs 1 and 2)
    aux[0:2, SEQ // 2 :] = IGNORE_INDEX
    labels[4:6] = IGNORE_INDEX  # all-ignored micro-batches
    aux[4:8] = IGNORE_INDEX
    if step == 1:  # a whole step without a single valid token
        labels.fill_(IGNORE_INDEX)
        aux.fill_(IGNORE_INDEX)
    return {"input_ids": input_ids, "labels": labels, "aux_labels": aux}


def reference_grads(step: int) -> tuple[list[torch.Tensor], float]:
    model = PerTokenModel()
    batch = global_batch(step)
    losses = model(**batch)
    total = sum(torch.nan_to_num(v, nan=0.0) for v in losses.values())  # NaN only on the all-ignored step
    total.backward()
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()], float(
        total.detach()
    )


def _train_steps(rank: int, world_size: int, dp_size: int, sp_size: int) -> dict:
    state = init_parallel_state(dp_size, sp_size)
    micro_batch_size = GLOBAL_BATCH // (dp_size * GA)
    out = {"grads": [], "loss": [], "collectives": [], "host_reads": []}
    for step in range(2):
        model = PerTokenModel()
        batch = global_batch(step)
        share = slice(state.dp_rank * GA * micro_batch_size, (state.dp_rank + 1) * GA * micro_batch_size)
        rows = {key: value[share] for key, value in batch.items()}
        micro_batches = [
            slice_micro_batch(
                {key: value[i * micro_batch_size : (i + 1) * micro_batch_size] for key, value in rows.items()},
                state.sp_rank,
                state.sp_size,
            )
            for i in range(GA)
        ]
        with counting_calls(dist, "all_reduce") as collectives, forbid_host_reads() as host_reads:
            step_tokens = count_loss_token(micro_batches)
            step_loss = torch.zeros(())
            for micro_batch in micro_batches:
                scaled = mean_global_loss(model(**micro_batch), count_loss_token(micro_batch), step_tokens)
                loss = sum(scaled.values())
                loss.backward()
                step_loss = step_loss + loss.detach()
        out["collectives"].append(len(collectives))
        out["host_reads"].append(len(host_reads))
        grads = []
        for param in model.parameters():
            grad = param.grad if param.grad is not None else torch.zeros_like(param)
            dist.all_reduce(grad)  # FSDP/DDP average over the dp x sp mesh
            grads.append(grad / world_size)
        dist.all_reduce(step_loss)
        out["grads"].append(grads)
        out["loss"].append(float(step_loss) / world_size)
    assert get_parallel_state().world_size == world_size
    return out


@pytest.mark.slow
@pytest.mark.parametrize(("dp_size", "sp_size"), [(4, 1), (2, 2)])
def test_gradients_equal_single_process_global_mean(dp_size: int, sp_size: int):
    results = run_distributed(_train_steps, 4, dp_size, sp_size)
    for step in range(2):
        expected, expected_loss = reference_grads(step)
        for rank, out in enumerate(results):
            assert out["collectives"][step] == 1, f"rank {rank} step {step}: {out['collectives'][step]} collectives"
            assert out["host_reads"][step] == 0, f"rank {rank} step {step}: host reads"
            assert out["loss"][step] == pytest.approx(expected_loss, rel=1e-5, abs=1e-7)
            for got, ref in zip(out["grads"][step], expected):
                assert torch.isfinite(got).all()
                torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-7)
                if step == 1:
                    assert torch.equal(got, torch.zeros_like(got))


def _mismatched_keys(rank: int, world_size: int) -> str:
    init_parallel_state(world_size, 1)
    batch = {"labels": torch.tensor([[1, 2, IGNORE_INDEX]]), "aux_labels": torch.tensor([[3, IGNORE_INDEX, 4]])}
    losses = {"foundation_loss": torch.tensor(1.0)}
    if rank == 1:
        losses["aux_loss"] = torch.tensor(2.0)
    try:
        mean_global_loss(losses, count_loss_token(batch), count_loss_token(batch))
    except LossKeyMismatchError as exc:
        return str(exc)
    return "returned a value"


@pytest.mark.slow
def test_ranks_with_different_loss_keys_all_raise_naming_the_keys():
    start = time.monotonic()
    outcomes = run_ranks(_mismatched_keys, 2, timeout_s=60, pg_timeout_s=20)
    assert time.monotonic() - start < 30
    for rank in range(2):
        status, message = outcomes[rank]
        assert status == "ok", message
        assert "loss keys differ across ranks" in message
        assert "rank 0: [['foundation']]" in message
        assert "rank 1: [['aux', 'foundation']]" in message
