"""The loss contract on real gloo process groups: DP=2, DP=4 and DP=2 x SP=2, GA 4, two loss keys.

Each rank trains its dp share, SP-sliced, with the plain local-mean cross-entropy (NaN on all-ignored shards),
scales it with `mean_global_loss`, backpropagates, and averages gradients over the mesh as FSDP does. The result
must equal one process's `F.cross_entropy(reduction="mean")` over the whole global batch, both on the memoized path
and on VeOmni's call sequence (`reduce_global_loss_token` passed as the 4th argument). Ranks whose loss keys change
change alike get exact denominators; one rank alone changing them makes every rank raise, never hang.
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
from veomni_lite.utils.loss_utils import (
    IGNORE_INDEX,
    MAX_LOSS_KEYS,
    LossKeyMismatchError,
    count_loss_token,
    mean_global_loss,
    reduce_global_loss_token,
)

VOCAB, HIDDEN, SEQ, GLOBAL_BATCH, GA = 13, 8, 12, 16, 4
STEPS, EMPTY_STEP = 3, 1
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
def all_reduce_sizes() -> Iterator[list[int]]:
    """The element count of every `dist.all_reduce` buffer issued inside the block."""
    sizes: list[int] = []
    original = dist.all_reduce

    def recorded(tensor: torch.Tensor, *args, **kwargs):
        sizes.append(tensor.numel())
        return original(tensor, *args, **kwargs)

    dist.all_reduce = recorded
    try:
        yield sizes
    finally:
        dist.all_reduce = original


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
    if step == EMPTY_STEP:  # a whole step without a single valid token
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


def rank_micro_batches(step: int) -> list[dict[str, torch.Tensor]]:
    """This rank's GA micro-batches of the global batch: its dp share, SP-sliced."""
    state = get_parallel_state()
    micro_batch_size = GLOBAL_BATCH // (state.dp_size * GA)
    share = slice(state.dp_rank * GA * micro_batch_size, (state.dp_rank + 1) * GA * micro_batch_size)
    rows = {key: value[share] for key, value in global_batch(step).items()}
    return [
        slice_micro_batch(
            {key: value[i * micro_batch_size : (i + 1) * micro_batch_size] for key, value in rows.items()},
            state.sp_rank,
            state.sp_size,
        )
        for i in range(GA)
    ]


def mesh_mean_grads(model: torch.nn.Module) -> list[torch.Tensor]:
    """Gradients averaged over the dp x sp mesh, as FSDP/DDP do."""
    grads = []
    for param in model.parameters():
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        dist.all_reduce(grad)
        grads.append(grad / dist.get_world_size())
    return grads


def _train_steps(rank: int, world_size: int, dp_size: int, sp_size: int) -> dict:
    init_parallel_state(dp_size, sp_size)
    out = {"grads": [], "loss": [], "collectives": [], "host_reads": []}
    for step in range(STEPS):
        model = PerTokenModel()
        micro_batches = rank_micro_batches(step)
        with all_reduce_sizes() as collectives, forbid_host_reads() as host_reads:
            step_tokens = count_loss_token(micro_batches)
            step_loss = torch.zeros(())
            for micro_batch in micro_batches:
                scaled = mean_global_loss(model(**micro_batch), count_loss_token(micro_batch), step_tokens)
                loss = sum(scaled.values())
                loss.backward()
                step_loss = step_loss + loss.detach()
        out["collectives"].append(collectives)
        out["host_reads"].append(len(host_reads))
        out["grads"].append(mesh_mean_grads(model))
        dist.all_reduce(step_loss)
        out["loss"].append(float(step_loss) / world_size)
    assert get_parallel_state().world_size == world_size
    return out


@pytest.mark.slow
@pytest.mark.parametrize(("dp_size", "sp_size"), [(2, 1), (4, 1), (2, 2)])
def test_gradients_equal_single_process_global_mean(dp_size: int, sp_size: int):
    results = run_distributed(_train_steps, dp_size * sp_size, dp_size, sp_size)
    for step in range(STEPS):
        expected, expected_loss = reference_grads(step)
        for rank, out in enumerate(results):
            # One buffer per step: 8 count slots + the 5-element agreement trailer.
            assert out["collectives"][step] == [MAX_LOSS_KEYS + 5], f"rank {rank} step {step}: all_reduce sizes"
            # The verdict, read once from host memory on CPU (on an accelerator it waits for verify_loss_keys).
            assert out["host_reads"][step] == 1, f"rank {rank} step {step}: host reads"
            assert out["loss"][step] == pytest.approx(expected_loss, rel=1e-5, abs=1e-7)
            for got, ref in zip(out["grads"][step], expected):
                assert torch.isfinite(got).all()
                torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-7)
                if step == EMPTY_STEP:
                    assert torch.equal(got, torch.zeros_like(got))


