"""LoRA on the vision-language families through the SFT trainer, from their directories: the adapters stay out of
the vision tower; the exported adapter directory loads in `PeftModel.from_pretrained(<family class>(BASE), EXPORT)`
with the trained model's logits on images, and `--merge`'s directory in the family class alone; SP=2 packed with a
token budget on 2 gloo ranks trains the steps of one process padded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.dist_helpers import run_distributed
from tests.models import lora_fixtures as lx
from tests.models.small_hf import assert_vl_logits_match
from tests.trainer.helpers import losses_by_step, read_events
from veomni_lite.models.lora import ADAPTER_CONFIG, lora_modules
from veomni_lite.trainer.sft import SFTTrainer

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
SP_PACKED = ["--parallel.sp_size", "2", "--data.packing", "true", "--data.max_tokens_per_micro_batch", "96"]


@pytest.fixture(scope="module")
def demo(families_demo: Path) -> Path:
    return families_demo


def _train(demo: Path, out: Path, family: str, world_size: int = 1, *extra: str) -> SFTTrainer:
    return lx.train("sft_digits.yaml", lx.digits_args(demo, out, family, *extra), world_size)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_adapter_directory_loads_in_peft_on_the_family_class_with_the_trained_logits(demo, tmp_path, family):
    import transformers
    from peft import PeftModel

    from veomni_lite.export import export
    from veomni_lite.models.registry import family_of

    trained = _train(demo, tmp_path / "run", family)
    assert all("visual" not in path for path, _ in lora_modules(trained.model))
    export(tmp_path / "run", tmp_path / "adapter")
    export(tmp_path / "run", tmp_path / "merged", merge=True)
    base = demo / "models" / family
    config = json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())
    assert config["base_model_name_or_path"] == str(base.resolve())
    hf_class = getattr(transformers, family_of(family).transformers_class)
    peft_model = PeftModel.from_pretrained(hf_class.from_pretrained(str(base)), str(tmp_path / "adapter")).eval()
    merged = hf_class.from_pretrained(str(tmp_path / "merged")).eval()
    assert_vl_logits_match(trained, {f"{family} peft": peft_model, f"{family} merged": merged})


def _sp_packed(rank: int, world_size: int, demo: Path, out: Path) -> dict[int, float]:
    _train(demo, out, "qwen2_vl", world_size, *SP_PACKED)
    return losses_by_step(read_events(out)) if rank == 0 else {}


@pytest.mark.slow
def test_sp2_packed_with_a_token_budget_trains_the_lora_steps_of_one_process_padded(demo, tmp_path):
    sp = run_distributed(_sp_packed, 2, demo, tmp_path / "sp", timeout_s=600)[0]
    _train(demo, tmp_path / "one", "qwen2_vl")
    one = losses_by_step(read_events(tmp_path / "one"))
    print(f"\nqwen2_vl LoRA: 1 process padded {one}, SP=2 packed with a budget {sp}")
    assert one.keys() == sp.keys() == {1, 2}
    assert all(sp[step] == pytest.approx(one[step], rel=1e-5) for step in one)
    assert one[2] != one[1]
