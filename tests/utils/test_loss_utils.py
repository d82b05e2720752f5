"""Single-process tests of the loss contract, with `all_reduce` monkeypatched on loss_utils and counted."""

from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from veomni_lite.distributed.parallel_state import ParallelState
from veomni_lite.plain_loop import LossStep
from veomni_lite.utils import loss_utils
from veomni_lite.utils.loss_utils import (
    IGNORE_INDEX,
    LOSS_MODES,
    MAX_LOSS_KEYS,
    LossKeyMismatchError,
    LossMemoError,
    LossModes,
    count_loss_token,
    mark_sequences,
    mean_global_loss,
    reduce_global_loss_token,
    verify_loss_keys,
)

VOCAB = 11
AGREEMENT_SIZE = MAX_LOSS_KEYS + 5
HOST_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu")


class Peers:
    """`all_reduce` over this rank and simulated peers, each sending the agreement buffer of its own plan and counts
    (`{plan entry: count}`, counts in plan order). Every buffer this rank sends is recorded."""

    def __init__(self, monkeypatch, peers: list[dict[str, int]]) -> None:
        self.peers = peers
        self.buffers: list[torch.Tensor] = []
        self.gathered: list = []
        monkeypatch.setattr(loss_utils, "all_reduce", self)
        monkeypatch.setattr(loss_utils, "group_size", lambda group=None: 1 + len(peers))
        monkeypatch.setattr(loss_utils, "all_gather_objects", self.gather)

    def __call__(self, data, op="sum", group=None):
        assert op == "sum" and data.dtype == torch.int64 and data.numel() == AGREEMENT_SIZE
        self.buffers.append(data.clone())
        total = data.clone()
        for peer in self.peers:
            plan = tuple(peer)
            counts = [count for count in peer.values() if count is not None]
            f, g = loss_utils._fingerprints(plan)
            buffer = torch.zeros(AGREEMENT_SIZE, dtype=torch.int64)
            buffer[: len(counts)] = torch.tensor(counts, dtype=torch.int64)
            buffer[MAX_LOSS_KEYS:] = torch.tensor([1, f, f * f, g, g * g])
            total += buffer
        return total

    def gather(self, obj, group=None):
        self.gathered.append(obj)
        return [obj, *([list(peer)] for peer in self.peers)]

    @property
    def calls(self) -> int:
        return len(self.buffers)


@pytest.fixture
def counting(monkeypatch) -> Peers:
    """A world of one whose all-reduces are recorded."""
    return Peers(monkeypatch, [])


def make_micro_batches(num: int, seq: int = 6, seed: int = 0, ignore_p: float = 0.3) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(num):
        labels = torch.randint(0, VOCAB, (2, seq), generator=gen)
        labels[torch.rand(labels.shape, generator=gen) < ignore_p] = IGNORE_INDEX
        aux = torch.randint(0, VOCAB, (2, seq), generator=gen)
        aux[torch.rand(aux.shape, generator=gen) < 0.6] = IGNORE_INDEX
        batches.append(
            {"input_ids": torch.randint(0, VOCAB, (2, seq), generator=gen), "labels": labels, "aux_labels": aux}
        )
    return batches


# ---------------------------------------------------------------- count_loss_token and mark_sequences


def test_count_loss_token_sums_every_labels_key_over_micro_batches():
    batches = make_micro_batches(3)
    counts = count_loss_token(batches)
    assert set(counts) == {"foundation_tokens", "aux_tokens"}
    for key, name in (("foundation_tokens", "labels"), ("aux_tokens", "aux_labels")):
        assert counts[key].dtype == torch.int64
        assert int(counts[key]) == sum(int((b[name] != IGNORE_INDEX).sum()) for b in batches)


def test_count_loss_token_nested_lists_and_padding_flag():
    a, b, c = make_micro_batches(3)
    nested = count_loss_token([a, [b, (c,)]])
    assert {k: int(v) for k, v in nested.items()} == {k: int(v) for k, v in count_loss_token([a, b, c]).items()}
    flagged = count_loss_token([a, {**b, "padding_flag": True}, {**c, "padding_flag": torch.tensor([True])}])
    assert {k: int(v) for k, v in flagged.items()} == {k: int(v) for k, v in count_loss_token(a).items()}
    only_padding = count_loss_token({**a, "padding_flag": True})
    assert set(only_padding) == {"foundation_tokens", "aux_tokens"} and all(int(v) == 0 for v in only_padding.values())


