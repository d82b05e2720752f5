"""A family is whole in the registry: a toy vision-language family registered here (Qwen2-VL's classes under another
collate and image-token count) is what the SFT path reads and collates with, no trainer naming it; the model
contract's old import path still works; a second registration of a model_type is refused."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from tests.data.test_sft_families import _train, family_args
from veomni_lite.config import load_config
from veomni_lite.data.sft_dataset import merged_patches
from veomni_lite.models import registry
from veomni_lite.models.qwen2_vl import collate_vl
from veomni_lite.models.registry import Family, Vision, family_of, register_family
from veomni_lite.trainer.sft import SFTTrainer, build_sft_data

REPO = Path(__file__).resolve().parents[2]
CALLS: dict[str, int] = {"collate": 0, "image_tokens": 0}
EXTRA_TOKENS = 0  # the toy's image-token count: Qwen-VL's plus this many


def toy_collate(samples: Any, image_token_id: int, images: Any, pad_id: int, multiple: int, packing: bool) -> Any:
    CALLS["collate"] += 1
    return collate_vl(samples, image_token_id, images, pad_id, multiple, packing)


def toy_image_tokens(patches: int, processor: Any) -> int:
    CALLS["image_tokens"] += 1
    return merged_patches(patches, processor) + EXTRA_TOKENS


@pytest.fixture
def toy(monkeypatch: pytest.MonkeyPatch) -> Family:
    """Qwen2-VL's model_type taken over by a toy family (the real one left out of a copy of `FAMILIES`)."""
    qwen2_vl = family_of("qwen2_vl")
    monkeypatch.setattr(registry, "FAMILIES", [f for f in registry.FAMILIES if f is not qwen2_vl])
    vision = Vision(collate=f"{__name__}:toy_collate", image_tokens=f"{__name__}:toy_image_tokens")
    family = register_family(replace(qwen2_vl, name="toy_vl", vision=vision))
    monkeypatch.setitem(CALLS, "collate", 0)
    monkeypatch.setitem(CALLS, "image_tokens", 0)
    return family


def _image_sample_lengths(demo: Path, out: Path) -> list[int]:
    config = load_config(REPO / "configs" / "sft_digits.yaml", family_args(demo, out, "qwen2_vl"))
    _, _, train, _, images = build_sft_data(config)
    assert images is not None
    return [len(train[index]["input_ids"]) for index in range(len(train))]


def test_the_sft_data_counts_image_tokens_by_the_familys_rule(families_demo, tmp_path, toy, monkeypatch):
    assert family_of("qwen2_vl") is toy
    standard = _image_sample_lengths(families_demo, tmp_path / "standard")
    assert CALLS["image_tokens"] > 0
    monkeypatch.setattr(f"{__name__}.EXTRA_TOKENS", 3)
    longer = _image_sample_lengths(families_demo, tmp_path / "longer")
    # every digits sample holds one image: the family's three extra placeholders each
    assert [n + 3 for n in standard] == longer


def test_the_sft_trainer_collates_with_the_familys_collate(families_demo, tmp_path, toy):
    steps = ["--train.max_steps", "1", "--optim.warmup_steps", "0"]
    trainer: SFTTrainer = _train(family_args(families_demo, tmp_path / "run", "qwen2_vl", *steps))
    trainer.loader.close()
    assert CALLS["collate"] > 0 and CALLS["image_tokens"] > 0
    assert family_of(trainer.model_config) is toy and trainer.images is not None


def test_a_model_type_is_registered_once_and_the_text_family_takes_no_images():
    with pytest.raises(ValueError, match="registered"):
        register_family(replace(family_of("qwen2_vl"), name="again"))
    with pytest.raises(TypeError, match="takes no images"):
        registry.CAUSAL_LM.collate([], 0, None, 0)


def test_the_model_contract_keeps_its_old_import_path():
    from veomni_lite.models import contract
    from veomni_lite.trainer import model

    assert model.TrainableModel is contract.TrainableModel and model.on_host is contract.on_host
    assert model.HostInput is contract.HostInput and model.check_model_contract is contract.check_model_contract
