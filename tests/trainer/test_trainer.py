"""Trainer behaviour: layouts and micro-batching do not change the numbers; resume continues exactly."""

from __future__ import annotations

import pytest
from transformers.utils import is_flash_attn_2_available

from tests.dist_helpers import counting_calls, run_distributed
from tests.trainer.helpers import TRAINERS, losses_by_step, ranked_run, read_events, run_trainer, tiny_config
from veomni_lite.config import ConfigError, replace
from veomni_lite.metrics import accumulator
from veomni_lite.utils import loss_utils


def assert_same_losses(got: dict[int, float], expected: dict[int, float], rel: float = 1e-4) -> None:
    assert sorted(got) == sorted(expected)
    for step, value in expected.items():
        assert got[step] == pytest.approx(value, rel=rel), f"step {step}: {got[step]} != {value}"


@pytest.mark.parametrize("kind", ["text", "vlm"])
def test_grad_accumulation_equals_one_big_micro_batch(tmp_path, kind):
    """GA=4 x micro-batch 1 == GA=1 x micro-batch 4 on variable-length sequences (the 2024 HF GA bug)."""
    big = run_trainer(kind, tiny_config(kind, tmp_path / "big", micro_batch_size=4, global_batch_size=4))
    small = run_trainer(kind, tiny_config(kind, tmp_path / "small", micro_batch_size=1, global_batch_size=4))
    assert_same_losses(losses_by_step(small), losses_by_step(big), rel=1e-5)
    assert_same_losses(losses_by_step(small, "train/grad_norm"), losses_by_step(big, "train/grad_norm"), rel=1e-4)


@pytest.mark.slow
def test_dp2_equals_dp1(tmp_path):
    single = losses_by_step(run_trainer("vlm", tiny_config("vlm", tmp_path / "dp1")))
    config = tiny_config("vlm", tmp_path / "dp2")
    dp2 = run_distributed(ranked_run, 2, "vlm", config)[0]
    assert_same_losses(dp2, single)
    assert single[4] < single[1]


def test_resume_equals_uninterrupted(tmp_path):
    full = run_trainer("vlm", tiny_config("vlm", tmp_path / "full", max_steps=6))
    interrupted_dir = tmp_path / "resumed"
    run_trainer("vlm", tiny_config("vlm", interrupted_dir, max_steps=6), stop_after=3)
    assert [e["step"] for e in read_events(interrupted_dir)] == [1, 2, 3]
    resumed = run_trainer("vlm", tiny_config("vlm", interrupted_dir, max_steps=6, resume=True))
    assert [e["step"] for e in resumed] == [1, 2, 3, 4, 5, 6], "no gaps, no duplicates after resume"
    for key in ("train/loss", "train/image_decoder_loss", "train/grad_norm", "train/lr"):
        assert_same_losses(losses_by_step(resumed, key), losses_by_step(full, key), rel=1e-6)


def test_interrupt_flushes_the_open_window(tmp_path):
    run_trainer("text", tiny_config("text", tmp_path, max_steps=6, log_interval=2), stop_after=3)
    assert [e["step"] for e in read_events(tmp_path)] == [2, 3]


def test_final_step_is_always_logged(tmp_path):
    events = run_trainer("text", tiny_config("text", tmp_path, max_steps=7, log_interval=3))
    assert [e["step"] for e in events if "train/loss" in e] == [3, 6, 7]
    keys = set().union(*events)
    for key in ("train/loss", "train/foundation_loss", "train/grad_norm", "train/lr", "train/tokens_per_s"):
        assert key in keys


def test_metrics_cost_no_collective_per_micro_batch_and_two_per_log_window(tmp_path):
    """7 steps x GA 4, log every 3 steps -> 3 windows (3, 6, 7) -> 6 metric all-reduces, whatever the GA."""
    config = tiny_config("text", tmp_path, max_steps=7, log_interval=3, micro_batch_size=1, global_batch_size=4)
    with (
        counting_calls(accumulator, "all_reduce") as metric_calls,
        counting_calls(loss_utils, "all_reduce") as loss_calls,
    ):
        events = run_trainer("text", config)
    assert [e["step"] for e in events] == [3, 6, 7]
    assert len(metric_calls) == 6
    assert len(loss_calls) == 7, "one loss collective per optimizer step"


@pytest.mark.parametrize("kind", ["text", "qwen2_text"])
def test_activation_checkpointing_recomputes_each_layer_and_trains_alike(tmp_path, kind):
    calls: dict[bool, list[int]] = {}

    def count_layer_work(recompute: bool):
        def setup(trainer):
            calls[recompute] = []
            first_child = next(iter(trainer.model.layers[0].children()))
            first_child.register_forward_hook(lambda *_: calls[recompute].append(1))

        return setup

    runs = {}
    for recompute in (False, True):
        config = tiny_config(kind, tmp_path / str(recompute), max_steps=2)
        config = replace(config, parallel={"activation_checkpointing": recompute})
        runs[recompute] = run_trainer(kind, config, setup=count_layer_work(recompute))
    micro_batches = 2 * 4  # 2 steps x GA 4 (global batch 8, micro-batch 2)
    assert len(calls[False]) == micro_batches and len(calls[True]) == 2 * micro_batches, "recomputed in backward"
    assert_same_losses(losses_by_step(runs[True]), losses_by_step(runs[False]), rel=1e-6)


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("qwen2_text", r"model.attn_implementation 'flash_attention_2': .*FlashAttention2.* installed"),
        ("qwen2_vl", r"model.attn_implementation 'flash_attention_2': .*FlashAttention2.* installed"),
        ("vlm", r"model.attn_implementation 'flash_attention_2': TinyVLM runs its own attention"),
    ],
)
def test_an_attention_the_model_or_machine_cannot_run_is_a_config_error(tmp_path, kind, message):
    if kind != "vlm" and is_flash_attn_2_available():
        pytest.skip("flash-attn is installed here")
    config = replace(tiny_config(kind, tmp_path), model={"attn_implementation": "flash_attention_2"})
    with pytest.raises(ConfigError, match=message):
        TRAINERS[kind][0](config)


def test_the_eval_loops_metric_means_are_pooled_totals_over_counts_with_their_differences():
    """`eval/<name>` = total / count of the (total, count) rows summed over micro-batches (and ranks); a difference
    only where both sides counted something (the preference trainer's kto margins)."""
    from types import SimpleNamespace

    import torch

    from veomni_lite.trainer.base import BaseTrainer

    trainer = SimpleNamespace(control_group=None, metric_differences={"d": ("a", "b"), "e": ("a", "c")})
    sums = torch.tensor([[3.0, 4.0], [1.0, 2.0], [0.0, 0.0]], dtype=torch.float64)
    means = BaseTrainer._eval_metric_means(trainer, ("a", "b", "c"), sums)
    assert means == {"eval/a": 0.75, "eval/b": 0.5, "eval/c": 0.0, "eval/d": 0.25}