def test_count_loss_token_rejects_other_types_naming_them():
    with pytest.raises(TypeError, match=r"batches\[1\] is a str"):
        count_loss_token([{"labels": torch.zeros(1, 2, dtype=torch.long)}, "oops"])
    with pytest.raises(TypeError, match="'labels' is a list"):
        count_loss_token({"labels": [1, 2]})


def test_mark_sequences_marks_the_first_valid_target_and_weights_by_the_whole_sequence():
    # Row 0 holds two packed sequences (ids 0 and 1) and padding; row 1 one sequence whose first target is late.
    labels = torch.tensor([[5, 6, IGNORE_INDEX, 7, 8, 9, IGNORE_INDEX], [IGNORE_INDEX] * 4 + [1, 2, 3]])
    ids = torch.tensor([[0, 0, 0, 1, 1, 1, -1], [2, 2, 2, 2, 2, 2, 2]])
    aux = torch.full_like(labels, IGNORE_INDEX)
    aux[0, 4] = 3  # only sequence 1 has an aux target
    batch = {"labels": labels, "aux_labels": aux, "sequence_ids": ids}
    marked = mark_sequences(batch, LossModes("seq-mean-token-mean", {"aux": "seq-mean-token-sum"}))
    assert marked["foundation_seq_starts"].tolist() == [
        [True, False, False, True, False, False, False],
        [False, False, False, False, True, False, False],
    ]
    weights = marked["foundation_loss_weights"]
    assert weights[0, :2].tolist() == [0.5, 0.5] and weights[0, 3:6].tolist() == [1 / 3] * 3
    assert weights[1, 4:].tolist() == [1 / 3] * 3 and weights[labels == IGNORE_INDEX].eq(0).all()
    assert marked["aux_seq_starts"].nonzero().tolist() == [[0, 4]]
    assert "aux_loss_weights" not in marked, "seq-mean-token-sum weights every token 1"
    counts = count_loss_token(marked)
    assert (int(counts["foundation_sequences"]), int(counts["aux_sequences"])) == (3, 1)


def test_mark_sequences_without_sequence_ids_takes_rows_and_leaves_token_modes_alone():
    labels = torch.tensor([[1, 2, IGNORE_INDEX], [IGNORE_INDEX] * 3, [IGNORE_INDEX, IGNORE_INDEX, 4]])
    marked = mark_sequences({"labels": labels}, "seq-mean-token-sum")
    assert marked["foundation_seq_starts"].tolist() == [[True, False, False], [False] * 3, [False, False, True]]
    assert int(count_loss_token(marked)["foundation_sequences"]) == 2, "a row without targets is no sequence"
    assert mark_sequences({"labels": labels}, "token-mean").keys() == {"labels"}
    with pytest.raises(ValueError, match="sequence_ids"):
        mark_sequences({"labels": labels, "sequence_ids": torch.zeros(3, 2, dtype=torch.long)}, "seq-mean-token-sum")


def test_loss_modes_reject_bad_modes_and_a_norm_mode_without_its_constant():
    with pytest.raises(ValueError, match="loss.scale_factor must be set"):
        LossModes("token-mean", {"aux": "seq-mean-token-sum-norm"})
    with pytest.raises(ValueError, match="loss.modes.aux: unknown loss mode 'mean'"):
        LossModes("token-mean", {"aux": "mean"})
    with pytest.raises(ValueError, match="must be > 0"):
        LossModes("seq-mean-token-sum-norm", scale_factor=-1.0)


# ---------------------------------------------------------------- the math, every mode, against a hand reference


def _per_token(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="none")


