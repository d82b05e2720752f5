"""Single-process tests of the loss contract, with `all_reduce` monkeypatched on loss_utils and counted."""

from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from veomni_lite.distributed.parallel_state import ParallelState
from veomni_lite.utils import loss_utils
from veomni_lite.utils.loss_utils import (
    IGNORE_INDEX,
    MAX_LOSS_KEYS,
    LossKeyMismatchError,
    count_loss_token,
    mean_global_loss,
    reduce_global_loss_token,
)

VOCAB = 11


AGREEMENT_SIZE = MAX_LOSS_KEYS + 5


class CountingAllReduce:
    """Records every all_reduce the loss path issues; behaves as a world of one."""

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = []

    def __call__(self, data, op="sum", group=None):
        assert op == "sum"
        self.buffers.append(data.clone())
        return data.clone()

    @property
    def calls(self) -> int:
        return len(self.buffers)


@pytest.fixture
def counting(monkeypatch) -> CountingAllReduce:
    counter = CountingAllReduce()
    monkeypatch.setattr(loss_utils, "all_reduce", counter)
    return counter


class SimulatedPeers:
    """`all_reduce` over this rank and simulated peer ranks that follow the same protocol (a world of 1 + peers).

    Each peer is `{name: count}`: its key set and counts. It sends the agreement buffer when this rank does (the
    buffer size says so), else its counts when its names are the agreed ones, else the poison. Every buffer this rank
    sends is recorded.
    """

    def __init__(self, monkeypatch, peers: list[dict[str, int]], caller: str = "mean_global_loss") -> None:
        self.peers = peers
        self.caller = caller
        self.buffers: list[torch.Tensor] = []
        monkeypatch.setattr(loss_utils, "all_reduce", self)
        monkeypatch.setattr(loss_utils, "group_size", lambda group=None: 1 + len(self.peers))

    def __call__(self, data, op="sum", group=None):
        assert op == "sum" and data.dtype == torch.int64
        self.buffers.append(data.clone())
        total = data.clone()
        for peer in self.peers:
            total += self._peer_buffer(peer, data.numel())
        return total

    def _peer_buffer(self, peer: dict[str, int], numel: int) -> torch.Tensor:
        names = tuple(sorted(peer))
        if numel == AGREEMENT_SIZE:
            buffer = torch.zeros(AGREEMENT_SIZE, dtype=torch.int64)
            if len(names) <= MAX_LOSS_KEYS:
                buffer[: len(names)] = torch.tensor([peer[name] for name in names], dtype=torch.int64)
            buffer[MAX_LOSS_KEYS:] = loss_utils._trailer(names, torch.device("cpu"))
            return buffer
        if names == loss_utils._AGREEMENTS[self.caller].names:
            return torch.tensor([peer[name] for name in names], dtype=torch.int64)
        return torch.full((numel,), loss_utils._poison(1 + len(self.peers)), dtype=torch.int64)

    @property
    def sizes(self) -> list[int]:
        return [buffer.numel() for buffer in self.buffers]


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


