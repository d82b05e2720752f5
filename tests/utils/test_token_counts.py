"""The step's counts kept from host memory: served per micro-batch only while valid, and the one-multiply scaling
that uses them equals the generic path bit for bit."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F

from veomni_lite.utils import loss_utils, token_counts
from veomni_lite.utils.loss_utils import IGNORE_INDEX, count_loss_token, mean_global_loss

VOCAB = 7


def make_batches(num: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Ragged micro-batches (lengths 3..3+num) with two loss keys, some all-ignored."""
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for index in range(num):
        labels = torch.randint(0, VOCAB, (2, 3 + index), generator=gen)
        labels[torch.rand(labels.shape, generator=gen) < 0.4] = IGNORE_INDEX
        aux = torch.full((2, 3 + index), IGNORE_INDEX) if index % 2 else torch.randint(0, VOCAB, (2, 3 + index))
        batches.append({"input_ids": torch.zeros(2, 3 + index, dtype=torch.int64), "labels": labels, "aux_labels": aux})
    return batches


def direct_counts(batch: dict[str, torch.Tensor]) -> dict[str, int]:
    return {
        "foundation_tokens": int((batch["labels"] != IGNORE_INDEX).sum()),
        "aux_tokens": int((batch["aux_labels"] != IGNORE_INDEX).sum()),
    }


def test_micro_batches_of_the_counted_step_are_served_without_counting_again(monkeypatch):
    batches = make_batches(4)
    step = count_loss_token(batches)
    assert {key: int(value) for key, value in step.items()} == {
        key: sum(direct_counts(batch)[key] for batch in batches) for key in step
    }

    def forbidden(_batches):
        raise AssertionError("counted again")

    monkeypatch.setattr(token_counts, "count_on_device", forbidden)
    for batch in batches:
        counts = count_loss_token(batch)
        assert {key: int(value) for key, value in counts.items()} == direct_counts(batch)
        assert all(value.dtype == torch.int64 and value.shape == () for value in counts.values())
        assert count_loss_token(batch) is not counts, "a fresh dict each call"


@pytest.mark.parametrize(
    "edit",
    ["labels edited in place", "labels replaced", "labels key added", "padding flag set", "padding flag tensor"],
)
def test_a_changed_micro_batch_is_counted_again(edit):
    batches = make_batches(3)
    count_loss_token(batches)
    batch = batches[1]
    if edit == "labels edited in place":
        batch["labels"].fill_(3)
    elif edit == "labels replaced":
        batch["labels"] = torch.full_like(batch["labels"], 3)
    elif edit == "labels key added":
        batch["extra_labels"] = torch.ones(2, 2, dtype=torch.int64)
    elif edit == "padding flag set":
        batch["padding_flag"] = True
    else:
        batch["padding_flag"] = torch.tensor(False)
    expected = count_on_device_now(batch)
    got = count_loss_token(batch)
    assert {key: int(value) for key, value in got.items()} == expected, edit


def count_on_device_now(batch: dict) -> dict[str, int]:
    return {key: int(value) for key, value in token_counts.count_on_device([batch]).items()}


def test_a_handed_out_count_edited_in_place_is_neither_served_again_nor_trusted():
    batches = make_batches(2)
    step = count_loss_token(batches)
    local = count_loss_token(batches[0])
    true_count = int(local["foundation_tokens"])
    local["foundation_tokens"] += 5  # the caller's tensor, edited in place
    fresh = count_loss_token(batches[0])
    assert int(fresh["foundation_tokens"]) == true_count
    out = mean_global_loss(torch.tensor(1.0), local, step)  # the edited value is read on the device path
    world_total = int(step["foundation_tokens"])
    assert out["foundation_loss"].item() == pytest.approx((true_count + 5) / world_total)


def test_labels_and_foundation_labels_share_a_key_and_are_summed():
    batch = {"labels": torch.tensor([[1, IGNORE_INDEX]]), "foundation_labels": torch.tensor([[2, 3, 4]])}
    assert int(count_loss_token([batch])["foundation_tokens"]) == 4
    assert int(count_loss_token(batch)["foundation_tokens"]) == 4