@pytest.mark.parametrize("mode", LOSS_MODES)
def test_every_mode_equals_its_hand_written_reference_with_empty_micro_batches(counting, mode):
    batches = make_micro_batches(4, seed=3)
    batches[1]["labels"].fill_(IGNORE_INDEX)  # a micro-batch without targets
    batches[2]["labels"][0].fill_(IGNORE_INDEX)  # a sequence without targets
    weight = torch.randn(VOCAB, VOCAB, dtype=torch.float64, requires_grad=True)
    modes = LossModes(mode, scale_factor=2.5)
    marked = [mark_sequences(batch, modes) for batch in batches]
    step_tokens = count_loss_token(marked)
    total = 0
    for batch in marked:
        per_token = _per_token(weight[batch["input_ids"]], batch["labels"])
        if "foundation_loss_weights" in batch:
            per_token = per_token * batch["foundation_loss_weights"].reshape(-1)
        local_mean = per_token.sum() / (batch["labels"] != IGNORE_INDEX).sum().clamp(min=1)
        total = (
            total + mean_global_loss(local_mean, count_loss_token(batch), step_tokens, modes=modes)["foundation_loss"]
        )
    assert counting.calls == 1, "one all-reduce per step (token-sum sends only the agreement slots)"
    (grad,) = torch.autograd.grad(total, weight)

    sequences = []
    for batch in batches:
        for row in range(batch["labels"].shape[0]):
            labels = batch["labels"][row]
            if (labels != IGNORE_INDEX).any():
                sequences.append(_per_token(weight[batch["input_ids"][row]], labels)[labels != IGNORE_INDEX])
    tokens, count = sum(s.numel() for s in sequences), len(sequences)
    reference = {
        "token-mean": sum(s.sum() for s in sequences) / tokens,
        "seq-mean-token-mean": sum(s.mean() for s in sequences) / count,
        "seq-mean-token-sum": sum(s.sum() for s in sequences) / count,
        "seq-mean-token-sum-norm": sum(s.sum() for s in sequences) / (count * 2.5),
        "token-sum": sum(s.sum() for s in sequences),
    }[mode]
    (reference_grad,) = torch.autograd.grad(reference, weight)
    torch.testing.assert_close(total.detach(), reference.detach(), rtol=1e-13, atol=0)
    torch.testing.assert_close(grad, reference_grad, rtol=1e-12, atol=1e-14)


def test_a_whole_step_without_tokens_gives_exact_zero_value_and_gradient(counting):
    labels = torch.full((2, 4), IGNORE_INDEX)
    logits = torch.randn(2, 4, VOCAB, requires_grad=True)
    nan_mean = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=IGNORE_INDEX)
    assert nan_mean.isnan()
    tokens = count_loss_token({"labels": labels})
    for mode in LOSS_MODES:
        modes = LossModes(mode, scale_factor=1.0)
        marked = count_loss_token(mark_sequences({"labels": labels}, modes))
        scaled = mean_global_loss(nan_mean, marked, {**marked}, modes=modes)["foundation_loss"]
        (grad,) = torch.autograd.grad(scaled, logits, retain_graph=True)
        assert scaled.item() == 0.0 and torch.equal(grad, torch.zeros_like(grad)), mode
    assert tokens["foundation_tokens"].item() == 0


# ---------------------------------------------------------------- one all-reduce per step, only the consumed keys


def test_one_all_reduce_per_step_of_only_the_consumed_counts(counting):
    batches = make_micro_batches(4)  # carries aux_labels, but the model has no aux loss
    step_tokens = count_loss_token(batches)
    for batch in batches:
        mean_global_loss({"foundation_loss": torch.tensor(1.0)}, count_loss_token(batch), step_tokens)
    assert counting.calls == 1
    (buffer,) = counting.buffers
    assert buffer[:MAX_LOSS_KEYS].tolist() == [int(step_tokens["foundation_tokens"])] + [0] * (MAX_LOSS_KEYS - 1)


def test_two_heads_in_different_modes_share_the_one_all_reduce(counting):
    modes = LossModes("seq-mean-token-mean", {"aux": "token-mean"})
    batches = [mark_sequences(batch, modes) for batch in make_micro_batches(3)]
    step_tokens = count_loss_token(batches)
    for batch in batches:
        losses = {"foundation_loss": torch.tensor(1.0), "aux_loss": torch.tensor(2.0)}
        mean_global_loss(losses, count_loss_token(batch), step_tokens, modes=modes)
    assert counting.calls == 1
    sent = counting.buffers[0][:2].tolist()  # sorted head names: aux (tokens), foundation (sequences)
    assert sent == [int(step_tokens["aux_tokens"]), int(step_tokens["foundation_sequences"])]