def local_mean_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The plain model loss: F.cross_entropy mean over the valid labels (NaN when there are none)."""
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=IGNORE_INDEX)


# ---------------------------------------------------------------- count_loss_token


def test_count_loss_token_sums_every_labels_key_over_micro_batches():
    batches = make_micro_batches(3)
    counts = count_loss_token(batches)
    assert set(counts) == {"foundation_tokens", "aux_tokens"}
    assert counts["foundation_tokens"].dtype == torch.int64
    expected_f = sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in batches)
    expected_a = sum(int((b["aux_labels"] != IGNORE_INDEX).sum()) for b in batches)
    assert int(counts["foundation_tokens"]) == expected_f  # summed, not the last micro-batch's count
    assert int(counts["aux_tokens"]) == expected_a
    assert int(count_loss_token(batches[1])["foundation_tokens"]) == int((batches[1]["labels"] != IGNORE_INDEX).sum())


def test_count_loss_token_nested_and_padding_flag():
    batches = make_micro_batches(4)
    flat = count_loss_token(batches)
    nested = count_loss_token([[batches[0], batches[1]], (batches[2], [batches[3]])])
    assert int(nested["foundation_tokens"]) == int(flat["foundation_tokens"])
    padded = dict(batches[0], padding_flag=True)
    tensor_padded = dict(batches[1], padding_flag=torch.tensor(True))
    counts = count_loss_token([padded, tensor_padded, batches[2]])
    assert int(counts["foundation_tokens"]) == int((batches[2]["labels"] != IGNORE_INDEX).sum())
    not_padded = dict(batches[1], padding_flag=torch.tensor(False))
    assert int(count_loss_token(not_padded)["aux_tokens"]) == int((batches[1]["aux_labels"] != IGNORE_INDEX).sum())


def test_count_loss_token_of_a_list_equals_the_sum_of_its_micro_batches():
    """Whatever the shapes and flags: a key first seen in a padded micro-batch, ragged lengths, tensor flags."""
    gen = torch.Generator().manual_seed(5)

    def labels(seq: int) -> torch.Tensor:
        out = torch.randint(0, VOCAB, (2, seq), generator=gen)
        out[torch.rand(out.shape, generator=gen) < 0.4] = IGNORE_INDEX
        return out

    batches = [
        {"labels": labels(5), "late_labels": labels(3), "padding_flag": True},
        {"labels": labels(7), "padding_flag": torch.tensor(False)},
        {"labels": labels(2).t(), "other_labels": labels(4)},  # non-contiguous
        {"labels": labels(9), "other_labels": labels(1), "padding_flag": torch.tensor([True])},
        {"labels": labels(4), "other_labels": labels(6), "padding_flag": False},
    ]
    counts = count_loss_token(batches)
    assert list(counts) == ["foundation_tokens", "late_tokens", "other_tokens"]
    for key in counts:
        expected = sum(int(count_loss_token(batch).get(key, 0)) for batch in batches)
        assert counts[key].dtype == torch.int64 and counts[key].shape == ()
        assert int(counts[key]) == expected, key
    assert int(counts["late_tokens"]) == 0


def test_count_loss_token_rejects_other_types_naming_them():
    with pytest.raises(TypeError, match=r"batches\[1\] is a str"):
        count_loss_token([make_micro_batches(1)[0], "oops"])
    with pytest.raises(TypeError, match="'labels' is a list"):
        count_loss_token({"labels": [1, 2, 3]})


# ---------------------------------------------------------------- collectives per step


def test_one_all_reduce_per_step_carrying_both_keys(counting):
    """One rank: nobody to agree with, so every step sends exactly its k loss keys' counts."""
    batches = make_micro_batches(4)
    step_tokens = count_loss_token(batches)
    for batch in batches:
        losses = {"foundation_loss": torch.tensor(1.0), "aux_loss": torch.tensor(2.0)}
        mean_global_loss(losses, count_loss_token(batch), step_tokens)
    assert counting.calls == 1
    # sorted loss keys: aux, foundation
    assert counting.buffers[0].tolist() == [int(step_tokens["aux_tokens"]), int(step_tokens["foundation_tokens"])]

    next_step = count_loss_token(make_micro_batches(4, seed=1))
    mean_global_loss({"foundation_loss": torch.tensor(1.0), "aux_loss": torch.tensor(2.0)}, next_step, next_step)
    assert counting.calls == 2


def test_token_keys_without_a_loss_are_not_reduced(counting):
    batches = make_micro_batches(2)
    step_tokens = count_loss_token(batches)
    mean_global_loss(torch.tensor(1.0), count_loss_token(batches[0]), step_tokens)
    assert counting.buffers[0].tolist() == [int(step_tokens["foundation_tokens"])], "aux_tokens has no loss"


