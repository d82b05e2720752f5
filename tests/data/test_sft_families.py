"""Qwen2.5-VL and Qwen3-VL fine-tuned from a model directory through the SFT trainer, as Qwen2-VL is: images from
the files of a `messages` JSONL through the directory's own image processor, assistant-only labels; SP=2 with packing
and token budgets on 2 gloo ranks trains the steps of one process padded; the export loads in the family's
transformers class with the trained model's logits. (Exactness in float64 per layout and mode: the harness tests in
tests/distributed/test_packing_distributed.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.data.test_sft_training import digits_args, train
from tests.dist_helpers import run_distributed
from tests.models.small_hf import assert_vl_logits_match
from tests.trainer.helpers import losses_by_step, read_events
from veomni_lite.trainer.sft import SFTTrainer

FAMILIES = ("qwen2_5_vl", "qwen3_vl")
STEPS = ["--train.max_steps", "3", "--train.eval_interval", "0", "--logging.log_interval", "1"]
STEPS += ["--optim.warmup_steps", "0", "--checkpoint.save_interval", "0"]


@pytest.fixture(scope="module")
def demo(families_demo: Path) -> Path:
    return families_demo


def family_args(demo: Path, out: Path, family: str, *extra: str) -> list[str]:
    return [*digits_args(demo, out, *STEPS, *extra), "--model.pretrained_dir", str(demo / "models" / family)]


def _train(args: list[str], world_size: int = 1) -> SFTTrainer:
    return train("sft_digits.yaml", args, world_size)


def _sp_packed_budget(rank: int, world_size: int, demo: Path, out: Path) -> dict[str, dict[int, float]]:
    losses = {}
    for family in FAMILIES:
        extra = ["--parallel.sp_size", "2", "--data.packing", "true", "--data.max_tokens_per_micro_batch", "96"]
        trainer = _train(family_args(demo, out / family, family, *extra), world_size)
        trainer.loader.close()
        losses[family] = losses_by_step(read_events(out / family), "train/loss") if rank == 0 else {}
    return losses


@pytest.mark.slow
def test_sp2_packed_with_a_token_budget_trains_the_steps_of_one_process_padded(demo, tmp_path):
    sp = run_distributed(_sp_packed_budget, 2, demo, tmp_path / "sp", timeout_s=600)[0]
    for family in FAMILIES:
        padded = _train(family_args(demo, tmp_path / "one" / family, family))
        assert padded.loss_keys == ("foundation_loss",) and padded.images is not None
        one = losses_by_step(read_events(tmp_path / "one" / family), "train/loss")
        print(f"\n{family}: train/loss 1 process padded {one}, SP=2 packed with a budget {sp[family]}")
        assert one.keys() == sp[family].keys() == {1, 2, 3}
        assert all(sp[family][s] == pytest.approx(one[s], rel=1e-5) for s in one), family
        assert one[3] < one[1]


@pytest.mark.parametrize("family", FAMILIES)
def test_the_export_loads_in_the_familys_transformers_class_with_the_trained_logits(demo, tmp_path, family):
    import transformers

    from veomni_lite.export import export
    from veomni_lite.models.registry import family_of

    trained = _train(family_args(demo, tmp_path / "run", family, "--data.packing", "true"))
    export(tmp_path / "run", tmp_path / "export")
    hf_class = getattr(transformers, family_of(family).transformers_class)
    loaded = hf_class.from_pretrained(str(tmp_path / "export"), local_files_only=True).eval()
    assert_vl_logits_match(trained, {family: loaded})
