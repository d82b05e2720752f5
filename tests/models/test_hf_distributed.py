"""The transformers models in their real trainers on real gloo ranks: Qwen2 causal LM (PydocLMTrainer) and Qwen2-VL
with the image head (DigitsVLTrainer). Every layout trains on the same global batches, so DP=2, SP=2 and DP=2 x SP=2
give the single-process numbers step by step (losses per head, grad norm, eval losses, caption accuracy), with an SP
shard that holds no targets; gradient accumulation 4 x 1 equals 1 x 4; the loss path costs one collective per step.

transformers costs seconds of import per process, so the multi-process runs are few and shared: one 2-rank spawn
trains, one after the other, DP=2 and SP=2 of both models (and SP=2 of the text model on padded samples), one 4-rank
spawn trains DP=2 x SP=2 of the VL model.
Module-scoped fixtures run each spawn once and the tests read what it recorded.

What the runs hold (checked on the recorded micro-batches, not assumed). With seed 1 the three global batches of
the VL model are, in micro-batches of two samples (U: image -> caption, 11 tokens; G: caption -> image codes, 70):
[G G | U G], [G G | G U], [G U | U U].
- An image-free micro-batch: under DP=2, rank 0 runs the vision tower on its dummy block in steps 1 and 2 while
  rank 1 runs it on an image (FSDP2 all-gathers the tower on both).
- A shard without targets: the U U pair is 11 tokens whose targets (the caption) sit at positions 6..9 after the
  shift; padded to 12 under SP=2, sp rank 0's shard (0..5) has no target of either head.
- qwen2_text: samples are 32 tokens; under SP=2 each shard holds 16 and the second shard's targets attend across the
  shards. The run "sp2_padded" pads them to 64 (`data.pad_to_multiple_of`), so the second half of every sequence is
  padding and sp rank 1 has no target in any micro-batch (a trailing shard without targets: by causality it cannot
  test attention across shards, hence both runs; both must equal the unpadded single-process run).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from examples import qwen2_vl_digits
from tests.dist_helpers import counting_calls, run_distributed
from tests.trainer.helpers import losses_by_step, run_trainer, tiny_config
from veomni_lite.config import Config
from veomni_lite.trainer.base import BaseTrainer
from veomni_lite.utils import loss_utils
from veomni_lite.utils.loss_utils import count_loss_token

KINDS = ("qwen2_vl", "qwen2_text")
STEPS = 3
LOSS_COLLECTIVES_PER_STEP = 1  # loss_utils' one packed all-reduce of the step's token counts, whatever the layout
SP_REL = 1e-4
DP_REL = 1e-5


def layout_config(kind: str, output_dir: Path, pad_to_multiple_of: int = 1, **train: Any) -> Config:
    """The config every layout of `kind` runs: global batch 4 in micro-batches of 2, eval at the last step."""
    return tiny_config(
        kind,
        output_dir,
        data={"pad_to_multiple_of": pad_to_multiple_of},
        seed=1,
        max_steps=STEPS,
        micro_batch_size=2,
        global_batch_size=4,
        eval_interval=STEPS,
        eval_batches=1,
        **train,
    )


COUNTS = ("train/tokens", "train/samples", "train/tokens_seen", "eval/caption_accuracy")


def compared_keys(events: list[dict[str, Any]]) -> list[str]:
    """Every loss (train and eval, per head), the grad norm, and the layout-independent counts."""
    keys = {key for event in events for key in event}
    return sorted(key for key in keys if key.endswith("loss") or key == "train/grad_norm" or key in COUNTS)


def max_rel_diffs(got: list[dict[str, Any]], expected: list[dict[str, Any]]) -> dict[str, float]:
    """Per compared key, the largest |got - expected| / |expected| over the steps (absolute where expected is 0)."""
    diffs = {}
    for key in compared_keys(expected):
        want, have = losses_by_step(expected, key), losses_by_step(got, key)
        assert sorted(have) == sorted(want), f"{key}: logged at steps {sorted(have)}, expected {sorted(want)}"
        diffs[key] = max(abs(have[s] - want[s]) / (abs(want[s]) or 1.0) for s in want)
    return diffs


def assert_equivalent(got: list[dict[str, Any]], expected: list[dict[str, Any]], rel: float, what: str) -> None:
    diffs = max_rel_diffs(got, expected)
    assert {"train/loss", "train/grad_norm"} <= set(diffs), f"{what}: compared only {sorted(diffs)}"
    print(f"\n{what}: max relative difference " + ", ".join(f"{k} {v:.2e}" for k, v in diffs.items()))
    bad = {key: diff for key, diff in diffs.items() if not diff <= rel}  # NaN fails too
    assert not bad, f"{what}: max relative differences above {rel}: {bad} (all keys: {diffs})"


def target_less_shards(sp_group_runs: list[dict[str, Any]], key: str = "foundation_tokens") -> list[tuple[int, int]]:
    """(micro-batch index, sp rank) of every shard without `key` targets whose micro-batch has them on another shard;
    `sp_group_runs`: the records of one sp group's ranks in sp-rank order (each rank's i-th record is the same
    micro-batch)."""
    per_rank = [run["micro_batches"] for run in sp_group_runs]
    assert len({len(records) for records in per_rank}) == 1, [len(records) for records in per_rank]
    found = []
    for index, shards in enumerate(zip(*per_rank)):
        counts = [shard[key] for shard in shards]
        found += [(index, sp_rank) for sp_rank, count in enumerate(counts) if count == 0 and sum(counts) > 0]
    return found


def assert_caption_queries_counted_once(runs: list[dict[str, Any]], what: str) -> None:
    """eval/caption_accuracy's reduced (correct, counted): every held-out image counted once, whatever the layout
    (under SP only the rank whose shard holds the query position counts it; each dp rank takes its share)."""
    for rank, run in enumerate(runs):
        assert [counted for _, counted in run["caption_counts"]] == [run["eval_images"]], (
            f"{what}, rank {rank}: reduced (correct, counted) {run['caption_counts']}, {run['eval_images']} images"
        )


# ---------------------------------------------------------------------------------------------- instrumented runs


@contextlib.contextmanager
def recording_results(owner: Any, name: str) -> Iterator[list[Any]]:
    """Patch `owner.name` with a wrapper that appends each call's result to the yielded list; restore on exit."""
    results: list[Any] = []
    original = getattr(owner, name)

    def recorded(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        results.append(result)
        return result

    setattr(owner, name, recorded)
    try:
        yield results
    finally:
        setattr(owner, name, original)


def _instrumented_run(kind: str, config: Config) -> dict[str, Any]:
    """Train on this rank (or in this process), recording per trained micro-batch (this rank's SP shard) its valid
    tokens per head, as `count_loss_token` gives them to `postforward`, and its number of images; per optimizer step
    the calls of `loss_utils.all_reduce`; and the VL eval's reduced caption counts (correct, counted)."""
    micro_batches_seen: list[dict[str, int]] = []
    step_collectives: list[int] = []
    eval_images: list[int] = []
    with (
        counting_calls(loss_utils, "all_reduce") as calls,
        recording_results(qwen2_vl_digits, "all_reduce") as caption_counts,
    ):

        def setup(trainer: BaseTrainer) -> None:
            eval_images.append(len(getattr(trainer.eval_dataset, "digits", ())))
            train_step = trainer.train_step

            def recording_train_step(micro_batches):
                for micro_batch in micro_batches:
                    record = {key: int(value) for key, value in count_loss_token(micro_batch).items()}
                    record["images"] = len(micro_batch.get("image_grid_thw", ()))
                    micro_batches_seen.append(record)
                before = len(calls)
                train_step(micro_batches)
                step_collectives.append(len(calls) - before)

            trainer.train_step = recording_train_step

        events = run_trainer(kind, config, setup=setup)
    return {
        "events": events,
        "micro_batches": micro_batches_seen,
        "step_collectives": step_collectives,
        "caption_counts": [list(counts) for counts in caption_counts],
        "eval_images": eval_images[0],
    }


def _layout_runs(rank: int, world_size: int, jobs: list[tuple[str, str, Config]]) -> dict[str, dict[str, Any]]:
    """Entry for `run_distributed`: train each (name, kind, config) in turn; events are kept on rank 0 only."""
    results = {}
    for name, kind, config in jobs:
        result = _instrumented_run(kind, config)
        if rank != 0:
            result["events"] = None
        results[name] = result
    return results


@pytest.fixture(scope="module")
def work_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hf_layouts")


@pytest.fixture(scope="module")
def single_process(work_dir) -> dict[str, dict[str, Any]]:
    """The reference of every layout: DP=1, SP=1, in this process."""
    return {kind: _instrumented_run(kind, layout_config(kind, work_dir / f"{kind}_single")) for kind in KINDS}


@pytest.fixture(scope="module")
def two_ranks(work_dir) -> list[dict[str, dict[str, Any]]]:
    """Per rank: DP=2 and SP=2 of both models, keyed "<kind>/dp2" and "<kind>/sp2", and "qwen2_text/sp2_padded"."""
    jobs = []
    for kind in KINDS:
        jobs.append((f"{kind}/dp2", kind, layout_config(kind, work_dir / f"{kind}_dp2")))
        jobs.append((f"{kind}/sp2", kind, layout_config(kind, work_dir / f"{kind}_sp2", sp_size=2)))
    padded = layout_config("qwen2_text", work_dir / "qwen2_text_sp2_padded", pad_to_multiple_of=64, sp_size=2)
    jobs.append(("qwen2_text/sp2_padded", "qwen2_text", padded))
    return run_distributed(_layout_runs, 2, jobs, timeout_s=600, pg_timeout_s=180)


@pytest.fixture(scope="module")
def four_ranks(work_dir) -> list[dict[str, dict[str, Any]]]:
    """Per rank: DP=2 x SP=2 of the VL model, keyed "qwen2_vl/dp2_sp2" (ranks 0, 1 and 2, 3 are the sp groups)."""
    jobs = [("qwen2_vl/dp2_sp2", "qwen2_vl", layout_config("qwen2_vl", work_dir / "qwen2_vl_dp2_sp2", sp_size=2))]
    return run_distributed(_layout_runs, 4, jobs, timeout_s=600, pg_timeout_s=180)


# ---------------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("kind", KINDS)
def test_grad_accumulation_4x1_equals_1x4(tmp_path, kind):
    """Micro-batch 1 x GA 4 == micro-batch 4 x GA 1 (same global batches; with seed 1 each VL global batch mixes
    11- and 70-token samples, so the micro-batches of GA 4 hold different numbers of targets)."""
    settings = {"max_steps": STEPS, "global_batch_size": 4, "seed": 1}
    big = run_trainer(kind, tiny_config(kind, tmp_path / "big", micro_batch_size=4, **settings))
    small = run_trainer(kind, tiny_config(kind, tmp_path / "small", micro_batch_size=1, **settings))
    assert_equivalent(small, big, 1e-5, f"{kind} GA 4x1 vs 1x4")


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_dp2_equals_dp1(kind, single_process, two_ranks):
    runs = [rank_runs[f"{kind}/dp2"] for rank_runs in two_ranks]
    assert_equivalent(runs[0]["events"], single_process[kind]["events"], DP_REL, f"{kind} DP=2 vs DP=1")
    if kind == "qwen2_vl":  # GA 1: each rank's i-th micro-batch is step i + 1
        assert_caption_queries_counted_once([single_process[kind], *runs], "qwen2_vl DP=1 and DP=2")
        images = [[record["images"] for record in run["micro_batches"]] for run in runs]
        print(f"qwen2_vl DP=2: images per step on rank 0, rank 1: {images}")
        assert any(not mine and theirs for mine, theirs in zip(*images)), (
            f"the run needs a step where one rank has no image (the dummy vision pass) and the other has: {images}"
        )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "target_less_shard"), [("qwen2_vl/sp2", True), ("qwen2_text/sp2", False), ("qwen2_text/sp2_padded", True)]
)
def test_sp2_equals_sp1(name, target_less_shard, single_process, two_ranks):
    runs = [rank_runs[name] for rank_runs in two_ranks]
    kind = name.split("/")[0]
    assert_equivalent(runs[0]["events"], single_process[kind]["events"], SP_REL, f"{name} vs SP=1")
    if kind == "qwen2_vl":
        assert_caption_queries_counted_once(runs, name)
    shards = target_less_shards(runs)
    print(f"{name}: (micro-batch, sp rank) without foundation targets: {shards}")
    if target_less_shard:
        assert shards, f"no SP shard without foundation targets occurred: {[run['micro_batches'] for run in runs]}"