def run_step(batches: list[dict[str, torch.Tensor]], names: tuple[str, ...], mean: float = 1.0) -> list[dict]:
    """One step of GA = len(batches) micro-batches with fixed local means for `names`; the scaled losses."""
    step_tokens = count_loss_token(batches)
    return [
        mean_global_loss({f"{name}_loss": torch.tensor(mean) for name in names}, count_loss_token(batch), step_tokens)
        for batch in batches
    ]


@pytest.mark.parametrize("names", [("foundation",), ("aux", "foundation")], ids=["1 key", "2 keys"])
def test_steady_state_sends_one_int64_per_loss_key_after_one_agreement(monkeypatch, names):
    """W = 2: the first step agrees through the 13-element buffer; later steps send k elements; one collective each."""
    peer = {name: 7 for name in names}
    sim = SimulatedPeers(monkeypatch, [peer])
    for step in range(4):
        batches = make_micro_batches(4, seed=step)
        scaled = run_step(batches, names)
        assert len(sim.buffers) == step + 1, "one collective per step, whatever the GA"
        expected_size = AGREEMENT_SIZE if step == 0 else len(names)
        assert sim.sizes[-1] == expected_size
        step_tokens = count_loss_token(batches)
        for batch, out in zip(batches, scaled):
            for name in names:
                n = int(count_loss_token(batch)[f"{name}_tokens"])
                total = int(step_tokens[f"{name}_tokens"]) + 7
                assert out[f"{name}_loss"].item() == pytest.approx(n / total * 2, rel=1e-6)


def test_a_peer_switching_keys_after_agreement_makes_this_rank_raise(monkeypatch):
    """The peer's keys change after agreed steps: its poison makes the lean sum negative here too, so all re-agree."""
    peer = {"aux": 3, "foundation": 5}
    sim = SimulatedPeers(monkeypatch, [peer])
    run_step(make_micro_batches(2), ("aux", "foundation"))
    run_step(make_micro_batches(2, seed=1), ("aux", "foundation"))
    assert sim.sizes == [AGREEMENT_SIZE, 2]
    sim.peers[0] = {"foundation": 5}
    with pytest.raises(LossKeyMismatchError, match=r"\['aux', 'foundation'\]"):
        run_step(make_micro_batches(2, seed=2), ("aux", "foundation"))
    assert sim.sizes == [AGREEMENT_SIZE, 2, 2, AGREEMENT_SIZE]
    assert (sim.buffers[2] >= 0).all(), "this rank's keys did not change: it sent its counts"
    # The mismatch forgets the agreement on every rank: the next step agrees again.
    sim.peers[0] = {"aux": 3, "foundation": 5}
    run_step(make_micro_batches(2, seed=3), ("aux", "foundation"))
    assert sim.sizes[-1] == AGREEMENT_SIZE


def test_this_rank_switching_keys_alone_poisons_the_lean_sum_and_raises(monkeypatch):
    sim = SimulatedPeers(monkeypatch, [{"aux": 3, "foundation": 5}])
    run_step(make_micro_batches(2), ("aux", "foundation"))
    with pytest.raises(LossKeyMismatchError, match=r"\['foundation'\]"):
        run_step(make_micro_batches(2, seed=1), ("foundation",))
    assert sim.sizes == [AGREEMENT_SIZE, 2, AGREEMENT_SIZE], "the agreed size, poisoned, then the agreement buffer"
    assert sim.buffers[1].tolist() == [loss_utils._poison(2)] * 2


@pytest.mark.parametrize("world", [2, 3, 4])
def test_all_ranks_switching_keys_together_re_agree_silently(monkeypatch, world):
    peers = [{"aux": 3, "foundation": 5} for _ in range(world - 1)]
    sim = SimulatedPeers(monkeypatch, peers)
    run_step(make_micro_batches(2), ("aux", "foundation"))
    run_step(make_micro_batches(2, seed=1), ("aux", "foundation"))
    sim.peers[:] = [{"foundation": 11} for _ in range(world - 1)]
    batches = make_micro_batches(3, seed=2)
    scaled = run_step(batches, ("foundation",))
    assert sim.sizes == [AGREEMENT_SIZE, 2, 2, AGREEMENT_SIZE], "poisoned lean sum, then one agreement"
    total = int(count_loss_token(batches)["foundation_tokens"]) + 11 * (world - 1)
    for batch, out in zip(batches, scaled):
        n = int(count_loss_token(batch)["foundation_tokens"])
        assert out["foundation_loss"].item() == pytest.approx(n / total * world, rel=1e-6)
    run_step(make_micro_batches(2, seed=3), ("foundation",))
    assert sim.sizes[-1] == 1, "the new key set is the agreed one"