def test_a_tensor_padding_flag_counts_on_the_device_and_keeps_no_step():
    batches = make_batches(2)
    batches[0]["padding_flag"] = torch.tensor(True)
    counts = count_loss_token(batches)
    assert int(counts["foundation_tokens"]) == direct_counts(batches[1])["foundation_tokens"]
    assert token_counts.counted_step() is None


def test_only_the_last_step_is_kept_and_its_batches_are_not():
    batches = make_batches(2)
    count_loss_token(batches)
    kept_labels = weakref.ref(batches[0]["labels"])
    kept_batch_input = weakref.ref(batches[0]["input_ids"])
    del batches
    gc.collect()
    assert kept_batch_input() is None, "the kept step holds labels, never the micro-batches"
    count_loss_token(make_batches(2, seed=1))
    gc.collect()
    assert kept_labels() is None, "the previous step's labels are released once the next step is counted"


# ---------------------------------------------------------------- the one-multiply scaling


def step_outputs(batches, losses_per_batch, dtype):
    """Scaled losses and gradients of one step through `mean_global_loss` (whichever path it takes); a NaN local
    mean (no targets) stays a constant, as a model's would not pass NaN gradients to its weights."""
    weights = {key: torch.ones((), dtype=dtype, requires_grad=True) for key in ("foundation_loss", "aux_loss")}
    step = count_loss_token(batches)
    values = []
    for batch, losses in zip(batches, losses_per_batch):
        weighted = {key: loss if loss.isnan() else weights[key] * loss for key, loss in losses.items()}
        scaled = mean_global_loss(weighted, count_loss_token(batch), step)
        sum(scaled.values()).backward()
        values.extend(value.detach() for value in scaled.values())
    loss_utils.reset_loss_memo()
    return values, [weights[key].grad for key in sorted(weights)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_the_host_path_equals_the_generic_path_bit_for_bit(monkeypatch, dtype):
    """Counts of 0 with a NaN local mean included; bf16 takes the generic path (it promotes to float32)."""
    batches = make_batches(4)
    gen = torch.Generator().manual_seed(3)
    losses_per_batch = []
    for batch in batches:
        counts = direct_counts(batch)
        losses_per_batch.append(
            {
                "foundation_loss": torch.rand((), generator=gen, dtype=torch.float64).to(dtype),
                "aux_loss": torch.tensor(float("nan"), dtype=dtype)
                if counts["aux_tokens"] == 0
                else torch.rand((), generator=gen, dtype=torch.float64).to(dtype) * 3,
            }
        )
    host_values, host_grads = step_outputs(batches, losses_per_batch, dtype)
    monkeypatch.setattr(loss_utils, "counted_step", lambda: None)  # the generic path: no kept counts
    monkeypatch.setattr(token_counts, "count_on_host", lambda _batches: None)
    generic_values, generic_grads = step_outputs(batches, losses_per_batch, dtype)
    assert all(torch.isfinite(value) for value in host_values)
    for host, generic in zip(host_values + host_grads, generic_values + generic_grads, strict=True):
        assert host.dtype == generic.dtype
        assert torch.equal(host, generic)


def test_the_host_path_is_one_op_per_loss():
    batches = make_batches(2)
    step = count_loss_token(batches)
    weight = torch.ones((), requires_grad=True)
    for batch in batches:
        loss = weight * 2.0
        scaled = mean_global_loss(loss, count_loss_token(batch), step)["foundation_loss"]
        assert scaled.grad_fn.next_functions[0][0] is loss.grad_fn, "one multiply between the loss and its scaled value"


def test_the_host_path_matches_a_single_process_cross_entropy_reference():
    torch.manual_seed(0)
    batches = make_batches(5)
    head = torch.nn.Linear(3, VOCAB)
    features = [torch.randn(2, batch["labels"].shape[1], 3) for batch in batches]
    step = count_loss_token(batches)
    total = torch.zeros(())
    for feats, batch in zip(features, batches):
        loss = F.cross_entropy(head(feats).reshape(-1, VOCAB), batch["labels"].reshape(-1), ignore_index=IGNORE_INDEX)
        scaled = mean_global_loss(loss, count_loss_token(batch), step)["foundation_loss"]
        total = total + scaled
    assert loss_utils._MEMO.host_scales is not None, "the host path ran"
    total.backward()
    got = [p.grad.clone() for p in head.parameters()]
    head.zero_grad()
    reference = F.cross_entropy(
        torch.cat([head(f).reshape(-1, VOCAB) for f in features]),
        torch.cat([b["labels"].reshape(-1) for b in batches]),
        ignore_index=IGNORE_INDEX,
    )
    reference.backward()
    assert total.item() == pytest.approx(reference.item(), rel=1e-6)
    for g, p in zip(got, head.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("local", [0, -3])
def test_a_count_of_zero_or_below_contributes_an_exact_zero_on_the_host_path(local):
    batches = make_batches(2)
    step = count_loss_token(batches)
    logits = torch.randn(4, VOCAB, requires_grad=True)
    nan_loss = F.cross_entropy(logits, torch.full((4,), IGNORE_INDEX), ignore_index=IGNORE_INDEX)  # NaN
    scaled = mean_global_loss(nan_loss, {"foundation_tokens": local}, step)["foundation_loss"]
    assert loss_utils._MEMO.host_scales is not None, "the host path ran"
    assert scaled.item() == 0.0
    scaled.backward()
    assert torch.equal(logits.grad, torch.zeros_like(logits))


def test_labels_of_any_shape_are_counted_per_micro_batch():
    """Ragged leading dimensions, 1-D and 3-D labels and an empty tensor: each count is the direct one."""
    gen = torch.Generator().manual_seed(3)
    shapes = [(2, 5), (1, 7), (6,), (2, 2, 3), (0, 4), (2, 5)]
    batches = []
    for shape in shapes:
        labels = torch.randint(0, VOCAB, shape, generator=gen)
        labels[torch.rand(shape, generator=gen) < 0.5] = IGNORE_INDEX
        batches.append({"labels": labels})
    step = count_loss_token(batches)
    expected = [int((batch["labels"] != IGNORE_INDEX).sum()) for batch in batches]
    assert int(step["foundation_tokens"]) == sum(expected)
    assert [int(count_loss_token(batch)["foundation_tokens"]) for batch in batches] == expected
    assert token_counts.counted_step() is not None, "counted from host memory, not on the device path"


def test_later_micro_batches_skip_validation_until_anything_differs(monkeypatch):
    """After a step's first call, a micro-batch with the same loss keys and kept counts takes the short path (no
    re-validation); a count the step did not hand out, or other keys, go through the full path again."""
    batches = make_batches(3)
    step = count_loss_token(batches)
    weight = torch.ones((), requires_grad=True)

    def losses() -> dict[str, torch.Tensor]:
        return {"foundation_loss": weight * 2.0, "aux_loss": weight * 3.0}

    first = mean_global_loss(losses(), count_loss_token(batches[0]), step)

    def full_path(_losses):
        raise AssertionError("full path")

    monkeypatch.setattr(loss_utils, "_as_loss_items", full_path)
    second = mean_global_loss(losses(), count_loss_token(batches[1]), step)
    expected = {key: 2.0 + (key == "aux_loss") for key in second}
    for key, value in second.items():
        count = direct_counts(batches[1])[key.replace("_loss", "_tokens")]
        assert value.item() == pytest.approx(expected[key] * count / int(step[key.replace("_loss", "_tokens")]))
    assert set(first) == set(second)
    with pytest.raises(AssertionError, match="full path"):
        mean_global_loss(losses(), {key: value.clone() for key, value in count_loss_token(batches[2]).items()}, step)
    with pytest.raises(AssertionError, match="full path"):
        mean_global_loss({"foundation_loss": weight * 2.0}, count_loss_token(batches[2]), step)