@pytest.mark.slow
def test_vl_dp2_sp2_equals_sp1_with_a_shard_without_targets(single_process, four_ranks):
    runs = [rank_runs["qwen2_vl/dp2_sp2"] for rank_runs in four_ranks]
    assert_equivalent(runs[0]["events"], single_process["qwen2_vl"]["events"], SP_REL, "qwen2_vl DP=2 x SP=2 vs SP=1")
    assert_caption_queries_counted_once(runs, "qwen2_vl DP=2 x SP=2")
    shards = {dp_rank: target_less_shards(runs[2 * dp_rank : 2 * dp_rank + 2]) for dp_rank in (0, 1)}
    print(f"qwen2_vl DP=2 x SP=2: per dp rank, (micro-batch, sp rank) without foundation targets: {shards}")
    assert any(shards.values()), f"no SP shard without foundation targets: {[r['micro_batches'] for r in runs]}"


@pytest.mark.slow
def test_one_loss_collective_per_step_on_every_rank(two_ranks, four_ranks):
    """The contract: the loss normalization costs exactly ONE collective per optimizer step (loss_utils' packed
    all-reduce, counted as calls of `loss_utils.all_reduce` inside `train_step`), on every rank, under DP, SP and
    DP x SP alike (GA 2 under SP=2): none per micro-batch, none per SP shard. A change to loss_utils that adds a
    collective (say, a one-off agreement on the first step) changes this contract: restate it here, step by step."""
    assert {"qwen2_vl/sp2", "qwen2_vl/dp2", "qwen2_text/sp2"} <= set(two_ranks[1])
    for world in (two_ranks, four_ranks):
        for rank, rank_runs in enumerate(world):
            for name, run in rank_runs.items():
                assert run["step_collectives"] == [LOSS_COLLECTIVES_PER_STEP] * STEPS, (
                    f"{name}, rank {rank}: loss collectives per optimizer step {run['step_collectives']}, "
                    f"the contract is {LOSS_COLLECTIVES_PER_STEP} per step"
                )