@pytest.mark.parametrize("world", [2, 3, 5, 1024, 2**15, 2**20])
def test_the_poison_is_exact_in_int64_and_cannot_be_masked_by_valid_counts(world):
    poison = loss_utils._poison(world)
    largest_valid_total = loss_utils._POISON_BUDGET // world - 1
    for poisoned_ranks in (1, 2, world):
        if poisoned_ranks > world:
            continue
        worst_high = torch.tensor(largest_valid_total) + torch.tensor(poison) * poisoned_ranks
        worst_low = torch.tensor(poison) * poisoned_ranks
        assert worst_high.item() < 0, "a poisoned sum is negative whatever the valid counts"
        assert worst_low.item() >= -(2**62), "no int64 overflow"
        assert worst_low.item() == poison * poisoned_ranks


def test_counts_beyond_2_pow_24_and_2_pow_40_stay_exact(monkeypatch):
    sim = SimulatedPeers(monkeypatch, [{"foundation": 2**40 + 5}])
    for step, local in enumerate([2**24 + 1, 2**40 + 3]):
        step_tokens = {"foundation_tokens": torch.tensor(local)}
        out = mean_global_loss(torch.tensor(1.0, dtype=torch.float64), step_tokens, step_tokens)
        assert sim.sizes[-1] == (AGREEMENT_SIZE if step == 0 else 1)
        total = local + 2**40 + 5
        assert loss_utils._MEMO.scales.tolist() == [2 / total], "T summed exactly in int64"
        assert out["foundation_loss"].item() == local * (2 / total)


class FakeGroup:
    """Stands for a process group object (weak-referenceable, compared by identity)."""


def test_a_new_process_group_agrees_again_and_the_old_one_is_not_kept_alive(monkeypatch):
    sim = SimulatedPeers(monkeypatch, [{"foundation": 4}])
    state = SimpleNamespace(world_group=FakeGroup())
    monkeypatch.setattr(loss_utils, "get_parallel_state", lambda: state)
    run_step(make_micro_batches(2), ("foundation",))
    run_step(make_micro_batches(2, seed=1), ("foundation",))
    old_group = weakref.ref(state.world_group)
    state.world_group = FakeGroup()
    gc.collect()
    assert old_group() is None, "the agreement must not keep a destroyed group alive"
    run_step(make_micro_batches(2, seed=2), ("foundation",))
    assert sim.sizes == [AGREEMENT_SIZE, 1, AGREEMENT_SIZE]


def test_reset_loss_memo_is_local_and_keeps_the_agreement(monkeypatch):
    sim = SimulatedPeers(monkeypatch, [{"foundation": 4}])
    run_step(make_micro_batches(2), ("foundation",))
    loss_utils.reset_loss_memo()
    run_step(make_micro_batches(2, seed=1), ("foundation",))
    assert sim.sizes == [AGREEMENT_SIZE, 1]


def test_accelerator_path_sends_the_agreement_buffer_and_defers_the_verdict(monkeypatch):
    """Where a verdict read would be a device sync: the self-checking buffer every step, NaN denominators on a
    mismatch, and `verify_loss_keys` raises at the step's host read."""
    sim = SimulatedPeers(monkeypatch, [{"foundation": 4}])
    monkeypatch.setattr(loss_utils, "_verdict_on_host", lambda device: False)
    for seed in range(2):
        scaled = run_step(make_micro_batches(2, seed=seed), ("foundation",))
        loss_utils.verify_loss_keys()
        assert all(torch.isfinite(out["foundation_loss"]) for out in scaled)
    assert sim.sizes == [AGREEMENT_SIZE, AGREEMENT_SIZE]
    sim.peers[0] = {"aux": 1, "foundation": 4}
    scaled = run_step(make_micro_batches(2, seed=2), ("foundation",))
    assert all(torch.isnan(out["foundation_loss"]) for out in scaled), "no usable value before the verdict is read"
    with pytest.raises(LossKeyMismatchError, match=r"\['foundation'\]"):
        loss_utils.verify_loss_keys()


