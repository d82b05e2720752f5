"""Reward models (`pref.loss: bradley_terry`): 1 process and SP=2 packed log the same losses; the export loads in
`AutoModelForSequenceClassification` with the trained rewards; a DPO run exports a causal LM with its logits."""

from __future__ import annotations

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

    # the RL trainer's reward function `reward_model` scores the rendered prompt + completion + the end of turn
    from examples.preference_pairs import help_pairs
    from veomni_lite.rl.rewards import load_rewards

    (reward,) = load_rewards([{"name": "rm", "function": "reward_model", "path": str(tmp_path / "export"),
                               "suffix": "<|im_end|>\n"}])  # fmt: skip
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