def test_counts_beyond_2_pow_40_stay_exact(counting):
    huge = 2**40 + 3
    scaled = mean_global_loss(
        torch.tensor(1.0, dtype=torch.float64), {"foundation_tokens": huge}, {"foundation_tokens": huge}
    )
    assert counting.buffers[0][0].item() == huge
    assert scaled["foundation_loss"].item() == pytest.approx(1.0, rel=1e-15)


def test_the_4th_argument_skips_the_collective(counting):
    scaled = mean_global_loss(
        torch.tensor(2.0), {"foundation_tokens": 3}, {"foundation_tokens": 3}, {"foundation_tokens": 6}
    )
    assert counting.calls == 0 and scaled["foundation_loss"].item() == pytest.approx(1.0)


def test_a_mode_needing_sequences_without_them_names_mark_sequences(counting):
    tokens = count_loss_token(make_micro_batches(1))
    with pytest.raises(KeyError, match="mark_sequences"):
        mean_global_loss(torch.tensor(1.0), tokens, tokens, modes="seq-mean-token-sum")
    with pytest.raises(KeyError, match="has no 'aux_tokens'"):
        mean_global_loss({"aux_loss": torch.tensor(1.0)}, tokens, {"foundation_tokens": 1})


# ---------------------------------------------------------------- the memo: by identity, never stale, edits refused


def test_a_new_dict_reduces_again_and_the_same_dict_does_not(counting):
    batch = make_micro_batches(1)[0]
    first = count_loss_token(batch)
    for _ in range(3):
        mean_global_loss(torch.tensor(1.0), count_loss_token(batch), first)
    assert counting.calls == 1
    mean_global_loss(torch.tensor(1.0), count_loss_token(batch), dict(first))
    assert counting.calls == 2


@pytest.mark.parametrize(
    "edit",
    [
        lambda d: d["foundation_tokens"].add_(1),
        lambda d: d.__setitem__("foundation_tokens", torch.tensor(99)),
        lambda d: d.__setitem__("extra_tokens", torch.tensor(1)),
        lambda d: d.pop("aux_tokens"),
    ],
    ids=["in-place", "replaced", "added", "removed"],
)
def test_editing_the_step_dict_after_its_first_use_is_refused_before_any_collective(counting, edit):
    batch = make_micro_batches(1)[0]
    step_tokens = count_loss_token(batch)
    mean_global_loss(torch.tensor(1.0), count_loss_token(batch), step_tokens)
    edit(step_tokens)
    with pytest.raises(LossMemoError, match="edited after its first use"):
        mean_global_loss(torch.tensor(1.0), count_loss_token(batch), step_tokens)
    assert counting.calls == 1, "the refusal issues no collective"


def test_an_int_count_reassigned_an_equal_value_is_no_edit(counting):
    step_tokens = {"foundation_tokens": 1000}
    mean_global_loss(torch.tensor(1.0), {"foundation_tokens": 3}, step_tokens)
    step_tokens["foundation_tokens"] = int("1000")  # a different int object, the same value
    mean_global_loss(torch.tensor(1.0), {"foundation_tokens": 3}, step_tokens)
    assert counting.calls == 1


def test_the_memo_holds_at_most_one_step(counting):
    batch = make_micro_batches(1)[0]
    first = count_loss_token(batch)
    mean_global_loss(torch.tensor(1.0), count_loss_token(batch), first)
    ref = weakref.ref(first["foundation_tokens"])
    mean_global_loss(torch.tensor(1.0), count_loss_token(batch), count_loss_token(batch))
    del first
    gc.collect()
    assert ref() is None