def test_explicit_global_counts_skip_the_collective(counting):
    batches = make_micro_batches(2)
    step_tokens = count_loss_token(batches)
    out = mean_global_loss(torch.tensor(3.0), count_loss_token(batches[0]), step_tokens, step_tokens)
    assert counting.calls == 0
    n = int(count_loss_token(batches[0])["foundation_tokens"])
    assert out["foundation_loss"].item() == pytest.approx(3.0 * n / int(step_tokens["foundation_tokens"]))


def test_a_new_dict_always_gets_new_denominators(counting):
    """Equal contents, new object -> new reduce; freed dicts cannot alias through id() reuse."""
    batches = make_micro_batches(2)
    for index in range(20):
        step_tokens = count_loss_token(batches)
        mean_global_loss(torch.tensor(1.0), count_loss_token(batches[0]), step_tokens)
        assert counting.calls == index + 1
        del step_tokens
        gc.collect()


def test_in_place_edit_of_the_step_dict_is_not_served_stale(counting):
    batches = make_micro_batches(2)
    step_tokens = count_loss_token(batches)
    mean_global_loss(torch.tensor(1.0), count_loss_token(batches[0]), step_tokens)
    step_tokens["foundation_tokens"] = torch.tensor(5)
    out = mean_global_loss(torch.tensor(1.0), {"foundation_tokens": torch.tensor(5)}, step_tokens)
    assert counting.calls == 2
    assert out["foundation_loss"].item() == pytest.approx(1.0)


@pytest.mark.parametrize("edit", ["iadd", "copy_"])
def test_in_place_change_of_a_step_count_gets_fresh_denominators(counting, edit):
    batches = make_micro_batches(2)
    step_tokens = count_loss_token(batches)
    local = count_loss_token(batches[0])
    n = int(local["foundation_tokens"])
    mean_global_loss(torch.tensor(1.0), local, step_tokens)
    mean_global_loss(torch.tensor(1.0), local, step_tokens)
    assert counting.calls == 1
    count = step_tokens["foundation_tokens"]
    if edit == "iadd":
        count += 4
    else:
        count.copy_(torch.tensor(40))
    new_total = int(count)
    out = mean_global_loss(torch.tensor(1.0), local, step_tokens)
    assert step_tokens["foundation_tokens"] is count, "the same tensor object, edited in place"
    assert counting.calls == 2
    assert out["foundation_loss"].item() == pytest.approx(n / new_total)
    mean_global_loss(torch.tensor(1.0), local, step_tokens)
    assert counting.calls == 2, "the refreshed memo serves the rest of the step"


def test_memo_holds_at_most_one_step(counting):
    first = count_loss_token(make_micro_batches(2))
    probe = weakref.ref(first["foundation_tokens"])
    mean_global_loss(torch.tensor(1.0), first, first)
    del first
    second = count_loss_token(make_micro_batches(2, seed=3))
    mean_global_loss(torch.tensor(1.0), second, second)
    gc.collect()
    assert probe() is None, "the previous step's counts must be released once the next step starts"


def test_a_loss_key_appearing_mid_step_is_an_error(counting):
    batches = make_micro_batches(2)
    step_tokens = count_loss_token(batches)
    mean_global_loss(torch.tensor(1.0), count_loss_token(batches[0]), step_tokens)
    with pytest.raises(ValueError, match="appeared mid-step"):
        mean_global_loss(
            {"foundation_loss": torch.tensor(1.0), "aux_loss": torch.tensor(1.0)},
            count_loss_token(batches[1]),
            step_tokens,
        )


