"""`trainers/train_preference.py`'s trainer on gloo: 1 process, DP=2 and SP=2 (packed, under a token budget) log the
same per-step losses and grad norms; precomputed references train like the live reference; an interrupt resumes to
the uninterrupted run; a bad pair in one rank's share of the rows is the same named error on every rank."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy
import pytest

from examples.preference_pairs import digit_pairs, help_pairs, implicit, write_jsonl
from tests.dist_helpers import run_distributed, run_ranks
from tests.float32_bounds import cancelling_atol
from tests.trainer.helpers import read_events, train_built
from veomni_lite.config import load_config
from veomni_lite.data.checks import DataError
from veomni_lite.preference.config import PrefConfig
from veomni_lite.preference.reference_pass import PrecomputedReference
from veomni_lite.preference.trainer import PreferenceTrainer

RTOL = 1e-5


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rows = help_pairs(16)
    return write_jsonl(tmp_path_factory.mktemp("pairs") / "pairs.jsonl", rows[:8] + [implicit(r) for r in rows[8:]])


def pref_args(demo: Path, pairs: Path, out: Path, *extra: str) -> list[str]:
    return [
        "--model.arch", "auto", "--model.pretrained_dir", str(demo / "models/qwen2_help"),
        "--data.format", "preference", "--data.train_path", str(pairs),
        "--train.micro_batch_size", "2", "--train.global_batch_size", "4", "--train.max_steps", "4",
        "--train.output_dir", str(out), "--optim.lr", "1e-3", "--optim.warmup_steps", "0",
        "--logging.log_interval", "1", "--logging.progress_bar", "false", "--logging.tensorboard", "false",
        "--logging.plot", "false", *extra,
    ]  # fmt: skip


def config(args: list[str], world_size: int = 1) -> Any:
    return load_config(None, args, world_size=world_size, sections={"pref": PrefConfig})


def train(args: list[str], world_size: int = 1, stop_after: int | None = None) -> PreferenceTrainer:
    return train_built(PreferenceTrainer(config(args, world_size)), stop_after)


def _ranked(rank: int, world: int, args: list[str]) -> None:
    train(args, world)


def by_step(out: Path, key: str) -> dict[int, float]:
    return {e["step"]: e[key] for e in read_events(out) if key in e}


def assert_same(
    got: dict[int, float], expected: dict[int, float], what: str, rtol: float | dict[int, float] = RTOL
) -> None:
    """Step by step: within `rtol` relative, or, given per step (a cancelling quantity's `cancelling_atol`), within
    that absolute bound."""
    assert sorted(got) == sorted(expected), what
    for step, value in expected.items():
        rel, abs_ = (0.0, rtol[step]) if isinstance(rtol, dict) else (rtol, 1e-7)
        assert got[step] == pytest.approx(value, rel=rel, abs=abs_), (what, step, got, expected)


# The gradient norm sums float32 gradients whose reduction order depends on the layout (each pair's sigmoid weight
# multiplies its two sides' sums of float32 log-probabilities): it agrees to 1e-4 (the float64 tests hold 1e-12).
RTOLS = {"train/grad_norm": 1e-4}


LOGPS = ("logps/chosen", "logps/rejected")
KEYS = ("train/pref_loss", "train/grad_norm", "rewards/margins", "rewards/accuracies", *LOGPS)


def tolerances(reference: dict[str, dict[int, float]], beta: float = PrefConfig().beta) -> dict[str, Any]:
    """`RTOLS`, and per step the absolute bound of `rewards/margins` (tests/float32_bounds.py): b ((pi_c - ref_c) -
    (pi_r - ref_r)) cancels float32 log-probability sums as large as |logps/chosen| and |logps/rejected| (simpo's,
    reference-free and per token, are smaller)."""
    margins = {step: cancelling_atol(2 * beta * sum(abs(reference[key][step]) for key in LOGPS), step)
               for step in reference["rewards/margins"]}  # fmt: skip
    return {**RTOLS, "rewards/margins": margins}


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["sigmoid", "simpo"])
def test_one_process_dp2_and_sp2_packed_train_alike(demo, pairs, tmp_path, loss):
    train(pref_args(demo, pairs, tmp_path / "one", "--pref.loss", loss))
    reference = {key: by_step(tmp_path / "one", key) for key in KEYS}
    assert sorted(reference["train/pref_loss"]) == [1, 2, 3, 4]
    assert reference["rewards/margins"][1] == (0.0 if loss == "sigmoid" else reference["rewards/margins"][1])
    layouts = {
        "dp2": [],
        "sp2": ["--parallel.sp_size", "2", "--data.packing", "true", "--data.max_tokens_per_micro_batch", "120"],
    }
    for name, extra in layouts.items():
        run_distributed(_ranked, 2, pref_args(demo, pairs, tmp_path / name, "--pref.loss", loss, *extra),
                        timeout_s=600)  # fmt: skip
        bounds = tolerances(reference)
        for key, expected in reference.items():
            assert_same(by_step(tmp_path / name, key), expected, f"{loss} {name} {key}", bounds.get(key, RTOL))
    # packed, each pair's prompt runs once (data.shared_prefix): fewer tokens for the same steps
    tokens = {name: by_step(tmp_path / name, "train/tokens") for name in ("one", "sp2")}
    assert all(tokens["sp2"][step] < tokens["one"][step] for step in tokens["one"]), tokens


def references(trainer: PreferenceTrainer) -> list[list[list[float]]]:
    pairs = trainer.train_pairs
    return [[side.tolist() for side in pairs.reference_logprobs(i)] for i in range(len(pairs))]


@pytest.mark.slow
def test_precomputed_references_train_like_the_live_reference(demo, pairs, tmp_path, monkeypatch):
    train(pref_args(demo, pairs, tmp_path / "live"))
    precomputed = pref_args(demo, pairs, tmp_path / "pre", "--pref.precompute_reference", "true")
    first = train(precomputed)
    for key in KEYS:
        assert_same(by_step(tmp_path / "pre", key), by_step(tmp_path / "live", key), key)
    (directory,) = (tmp_path / "pre" / "data_cache").glob("*/reference/*")  # in the train pairs' cache: Arrow + JSON
    assert sorted(p.name for p in directory.iterdir()) == ["meta.json", "shard-00000.arrow"]
    # a later run (a resume alike) reads the reference back: no forward computes it, the same values
    calls = []
    original = PrecomputedReference.write
    monkeypatch.setattr(PrecomputedReference, "write", lambda *a: calls.append(1) or original(*a))
    again = PreferenceTrainer(config(precomputed + ["--checkpoint.resume", "false"]))
    again.loader.close()
    assert calls == [] and again.train_pairs.reference is not None and references(again) == references(first)
    # a wrong reference (all zeros) trains differently: the values are used
    trainer = PreferenceTrainer(
        config(pref_args(demo, pairs, tmp_path / "zero", "--pref.precompute_reference", "true"))
    )
    assert len(calls) == 1, "another output directory: another cache, computed"
    computed = trainer.train_pairs.reference_logprobs
    monkeypatch.setattr(trainer.train_pairs, "reference_logprobs",
                        lambda i: tuple(numpy.zeros_like(side) for side in computed(i)))  # fmt: skip
    try:
        trainer.train()
    finally:
        trainer.metrics.close()
    zero = by_step(tmp_path / "zero", "train/pref_loss")
    assert abs(zero[1] - by_step(tmp_path / "live", "train/pref_loss")[1]) > 1e-3


def _reference_values(rank: int, world: int, args: list[str]) -> list[list[list[float]]]:
    trainer = PreferenceTrainer(config(args, world))
    trainer.loader.close()  # the process group stays: run_distributed tears it down
    return references(trainer)


@pytest.mark.slow
def test_dp2_and_sp2_precompute_the_reference_of_one_process(demo, tmp_path):
    """Each rank computes and writes its share of the rows (an SP group its dp share together; 13 pairs in
    micro-batches of 3: dp rank 0 runs one forward more than it needs, as FSDP wants), and every rank maps the whole
    reference: the values of one process."""
    odd = write_jsonl(tmp_path / "odd.jsonl", help_pairs(13))

    def args(out: str, *extra: str) -> list[str]:
        return pref_args(demo, odd, tmp_path / out, "--pref.precompute_reference", "true", "--train.micro_batch_size",
                         "3", "--train.global_batch_size", "6", *extra)  # fmt: skip

    one = _reference_values(0, 1, args("one"))
    for name, extra in {"dp2": [], "sp2": ["--parallel.sp_size", "2"]}.items():
        for got in run_distributed(_reference_values, 2, args(name, *extra), timeout_s=600):
            assert len(got) == len(one) == 13
            for mine, expected in zip(got, one):
                for side, want in zip(mine, expected):
                    assert side == pytest.approx(want, rel=1e-5, abs=1e-6), name
        meta = json.loads(next((tmp_path / name / "data_cache").glob("*/reference/*/meta.json")).read_text())
        assert [s["samples"] for s in meta["shards"]] == [6, 7], name


@pytest.mark.slow
def test_an_interrupt_resumes_to_the_uninterrupted_run(demo, pairs, tmp_path):
    train(pref_args(demo, pairs, tmp_path / "whole"))
    expected = by_step(tmp_path / "whole", "train/pref_loss")
    train(pref_args(demo, pairs, tmp_path / "cut"), stop_after=2)
    assert sorted(by_step(tmp_path / "cut", "train/pref_loss")) == [1, 2]
    run_distributed(_ranked, 2, pref_args(demo, pairs, tmp_path / "cut", "--checkpoint.resume", "true"),
                    timeout_s=600)  # on another world size  # fmt: skip
    assert_same(by_step(tmp_path / "cut", "train/pref_loss"), expected, "resumed")


@pytest.mark.slow
def test_vision_language_pairs_train_alike_on_sp2_packed(demo, tmp_path):
    """One image set per pair, both sides seeing it; the sides packed into one row on SP=2."""
    path = write_jsonl(tmp_path / "vl.jsonl", digit_pairs(demo / "digits", 8))

    def args(out: Path, *extra: str) -> list[str]:
        common = pref_args(demo, path, out, "--model.pretrained_dir", str(demo / "models/qwen2_vl_digits"), *extra)
        return common + ["--train.max_steps", "2"]

    train(args(tmp_path / "one"))
    extra = ["--parallel.sp_size", "2", "--data.packing", "true", "--data.max_tokens_per_micro_batch", "200"]
    run_distributed(_ranked, 2, args(tmp_path / "sp2", *extra), timeout_s=600)
    reference = {key: by_step(tmp_path / "one", key) for key in KEYS}
    bounds = tolerances(reference)
    for key, expected in reference.items():
        assert sorted(expected) == [1, 2]
        assert_same(by_step(tmp_path / "sp2", key), expected, f"vl {key}", bounds.get(key, RTOL))


def _build(rank: int, world: int, args: list[str]) -> str:
    try:
        PreferenceTrainer(config(args, world))
    except DataError as exc:
        return str(exc)
    return "no error"


@pytest.mark.slow
def test_a_bad_pair_in_one_ranks_share_is_the_same_named_error_on_every_rank(demo, tmp_path):
    rows = help_pairs(8)
    rows[5]["rejected"] = rows[5]["chosen"]  # row 5: in rank 1's share of the rows only
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    outcomes = run_ranks(_build, 2, pref_args(demo, path, tmp_path / "out"), timeout_s=300)
    messages = [outcomes[rank][1] for rank in (0, 1)]
    assert [outcomes[rank][0] for rank in (0, 1)] == ["ok", "ok"], messages
    assert messages[0] == messages[1] == f"{path}, row 5 (0-based): identical sides: chosen and rejected are the " \
        "same response"  # fmt: skip


@pytest.mark.slow
def test_under_lora_the_reference_is_the_base_with_the_adapters_off(demo, pairs, tmp_path):
    """No weights are cloned; step 1 trains at log 2 (the adapters start at B = 0, so the policy is the reference);
    the run then moves the margins, and DP=2 logs the same losses."""
    lora = ["--model.lora", "{rank: 4, alpha: 8, target_modules: [q_proj, v_proj, down_proj]}", "--optim.lr", "1e-2"]
    trainer = train(pref_args(demo, pairs, tmp_path / "one", *lora))
    assert trainer.reference is not None and trainer.reference.adapters and trainer.reference.values == []
    losses = by_step(tmp_path / "one", "train/pref_loss")
    assert losses[1] == pytest.approx(0.6931471805599453, abs=1e-6)
    assert by_step(tmp_path / "one", "rewards/margins")[4] != 0.0
    run_distributed(_ranked, 2, pref_args(demo, pairs, tmp_path / "dp2", *lora), timeout_s=600)
    assert_same(by_step(tmp_path / "dp2", "train/pref_loss"), losses, "lora dp2")


def trainer_timeout(args: list[str]) -> float:
    return float(args[args.index("--parallel.collective_timeout_s") + 1])


def _reference_counting_forwards(rank: int, world: int, args: list[str], fail: str = "") -> dict[str, Any]:
    """Build (the reference is computed in `on_model_built`): the values every rank maps and the forwards this rank
    ran. A fault on rank 1 only, `fail`: "write", its Arrow write of the reference fails after its first batch;
    "mkdir", it cannot make the reference's directory; "collate", its second micro-batch does not collate;
    "collate-late" (the negative control), a collate failing after the agreement, between two forwards, rank 1 then
    lingering past the collective timeout."""
    from veomni_lite.data import sft_cache

    forwards, collates, checked = [], [], []
    original, collate, check = PreferenceTrainer.model_output, PreferenceTrainer.collate, PrecomputedReference.check
    PreferenceTrainer.model_output = lambda self, batch: forwards.append(1) or original(self, batch)
    if fail.startswith("collate") and rank == 1:

        def failing_collate(self: PreferenceTrainer, samples: Any) -> Any:
            collates.append(1)
            late = fail == "collate-late"
            if (late and checked and len(collates) == checked[0] + 2) or (not late and len(collates) == 2):
                raise ValueError(f"pair {len(collates)}: ragged 'input_ids'")
            return collate(self, samples)

        def counted_check(self: PrecomputedReference, pairs: Any, micro_batches: Any) -> Any:
            problem = check(self, pairs, micro_batches)
            checked.append(len(collates))
            return problem

        PreferenceTrainer.collate, PrecomputedReference.check = failing_collate, counted_check
    if fail == "mkdir" and rank == 1:
        mkdir = Path.mkdir

        def failing_mkdir(path: Path, *args: Any, **kwargs: Any) -> None:
            if "reference" in path.parts and path.name.startswith(".tmp-"):
                raise PermissionError(13, "Permission denied", str(path))
            mkdir(path, *args, **kwargs)

        Path.mkdir = failing_mkdir
    if fail == "write" and rank == 1:
        write = sft_cache.write_batches

        def failing(path: Path, schema: Any, batches: Any) -> None:
            if "reference" not in path.parts:  # the pairs' own cache
                return write(path, schema, batches)
            write(path, schema, [next(iter(batches))])
            raise OSError(28, "No space left on device")

        sft_cache.write_batches = failing
    try:
        trainer = PreferenceTrainer(config(args, world))
    except (DataError, ValueError, RuntimeError) as exc:
        if fail == "collate-late" and rank == 1:
            time.sleep(trainer_timeout(args) + 0.5)
        return {"error": f"{type(exc).__name__}: {exc}", "forwards": len(forwards)}
    finally:
        PreferenceTrainer.model_output = original  # called in the test process too
        PreferenceTrainer.collate, PrecomputedReference.check = collate, check
    trainer.loader.close()
    return {"values": references(trainer), "forwards": len(forwards)}


@pytest.mark.slow
def test_a_token_budget_reference_pass_runs_the_agreed_forwards_and_equals_one_process(demo, tmp_path):
    """13 pairs, packed under 160 tokens, planned per window of 3 pairs as training plans them: dp rank 0 plans 4
    micro-batches, dp rank 1 plans 5; every rank runs 5 forwards (rank 0 one padding forward), at DP=2 and DP=2 x
    SP=2, and maps the reference one process computes. A write failing on rank 1 only is the same named error on
    every rank, after the same forwards (no rank left waiting in a forward); a directory rank 1 cannot make is that
    error before any forward."""
    odd = write_jsonl(tmp_path / "odd.jsonl", help_pairs(13))

    def args(out: str, *extra: str) -> list[str]:
        return pref_args(demo, odd, tmp_path / out, "--pref.precompute_reference", "true", "--train.micro_batch_size",
                         "3", "--train.global_batch_size", "6", "--parallel.collective_timeout_s", "30",
                         *extra)  # fmt: skip

    budget = ["--data.packing", "true", "--data.max_tokens_per_micro_batch", "160"]
    one = _reference_counting_forwards(0, 1, args("one"))  # micro-batches of 3 pairs in order: no planner
    assert one["forwards"] == 5 and len(one["values"]) == 13
    packed = _reference_counting_forwards(0, 1, args("packed", *budget))
    assert packed["forwards"] == 7  # windows of 6, 6 and 1 pairs: 3 + 3 + 1 micro-batches
    for mine, expected in zip(packed["values"], one["values"], strict=True):
        for side, want in zip(mine, expected, strict=True):
            assert side == pytest.approx(want, rel=1e-5, abs=1e-6), "packed"
    for name, world, extra in (("dp2", 2, []), ("dp2sp2", 4, ["--parallel.sp_size", "2"])):
        ranks = run_distributed(
            _reference_counting_forwards, world, args(name, *budget, *extra), timeout_s=600, pg_timeout_s=30
        )
        assert [r["forwards"] for r in ranks] == [5] * world, name
        for got in ranks:
            for mine, expected in zip(got["values"], one["values"], strict=True):
                for side, want in zip(mine, expected, strict=True):
                    assert side == pytest.approx(want, rel=1e-5, abs=1e-6), name
    for fault, forwards, cause in (("write", 5, "[Errno 28] No space left on device"), ("mkdir", 0, "[Errno 13]")):
        outcomes = run_ranks(_reference_counting_forwards, 2, args(fault, *budget), fault, timeout_s=300,
                             pg_timeout_s=30)  # fmt: skip
        results = [outcomes[rank] for rank in (0, 1)]
        assert [status for status, _ in results] == ["ok", "ok"], results
        assert [r["forwards"] for _, r in results] == [forwards, forwards], results
        assert results[0][1]["error"] == results[1][1]["error"], results
        assert f"data.cache_dir: {cause}" in results[0][1]["error"], results


@pytest.mark.slow
def test_a_collate_error_on_one_rank_in_the_reference_pass_is_agreed_before_any_forward(demo, tmp_path):
    """Issue 48: the reference pass collates (and slices) every micro-batch of its plan before the first forward and
    agrees the error with the plan, in its one all-reduce: rank 1's second micro-batch failing to collate is the same
    DataError on both ranks, naming rank 1, after no forward, well within the 4 s collective timeout. The negative
    control: a collate failing after the agreement leaves rank 0 in a forward until the (2 s) timeout, not told why."""
    odd = write_jsonl(tmp_path / "odd.jsonl", help_pairs(13))

    def args(out: str, timeout: str) -> list[str]:
        return pref_args(demo, odd, tmp_path / out, "--pref.precompute_reference", "true", "--train.micro_batch_size",
                         "3", "--train.global_batch_size", "6", "--parallel.collective_timeout_s", timeout)  # fmt: skip

    outcomes = run_ranks(_reference_counting_forwards, 2, args("agreed", "4"), "collate", timeout_s=300, pg_timeout_s=4)
    results = [outcomes[rank] for rank in (0, 1)]
    assert [status for status, _ in results] == ["ok", "ok"], results
    errors = [r["error"] for _, r in results]
    assert errors[0] == errors[1] == "DataError: pref.precompute_reference: rank 1: ValueError: pair 2: ragged " \
        "'input_ids'", errors  # fmt: skip
    assert [r["forwards"] for _, r in results] == [0, 0], results
    late = run_ranks(_reference_counting_forwards, 2, args("late", "2"), "collate-late", timeout_s=300, pg_timeout_s=2)
    (status0, rank0), (_, rank1) = late[0], late[1]
    assert status0 == "ok" and rank1["error"].startswith("ValueError: pair "), late
    assert "ragged" not in rank0["error"], rank0
    assert "timed out" in rank0["error"].lower() or "timeout" in rank0["error"], rank0