def test_a_loss_step_keeps_its_own_memo_so_a_step_run_inside_another_costs_no_second_reduce(counting):
    train, evaluation = LossStep(make_micro_batches(2)), LossStep(make_micro_batches(1, seed=1))
    (first, first_tokens), (second, second_tokens) = train
    train.loss(torch.tensor(1.0), first_tokens)
    for _, tokens in evaluation:  # e.g. an evaluation or a reference pass between two training micro-batches
        evaluation.loss(torch.tensor(1.0), tokens)
    train.loss(torch.tensor(1.0), second_tokens)
    assert counting.calls == 2, "one reduce per step"
    assert loss_utils._MODULE_MEMO.step is None, "nothing of a LossStep lives in the module"
    # Negative control: the same sequence through the module's one memo reduces the training step twice.
    mean_global_loss(torch.tensor(1.0), first_tokens, train.tokens)
    mean_global_loss(torch.tensor(1.0), count_loss_token(second), evaluation.tokens)
    mean_global_loss(torch.tensor(1.0), second_tokens, train.tokens)
    assert counting.calls == 5


def test_another_plan_mid_step_is_an_error(counting):
    batch = make_micro_batches(1)[0]
    step_tokens = count_loss_token(batch)
    mean_global_loss({"foundation_loss": torch.tensor(1.0)}, count_loss_token(batch), step_tokens)
    with pytest.raises(ValueError, match="same loss keys with the same modes"):
        losses = {"foundation_loss": torch.tensor(1.0), "aux_loss": torch.tensor(1.0)}
        mean_global_loss(losses, count_loss_token(batch), step_tokens)


# ---------------------------------------------------------------- rank agreement (simulated peers)


def test_a_peer_with_other_loss_keys_makes_this_rank_raise_naming_both(monkeypatch):
    peers = Peers(monkeypatch, [{"aux:token-mean": 4, "foundation:token-mean": 5}])
    with pytest.raises(LossKeyMismatchError, match=r"rank 0: \[\['foundation:token-mean'\]\]; rank 1: \[\['aux"):
        mean_global_loss(torch.tensor(1.0), {"foundation_tokens": 2}, {"foundation_tokens": 2})
    assert peers.calls == 1


def test_a_peer_with_another_mode_for_the_same_keys_is_caught(monkeypatch):
    Peers(monkeypatch, [{"foundation:seq-mean-token-sum": 1}])
    tokens = {"foundation_tokens": 2, "foundation_sequences": 1}
    with pytest.raises(LossKeyMismatchError, match="seq-mean-token-sum"):
        mean_global_loss(torch.tensor(1.0), tokens, tokens, modes="seq-mean-token-mean")


def test_peers_with_the_same_plan_pass_and_the_totals_add_up(monkeypatch):
    Peers(monkeypatch, [{"foundation:token-mean": 6}])
    scaled = mean_global_loss(
        torch.tensor(1.0, dtype=torch.float64), {"foundation_tokens": 2}, {"foundation_tokens": 2}
    )
    assert scaled["foundation_loss"].item() == pytest.approx(2 * 2 / 8)  # n * W / T, W = 2, T = 2 + 6


def test_more_heads_than_slots_raise_after_the_collective(counting):
    names = [f"k{i}" for i in range(MAX_LOSS_KEYS + 1)]
    tokens = {f"{name}_tokens": 1 for name in names}
    with pytest.raises(ValueError, match="exceed MAX_LOSS_KEYS"):
        mean_global_loss({f"{name}_loss": torch.tensor(1.0) for name in names}, tokens, tokens)
    assert counting.calls == 1, "the peers' agreement buffer is matched"