def test_missing_token_key_names_the_key():
    with pytest.raises(KeyError, match="aux_tokens"):
        mean_global_loss(
            {"aux_loss": torch.tensor(1.0)}, {"foundation_tokens": torch.tensor(1)}, {"aux_tokens": torch.tensor(1)}
        )
    with pytest.raises(KeyError, match="must be named"):
        mean_global_loss({"aux": torch.tensor(1.0)}, {}, {})


# ---------------------------------------------------------------- math


def test_fallback_math_equals_the_global_token_mean_with_zero_token_micro_batches():
    torch.manual_seed(0)
    batches = make_micro_batches(4, ignore_p=0.4)
    batches[1]["labels"].fill_(IGNORE_INDEX)  # an all-ignored micro-batch: the plain CE mean is NaN there
    batches[2]["aux_labels"].fill_(IGNORE_INDEX)
    head = torch.nn.Linear(4, VOCAB)
    aux_head = torch.nn.Linear(4, VOCAB)
    features = [torch.randn(2, 6, 4) for _ in batches]

    step_tokens = count_loss_token(batches)
    total = torch.zeros(())
    for feats, batch in zip(features, batches):
        losses = {
            "foundation_loss": local_mean_ce(head(feats), batch["labels"]),
            "aux_loss": local_mean_ce(aux_head(feats), batch["aux_labels"]),
        }
        scaled = mean_global_loss(losses, count_loss_token(batch), step_tokens)
        assert all(torch.isfinite(v) for v in scaled.values())
        total = total + sum(scaled.values())
    total.backward()
    got = [p.grad.clone() for p in (*head.parameters(), *aux_head.parameters())]

    head.zero_grad()
    aux_head.zero_grad()
    all_feats = torch.cat(features)
    reference = local_mean_ce(head(all_feats), torch.cat([b["labels"] for b in batches])) + local_mean_ce(
        aux_head(all_feats), torch.cat([b["aux_labels"] for b in batches])
    )
    reference.backward()
    assert total.item() == pytest.approx(reference.item(), rel=1e-6)
    for g, r in zip(got, (*[p.grad for p in head.parameters()], *[p.grad for p in aux_head.parameters()])):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-7)


def test_a_whole_step_without_tokens_gives_exact_zero_value_and_gradient():
    logits = torch.randn(2, 6, VOCAB, requires_grad=True)
    labels = torch.full((2, 6), IGNORE_INDEX)
    step_tokens = count_loss_token([{"labels": labels}])
    scaled = mean_global_loss(local_mean_ce(logits, labels), count_loss_token({"labels": labels}), step_tokens)
    loss = scaled["foundation_loss"]
    assert loss.item() == 0.0
    loss.backward()
    assert torch.equal(logits.grad, torch.zeros_like(logits))


def test_no_host_reads_in_the_loss_path(monkeypatch):
    def forbidden(*_args, **_kwargs):
        raise AssertionError("host read in the loss path")

    batches = make_micro_batches(3)
    global_numbers = {key: float(value) for key, value in count_loss_token(batches).items()}
    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    step_tokens = count_loss_token(batches)
    for batch in batches:
        losses = {"foundation_loss": torch.tensor(1.0), "aux_loss": torch.tensor(1.0)}
        mean_global_loss(losses, count_loss_token(batch), step_tokens)
        mean_global_loss(losses, count_loss_token(batch), step_tokens, step_tokens)
        mean_global_loss(losses, count_loss_token(batch), step_tokens, global_numbers)