def _veomni_call_sequence(rank: int, world_size: int) -> dict:
    """VeOmni's train_step: count, reduce_global_loss_token once, then mean_global_loss with the 4th argument."""
    init_parallel_state(world_size, 1)
    out = {"memoized": [], "veomni": [], "global_tokens": [], "reduce_calls": [], "loss_calls": []}
    for step in range(2):
        micro_batches = rank_micro_batches(step)

        model = PerTokenModel()
        step_tokens = count_loss_token(micro_batches)
        for micro_batch in micro_batches:
            sum(mean_global_loss(model(**micro_batch), count_loss_token(micro_batch), step_tokens).values()).backward()
        out["memoized"].append(mesh_mean_grads(model))

        model = PerTokenModel()
        step_tokens = count_loss_token(micro_batches)
        with counting_calls(dist, "all_reduce") as reduce_calls:
            global_tokens = reduce_global_loss_token(step_tokens)
        with counting_calls(dist, "all_reduce") as loss_calls:
            for micro_batch in micro_batches:
                scaled = mean_global_loss(
                    model(**micro_batch), count_loss_token(micro_batch), step_tokens, global_tokens
                )
                sum(scaled.values()).backward()
        out["veomni"].append(mesh_mean_grads(model))
        out["global_tokens"].append(global_tokens)
        out["reduce_calls"].append(len(reduce_calls))
        out["loss_calls"].append(len(loss_calls))
    return out


@pytest.mark.slow
def test_veomni_call_sequence_equals_memoized_path_and_single_process_reference():
    results = run_distributed(_veomni_call_sequence, 2)
    for step in range(2):
        batch = global_batch(step)
        expected_tokens = {
            "foundation_tokens": float((batch["labels"] != IGNORE_INDEX).sum()),
            "aux_tokens": float((batch["aux_labels"] != IGNORE_INDEX).sum()),
        }
        expected, _ = reference_grads(step)
        for rank, out in enumerate(results):
            assert out["reduce_calls"][step] == 1, f"rank {rank} step {step}: one packed all-reduce per call"
            assert out["loss_calls"][step] == 0, f"rank {rank} step {step}: the 4th argument needs no collective"
            assert out["global_tokens"][step] == expected_tokens
            assert all(type(value) is float for value in out["global_tokens"][step].values())
            for veomni, memoized, ref in zip(out["veomni"][step], out["memoized"][step], expected):
                assert torch.equal(veomni, memoized), "both forms of T must give the same math"
                torch.testing.assert_close(veomni, ref, rtol=1e-5, atol=1e-7)


def _mismatched_keys(rank: int, world_size: int) -> dict[str, str]:
    """Rank 1 has an extra loss key (memoized path) and an extra `<name>_labels` key (reduce_global_loss_token)."""
    init_parallel_state(world_size, 1)
    batch = {"labels": torch.tensor([[1, 2, IGNORE_INDEX]]), "aux_labels": torch.tensor([[3, IGNORE_INDEX, 4]])}
    losses = {"foundation_loss": torch.tensor(1.0)}
    if rank == 1:
        losses["aux_loss"] = torch.tensor(2.0)
    messages = {}
    try:
        mean_global_loss(losses, count_loss_token(batch), count_loss_token(batch))
        messages["mean_global_loss"] = "returned a value"
    except LossKeyMismatchError as exc:
        messages["mean_global_loss"] = str(exc)
    if rank == 0:
        del batch["aux_labels"]
    try:
        messages["reduce_global_loss_token"] = f"returned {reduce_global_loss_token(count_loss_token(batch))}"
    except LossKeyMismatchError as exc:
        messages["reduce_global_loss_token"] = str(exc)
    return messages


@pytest.mark.slow
def test_ranks_with_different_loss_keys_all_raise_naming_the_keys():
    # A hang would end in the 20 s collective timeout with another error than the ones asserted below.
    outcomes = run_ranks(_mismatched_keys, 2, timeout_s=60, pg_timeout_s=20)
    for rank in range(2):
        status, messages = outcomes[rank]
        assert status == "ok", messages
        message = messages["mean_global_loss"]
        assert "loss keys differ across ranks" in message
        assert "rank 0: [['foundation:token-mean']]" in message
        assert "rank 1: [['aux:token-mean', 'foundation:token-mean']]" in message
        message = messages["reduce_global_loss_token"]
        assert "loss keys differ across ranks" in message
        assert "rank 0: [['foundation_tokens']]" in message
        assert "rank 1: [['aux_tokens', 'foundation_tokens']]" in message
        assert "_labels" in message


SWITCH_WORLD = 3
HUGE = 2**40  # far beyond float32's 2**24: the counts must stay exact in int64