def test_on_an_accelerator_the_path_reads_nothing_and_verify_loss_keys_reads_the_verdict(monkeypatch):
    peers = Peers(monkeypatch, [{"foundation:seq-mean-token-sum": 1}])
    monkeypatch.setattr(loss_utils, "_verdict_now", lambda _tensor: False)  # as for a buffer on a GPU
    modes = LossModes("seq-mean-token-sum")
    batches = [mark_sequences(batch, modes) for batch in make_micro_batches(3)]
    reads: list[str] = []
    originals = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def recorder(name):
        def read(self, *args, **kwargs):
            reads.append(name)
            return originals[name](self, *args, **kwargs)

        return read

    step_tokens = count_loss_token(batches)
    for name in HOST_READS:
        monkeypatch.setattr(torch.Tensor, name, recorder(name))
    for batch in batches:
        mean_global_loss(torch.tensor(1.0), count_loss_token(batch), step_tokens, modes=modes)
    assert reads == [] and peers.calls == 1
    for name, original in originals.items():
        monkeypatch.setattr(torch.Tensor, name, original)
    verify_loss_keys()  # the peer sent the same plan
    peers.peers[0] = {"foundation:token-mean": 1}
    mean_global_loss(torch.tensor(1.0), count_loss_token(batches[0]), count_loss_token(batches), modes=modes)
    step_tokens = loss_utils._MODULE_MEMO.step.token_len
    scaled = mean_global_loss(torch.tensor(1.0), count_loss_token(batches[0]), step_tokens, modes=modes)
    assert scaled["foundation_loss"].isnan(), "no usable value before the verdict is read"
    with pytest.raises(LossKeyMismatchError):
        verify_loss_keys()


# ---------------------------------------------------------------- VeOmni compatibility


@pytest.mark.parametrize("local_tokens", [torch.tensor(3), 3], ids=["tensor", "int"])
@pytest.mark.parametrize("fsdp_size", [1, 2, 4])
def test_veomni_fourth_argument_unit_test_passes_unchanged(monkeypatch, local_tokens, fsdp_size):
    """VeOmni's own test: a parallel state with ONLY sp_enabled and fsdp_size, T given as a Python number."""

    def no_collective(*_args, **_kwargs):
        raise AssertionError("the denominator is already reduced")

    monkeypatch.setattr(loss_utils, "all_reduce", no_collective)
    monkeypatch.setattr(
        loss_utils, "get_parallel_state", lambda: SimpleNamespace(sp_enabled=False, fsdp_size=fsdp_size)
    )
    out = mean_global_loss(
        {"foundation_loss": torch.tensor(4.0)},
        {"foundation_tokens": local_tokens},
        {"foundation_tokens": torch.tensor(5)},
        {"foundation_tokens": 6},
    )
    assert out["foundation_loss"].item() == pytest.approx(4.0 * 3 / 6 * fsdp_size)


def test_parallel_state_answers_veomni_names():
    state = ParallelState(dp_size=2, sp_size=3)
    assert (state.fsdp_size, state.sp_enabled, state.sp_size, state.sp_group) == (6, True, 3, None)
    single = ParallelState()
    assert (single.fsdp_size, single.sp_enabled, single.sp_size) == (1, False, 1)


def test_numbers_tensors_and_reduce_global_loss_token_give_the_same_math(counting):
    batches = make_micro_batches(3)
    losses = [{"foundation_loss": torch.tensor(1.5 + i), "aux_loss": torch.tensor(0.5 * i)} for i in range(3)]
    step_tokens = count_loss_token(batches)
    memoized = [mean_global_loss(loss, count_loss_token(b), step_tokens) for loss, b in zip(losses, batches)]
    global_tokens = reduce_global_loss_token(step_tokens)
    assert all(type(value) is float for value in global_tokens.values())
    as_numbers = [
        mean_global_loss(loss, {k: int(v) for k, v in count_loss_token(b).items()}, step_tokens, global_tokens)
        for loss, b in zip(losses, batches)
    ]
    for a, b in zip(memoized, as_numbers):
        for key in a:
            assert a[key].item() == pytest.approx(b[key].item(), rel=1e-6)


def test_reduce_global_loss_token_reduces_exactly_the_given_keys_and_detects_other_keys(monkeypatch):
    peers = Peers(monkeypatch, [{"aux_tokens": 1, "foundation_tokens": 4}])
    assert reduce_global_loss_token({"foundation_tokens": 2, "aux_tokens": 5}) == {
        "foundation_tokens": 6.0,
        "aux_tokens": 6.0,
    }
    assert peers.buffers[0][:2].tolist() == [5, 2]
    with pytest.raises(LossKeyMismatchError, match="_labels"):
        reduce_global_loss_token({"foundation_tokens": 2})
    with pytest.raises(TypeError, match="is a str"):
        reduce_global_loss_token({"foundation_tokens": "2"})