def test_no_host_reads_in_the_agreement_protocol_on_cpu(monkeypatch):
    """With peers: agreement, lean steps, a re-agreement and a mismatch; verdicts come from host memory (numpy)."""

    def forbidden(*_args, **_kwargs):
        raise AssertionError("host read in the loss path")

    sim = SimulatedPeers(monkeypatch, [{"aux": 3, "foundation": 5}])
    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    run_step(make_micro_batches(2), ("aux", "foundation"))
    run_step(make_micro_batches(2, seed=1), ("aux", "foundation"))
    sim.peers[0] = {"foundation": 5}
    run_step(make_micro_batches(2, seed=2), ("foundation",))
    sim.peers[0] = {"aux": 1, "foundation": 5}
    with pytest.raises(LossKeyMismatchError):
        run_step(make_micro_batches(2, seed=3), ("foundation",))
    monkeypatch.undo()
    assert sim.sizes == [AGREEMENT_SIZE, 2, 2, AGREEMENT_SIZE, 1, AGREEMENT_SIZE]


# ---------------------------------------------------------------- rank agreement


def test_a_rank_with_other_loss_keys_is_detected(monkeypatch):
    """A peer whose key set differs from the first step on: the agreement buffer's fingerprints disagree."""
    SimulatedPeers(monkeypatch, [{"aux": 1, "foundation": 2}])
    batch = make_micro_batches(1)[0]
    with pytest.raises(LossKeyMismatchError, match=r"\['foundation'\]"):
        mean_global_loss(torch.tensor(1.0), count_loss_token(batch), count_loss_token(batch))


def test_same_keys_on_every_rank_pass_the_check(monkeypatch):
    sim = SimulatedPeers(monkeypatch, [{"foundation": 7}])
    batch = {"labels": torch.tensor([[1, 2, IGNORE_INDEX]])}
    for _ in range(2):  # the agreement, then the lean buffer: W = 2 both times
        out = mean_global_loss(torch.tensor(1.0), count_loss_token(batch), count_loss_token(batch))
        assert out["foundation_loss"].item() == pytest.approx(1.0 * 2 / 9 * 2)  # n=2, T=2+7, W=2
    assert sim.sizes == [AGREEMENT_SIZE, 1]


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


def test_numbers_and_tensors_give_the_same_math_as_the_memoized_path(counting):
    """Memoized T, explicit tensor T, reduce_global_loss_token's numbers, and Python-int local counts agree exactly."""
    torch.manual_seed(0)
    batches = make_micro_batches(4, ignore_p=0.4)
    batches[2]["aux_labels"].fill_(IGNORE_INDEX)
    head = torch.nn.Linear(4, VOCAB)
    aux_head = torch.nn.Linear(4, VOCAB)
    features = [torch.randn(2, 6, 4) for _ in batches]

    def run(form: str) -> list[torch.Tensor]:
        """The scaled losses and gradients of one step; asserts the collectives of `form`."""
        head.zero_grad()
        aux_head.zero_grad()
        step_tokens = count_loss_token(batches)
        calls_before = counting.calls
        global_tokens = None
        if form == "tensors":
            global_tokens = step_tokens
        elif form.startswith("numbers"):
            global_tokens = reduce_global_loss_token(step_tokens)
        out = []
        for feats, batch in zip(features, batches):
            local = count_loss_token(batch)
            if form == "numbers, int local counts":
                local = {key: int(value) for key, value in local.items()}
            losses = {
                "foundation_loss": local_mean_ce(head(feats), batch["labels"]),
                "aux_loss": local_mean_ce(aux_head(feats), batch["aux_labels"]),
            }
            scaled = mean_global_loss(losses, local, step_tokens, global_tokens)
            sum(scaled.values()).backward()
            out.extend(value.detach() for value in scaled.values())
        assert counting.calls - calls_before == (0 if form == "tensors" else 1), form
        return out + [p.grad.clone() for p in (*head.parameters(), *aux_head.parameters())]

    reference = run("memoized")
    for form in ("tensors", "numbers", "numbers, int local counts"):
        for got, ref in zip(run(form), reference, strict=True):
            assert torch.equal(got, ref), form


