"""Reward models (`pref.loss: bradley_terry`): 1 process and SP=2 packed log the same losses; the export loads in
`AutoModelForSequenceClassification` with the trained rewards; a DPO run exports a causal LM with its logits. Under
LoRA the new score head trains whole (PEFT's `modules_to_save`): placed as PEFT places it, trained with the adapters
while the base stays put, checkpointed and resumed, and exported (PEFT's adapter directory and `--merge`) with the
trained rewards; with the head frozen (the negative control) the rewards' head never moves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.dist_helpers import run_distributed
from tests.pref.test_train_preference import RTOL, RTOLS, _ranked, assert_same, by_step, pref_args, train
from veomni_lite.export import export
from veomni_lite.models.registry import REWARD_MODEL, family_of

RM = ("--pref.loss", "bradley_terry", "--pref.center_rewards", "0.01")
RM_KEYS = ("train/pref_loss", "train/grad_norm", "rewards/accuracy", "rewards/mean")


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from examples.preference_pairs import help_pairs, write_jsonl

    return write_jsonl(tmp_path_factory.mktemp("pairs") / "pairs.jsonl", help_pairs(16))


def _scores(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    return model(input_ids=torch.tensor([ids]), position_ids=torch.arange(len(ids))[None])["scores"][0, -1]


@pytest.mark.slow
def test_reward_model_trains_alike_on_sp2_packed_and_exports_for_sequence_classification(demo, pairs, tmp_path):
    from transformers import AutoModelForSequenceClassification

    trainer = train(pref_args(demo, pairs, tmp_path / "one", *RM))
    reference = {key: by_step(tmp_path / "one", key) for key in RM_KEYS}
    extra = ["--parallel.sp_size", "2", "--data.packing", "true", "--data.max_tokens_per_micro_batch", "120"]
    run_distributed(_ranked, 2, pref_args(demo, pairs, tmp_path / "sp2", *RM, *extra), timeout_s=600)
    for key, expected in reference.items():
        assert_same(by_step(tmp_path / "sp2", key), expected, key, RTOLS.get(key, RTOL))

    step, files = export(tmp_path / "one", tmp_path / "export")
    assert step == 4 and "model.safetensors" in files
    loaded = AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "export"))
    assert type(loaded).__name__ == "Qwen2ForSequenceClassification" and loaded.config.num_labels == 1
    assert family_of(loaded.config) is REWARD_MODEL
    model = trainer.model.eval()
    for index in range(3):
        for ids in (trainer.train_pairs.side(index, which)[0].tolist() for which in ("chosen", "rejected")):
            with torch.no_grad():
                expected = _scores(model, ids)
                got = loaded(input_ids=torch.tensor([ids])).logits[0, 0]
            assert float(got) == pytest.approx(float(expected), rel=1e-4, abs=1e-5)

    # the RL trainer's reward function `reward_model` scores the rendered prompt + completion + the end of turn (by
    # default the one the export's chat template writes), batched: the trained rewards of the pair's sides
    from examples.preference_pairs import help_pairs
    from veomni_lite.rl.rewards import load_rewards

    (reward,) = load_rewards([{"name": "rm", "function": "reward_model", "path": str(tmp_path / "export")}])
    row, pairs = help_pairs(16)[0], trainer.train_pairs
    prompt = trainer.tokenizer.apply_chat_template([{"role": "user", "content": row["prompt"]}], tokenize=False,
                                                   add_generation_prompt=True)  # fmt: skip
    with torch.no_grad():
        expected = [float(_scores(model, pairs.side(0, which)[0].tolist())) for which in ("chosen", "rejected")]
    got = reward([prompt, prompt], [row["chosen"], row["rejected"]], [None, None], [{}, {}])
    assert got == pytest.approx(expected, rel=1e-4, abs=1e-5)


@pytest.mark.slow
def test_dpo_export_loads_as_a_causal_lm_with_the_trained_logits(demo, pairs, tmp_path):
    from transformers import AutoModelForCausalLM

    trainer = train(pref_args(demo, pairs, tmp_path / "dpo", "--train.max_steps", "2"))
    export(tmp_path / "dpo", tmp_path / "export")
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "export"))
    ids = trainer.train_pairs.side(0, "chosen")[0].tolist()
    with torch.no_grad():
        expected = trainer.model.eval()(input_ids=torch.tensor([ids]), position_ids=torch.arange(len(ids))[None])
        got = loaded(input_ids=torch.tensor([ids])).logits
    assert torch.allclose(got, expected["logits"], rtol=1e-4, atol=1e-5)
    initial = AutoModelForCausalLM.from_pretrained(str(demo / "models/qwen2_help"))
    with torch.no_grad():
        assert not torch.allclose(initial(input_ids=torch.tensor([ids])).logits, got, atol=1e-4)  # it trained


# ---------------------------------------------------------------- LoRA reward models


def test_under_lora_the_score_head_trains_whole_as_peft_modules_to_save():
    from peft import LoraConfig, get_peft_model
    from peft.utils import get_peft_model_state_dict
    from transformers import AutoModelForSequenceClassification

    from tests.models.test_hf_models import TEXT_SETTINGS
    from veomni_lite.models.hf_causal_lm import hf_config_from_dict
    from veomni_lite.models.hf_reward_model import HFRewardModel
    from veomni_lite.models.lora import LoraError, LoraSettings, adapter_state, apply_lora, peft_config

    torch.manual_seed(0)
    model = HFRewardModel.from_config(hf_config_from_dict(TEXT_SETTINGS))
    targets = apply_lora(model, LoraSettings(4, 8.0, 0.0, ("all-linear",)), seed=0)
    trained = {name for name, param in model.named_parameters() if param.requires_grad}
    assert "hf_model.score.weight" in trained and "score" not in targets
    assert all(".lora_" in name for name in trained - {"hf_model.score.weight"})
    config = peft_config(LoraSettings(4, 8.0, 0.0, ()), model.hf_model, targets, "base", "SEQ_CLS", ("score",))
    assert config["task_type"] == "SEQ_CLS" and config["modules_to_save"] == ["score"]
    # PEFT's own SEQ_CLS LoRA adapts the same layers and saves the same tensors under the same names
    hf_config = hf_config_from_dict(TEXT_SETTINGS)
    hf_config.num_labels, hf_config.pad_token_id = 1, 0
    theirs = get_peft_model(
        AutoModelForSequenceClassification.from_config(hf_config),
        LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8, target_modules="all-linear"),
    )
    assert set(adapter_state(model)) == set(get_peft_model_state_dict(theirs))
    with pytest.raises(LoraError, match=r"'score' names \['score'\], which train whole under LoRA"):
        apply_lora(
            HFRewardModel.from_config(hf_config_from_dict(TEXT_SETTINGS)), LoraSettings(4, 8.0, 0.0, ("score",)), 0
        )


def _full_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: (param.full_tensor() if hasattr(param, "full_tensor") else param).detach().clone()
        for name, param in model.named_parameters()
    }


def _rewards(model: torch.nn.Module, sequences: list[list[int]]) -> list[float]:
    with torch.no_grad():
        return [float(_scores(model.eval(), ids)) for ids in sequences]


@pytest.mark.slow
def test_a_lora_reward_model_trains_its_score_head_resumes_and_exports_the_trained_rewards(
    demo, pairs, tmp_path, monkeypatch
):
    from peft import PeftModel
    from safetensors import safe_open
    from transformers import AutoModelForSequenceClassification

    from tests.models.lora_fixtures import LORA_YAML
    from tests.pref.test_train_preference import config
    from tests.trainer.helpers import train_built
    from veomni_lite.models.hf_reward_model import HFRewardModel
    from veomni_lite.models.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS
    from veomni_lite.preference.trainer import PreferenceTrainer
    from veomni_lite.trainer.safe_load import load_dcp_metadata

    lora = ("--model.lora", LORA_YAML)
    trainer = PreferenceTrainer(config(pref_args(demo, pairs, tmp_path / "run", *RM, *lora)))
    train_pairs = trainer.train_pairs
    sequences = [train_pairs.side(i, which)[0].tolist() for i in range(3) for which in ("chosen", "rejected")]
    before, initial = _full_parameters(trainer.model), _rewards(trainer.model, sequences)
    trainer.model.train()
    train_built(trainer)
    after, trained = _full_parameters(trainer.model), _rewards(trainer.model, sequences)
    moved = {name for name in before if not torch.equal(before[name], after[name])}
    adapters = {name for name in before if ".lora_" in name}
    assert moved == adapters | {"hf_model.score.weight"}  # every adapter and the head; no base weight
    assert max(abs(a - b) for a, b in zip(initial, trained)) > 1e-3

    # the checkpoint holds the adapters and the head (and their optimizer state), not the base
    metadata = load_dcp_metadata(tmp_path / "run/checkpoints/step_00000004/.metadata")
    model_keys = {key for key in metadata.state_dict_metadata if key.startswith("model.")}
    assert model_keys == {f"model.{name}" for name in adapters | {"hf_model.score.weight"}}

    # an interrupted run resumes to the uninterrupted one (the head restored with the adapters)
    train(pref_args(demo, pairs, tmp_path / "cut", *RM, *lora), stop_after=2)
    train(pref_args(demo, pairs, tmp_path / "cut", *RM, *lora, "--checkpoint.resume", "true"))
    for key in RM_KEYS:
        assert_same(by_step(tmp_path / "cut", key), by_step(tmp_path / "run", key), key, RTOLS.get(key, RTOL))

    # PEFT's adapter directory (SEQ_CLS, the head as modules_to_save) and --merge's model directory: trained rewards
    base = demo / "models/qwen2_help"
    export(tmp_path / "run", tmp_path / "adapter")
    export(tmp_path / "run", tmp_path / "merged", merge=True)
    adapter_config = json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())
    assert adapter_config["task_type"] == "SEQ_CLS" and adapter_config["modules_to_save"] == ["score"]
    with safe_open(str(tmp_path / "adapter" / ADAPTER_WEIGHTS), framework="pt") as handle:
        assert "base_model.model.score.weight" in set(handle.keys())
    merged = AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "merged")).eval()
    assert family_of(merged.config) is REWARD_MODEL and merged.config.num_labels == 1
    peft_model = PeftModel.from_pretrained(
        AutoModelForSequenceClassification.from_pretrained(str(base), num_labels=1), str(tmp_path / "adapter")
    ).eval()
    # transformers' own PEFT integration reads the adapter directory too (the base's config names no label count)
    direct = AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "adapter"), num_labels=1).eval()
    for loaded in (merged, peft_model, direct):
        with torch.no_grad():
            got = [float(loaded(input_ids=torch.tensor([ids])).logits[0, 0]) for ids in sequences]
        assert got == pytest.approx(trained, rel=1e-4, abs=1e-5)

    # the negative control: the head frozen (no modules to save), it never moves, whatever the adapters learn
    monkeypatch.setattr(HFRewardModel, "lora_modules_to_save", ())
    frozen = train(pref_args(demo, pairs, tmp_path / "frozen", *RM, *lora))
    assert torch.equal(_full_parameters(frozen.model)["hf_model.score.weight"], before["hf_model.score.weight"])
    assert by_step(tmp_path / "frozen", "train/pref_loss") != by_step(tmp_path / "run", "train/pref_loss")