def _switch_batches(rank: int, step: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    batches = []
    for _ in range(GA):
        labels = torch.randint(0, VOCAB, (2, SEQ), generator=gen)
        aux = torch.randint(0, VOCAB, (2, SEQ), generator=gen)
        labels[torch.rand(labels.shape, generator=gen) < 0.3] = IGNORE_INDEX
        aux[torch.rand(aux.shape, generator=gen) < 0.6] = IGNORE_INDEX
        batches.append({"labels": labels, "aux_labels": aux})
    return batches


def _key_switches(rank: int, world_size: int) -> dict:
    """Steps on {aux, foundation}; every rank drops aux at step 3; a step with counts beyond 2**40; then rank 1 ALONE
    returns aux again (every rank must raise). The same for reduce_global_loss_token."""
    init_parallel_state(world_size, 1)
    out: dict = {"sizes": [], "scaled": [], "expected": []}

    def step(index: int, names: tuple[str, ...], huge: bool = False) -> None:
        micro_batches = _switch_batches(rank, index)
        micro_counts = [count_loss_token(batch) for batch in micro_batches]
        if huge:
            micro_counts = [{"foundation_tokens": torch.tensor(HUGE + rank)} for _ in micro_batches]
        with all_reduce_sizes() as sizes:
            step_tokens = (
                count_loss_token(micro_batches) if not huge else {"foundation_tokens": torch.tensor(HUGE + rank)}
            )
            scaled = [
                mean_global_loss(
                    {f"{name}_loss": torch.tensor(1.0, dtype=torch.float64) for name in names}, counts, step_tokens
                )
                for counts in micro_counts
            ]
        out["sizes"].append(sizes)
        totals = {name: step_tokens[f"{name}_tokens"].clone() for name in names}
        for total in totals.values():
            dist.all_reduce(total)  # the reference T, outside the measured block
        out["scaled"].append([{key: float(value) for key, value in s.items()} for s in scaled])
        out["expected"].append(
            [
                {f"{n}_loss": int(c[f"{n}_tokens"]) * world_size / max(int(totals[n]), 1) for n in names}
                for c in micro_counts
            ]
        )

    for index in range(3):
        step(index, ("aux", "foundation"))
    step(3, ("foundation",))  # every rank changes its keys at the same step
    step(4, ("foundation",), huge=True)
    start = time.monotonic()
    try:
        step(5, ("aux", "foundation") if rank == 1 else ("foundation",))
        out["mismatch"] = "returned a value"
    except LossKeyMismatchError as exc:
        out["mismatch"] = str(exc)
    out["mismatch_s"] = time.monotonic() - start

    token_calls = []
    for call in range(2):
        with all_reduce_sizes() as sizes:
            token_calls.append(reduce_global_loss_token({"foundation_tokens": HUGE + rank, "aux_tokens": call}))
        out["sizes"].append(sizes)
    out["token_totals"] = token_calls
    start = time.monotonic()
    try:
        extra = {"image_tokens": 1} if rank == 1 else {}
        reduce_global_loss_token({"foundation_tokens": 1, "aux_tokens": 1, **extra})
        out["token_mismatch"] = "returned a value"
    except LossKeyMismatchError as exc:
        out["token_mismatch"] = str(exc)
    out["token_mismatch_s"] = time.monotonic() - start
    return out


@pytest.fixture(scope="module")
def key_switches() -> list[dict]:
    start = time.monotonic()
    results = run_distributed(_key_switches, SWITCH_WORLD, timeout_s=120, pg_timeout_s=30)
    assert time.monotonic() - start < 100
    return results


@pytest.mark.slow
def test_all_ranks_changing_keys_together_get_exact_denominators(key_switches):
    agreement = MAX_LOSS_KEYS + 5
    for rank, out in enumerate(key_switches):
        assert out["sizes"][:5] == [[agreement]] * 5, f"rank {rank}: one agreement buffer per step"
        for step in range(5):
            for got, expected in zip(out["scaled"][step], out["expected"][step], strict=True):
                assert got.keys() == expected.keys()
                for key in got:
                    assert got[key] == pytest.approx(expected[key], rel=1e-12), f"rank {rank} step {step} {key}"
        huge_total = SWITCH_WORLD * HUGE + sum(range(SWITCH_WORLD))
        assert out["scaled"][4][0]["foundation_loss"] == (HUGE + rank) * (SWITCH_WORLD / huge_total)
        # reduce_global_loss_token: the same one buffer per call; totals exact beyond 2**40
        assert out["sizes"][5:] == [[agreement], [agreement]]
        assert out["token_totals"][1] == {"foundation_tokens": float(huge_total), "aux_tokens": float(SWITCH_WORLD)}


@pytest.mark.slow
def test_one_rank_changing_keys_raises_on_every_rank_without_a_hang(key_switches):
    for rank, out in enumerate(key_switches):
        for field in ("mismatch", "token_mismatch"):
            message = out[field]
            assert "loss keys differ across ranks" in message, f"rank {rank}: {message}"
            assert out[f"{field}_s"] < 5, f"rank {rank}: {field} took {out[f'{field}_s']:.1f}s"
        message = out["mismatch"]
        assert "rank 0: [['foundation:token-mean']]" in message and "rank 2: [['foundation:token-mean']]" in message
        assert "rank 1: [['aux:token-mean', 'foundation:token-mean']]" in message
        message = out["token_mismatch"]
        assert "rank 0: [['aux_tokens', 'foundation_tokens']]" in message
        assert "rank 1: [['aux_tokens', 'foundation_tokens', 'image_tokens']]" in message
        assert "_labels" in message