def test_reduce_global_loss_token_packs_exactly_the_given_keys_in_one_all_reduce(counting):
    batches = make_micro_batches(3)
    step_tokens = {**count_loss_token(batches), "extra_tokens": 5}
    reduced = reduce_global_loss_token(step_tokens)
    assert counting.calls == 1
    assert list(reduced) == list(step_tokens), "VeOmni's return: the same keys, in order"
    assert reduced == {key: float(value) for key, value in step_tokens.items()}
    assert all(type(value) is float for value in reduced.values())
    # sorted keys: aux, extra, foundation
    assert counting.buffers[0].tolist() == [int(step_tokens["aux_tokens"]), 5, int(step_tokens["foundation_tokens"])]


def test_reduce_global_loss_token_sums_over_ranks_and_detects_other_keys(monkeypatch):
    local = {"foundation_tokens": torch.tensor(3), "aux_tokens": torch.tensor(1)}
    sim = SimulatedPeers(monkeypatch, [{"aux_tokens": 10, "foundation_tokens": 20}], caller="reduce_global_loss_token")
    for _ in range(2):
        assert reduce_global_loss_token(local) == {"foundation_tokens": 23.0, "aux_tokens": 11.0}
    assert sim.sizes == [AGREEMENT_SIZE, 2], "agreed once, then exactly the given keys"

    sim.peers[0] = {"foundation_tokens": 10}  # the peer's batches lost a `<name>_labels` key
    with pytest.raises(LossKeyMismatchError, match=r"\['aux_tokens', 'foundation_tokens'\].*_labels"):
        reduce_global_loss_token(local)
    assert sim.sizes == [AGREEMENT_SIZE, 2, 2, AGREEMENT_SIZE]

    sim.peers[0] = {"foundation_tokens": 10}
    assert reduce_global_loss_token({"foundation_tokens": torch.tensor(3)}) == {"foundation_tokens": 13.0}


def test_reduce_global_loss_token_and_mean_global_loss_keep_separate_agreements(monkeypatch):
    """VeOmni's sequence calls both every step with different key sets: each is lean after its own agreement."""
    sim = SimulatedPeers(monkeypatch, [])
    peers = {
        "reduce_global_loss_token": [{"aux_tokens": 1, "foundation_tokens": 2}],
        "mean_global_loss": [{"foundation": 2}],
    }
    for seed in range(3):
        batches = make_micro_batches(2, seed=seed)
        sim.caller, sim.peers = "reduce_global_loss_token", peers["reduce_global_loss_token"]
        reduce_global_loss_token(count_loss_token(batches))
        sim.caller, sim.peers = "mean_global_loss", peers["mean_global_loss"]
        run_step(batches, ("foundation",))
    assert sim.sizes == [AGREEMENT_SIZE, AGREEMENT_SIZE, 2, 1, 2, 1]


@pytest.mark.parametrize("world", [1, 2])
def test_reduce_global_loss_token_with_too_many_keys_raises_on_every_rank(monkeypatch, world):
    """Keys come from the data: with peers, the limit is checked after the agreement, so every rank raises alike."""
    keys = {f"k{i}_tokens": i for i in range(MAX_LOSS_KEYS + 1)}
    sim = SimulatedPeers(monkeypatch, [dict(keys)] * (world - 1), caller="reduce_global_loss_token")
    with pytest.raises(ValueError, match="exceed MAX_LOSS_KEYS"):
        reduce_global_loss_token({key: torch.tensor(value) for key, value in keys.items()})
    assert sim.sizes == ([] if world == 1 else [AGREEMENT_SIZE])


def test_an_empty_key_set_is_never_agreed(monkeypatch):
    sim = SimulatedPeers(monkeypatch, [{}], caller="reduce_global_loss_token")
    assert reduce_global_loss_token({}) == {}
    assert reduce_global_loss_token({}) == {}
    assert sim.sizes == [AGREEMENT_SIZE, AGREEMENT_SIZE], "an empty lean buffer could not carry a poisoned sum"


def test_explicit_counts_reject_other_types_naming_the_key():
    with pytest.raises(TypeError, match=r"global_micro_batches_token_len\['foundation_tokens'\] is a str"):
        mean_global_loss(torch.tensor(1.0), {"foundation_tokens": 1}, {}, {"foundation_tokens": "6"})
