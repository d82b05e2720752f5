"""A transformers reward model (`AutoModelForSequenceClassification`, one label) behind the trainer's model contract.

`forward(input_ids, position_ids, attention_sequence_ids)` returns `{"scores": [B, S]}`, the score head on every
position's last hidden state (the preference trainer reads each side's score at its last token, on whichever SP shard
holds it; transformers' own forward pools at the last non-padding token, which is the same value). A causal LM
directory loads with a new, seeded score head; `save_pretrained` writes what `AutoModelForSequenceClassification`
loads (its config names `...ForSequenceClassification`, `num_labels` 1 and a `pad_token_id`).

Under `model.lora` the score head trains whole beside the adapters, as PEFT's `modules_to_save` of a SEQ_CLS task
(`lora_modules_to_save`, read by `veomni_lite.models.lora`): it is new, so a frozen one would leave the rewards a
fixed random projection of the hidden states. Checkpoints keep it with the adapters; the export writes it into the
PEFT adapter directory (`base_model.model.score.weight`) or, with `--merge`, into the merged model directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from veomni_lite.models.hf_causal_lm import HFCausalLM
from veomni_lite.models.pretrained import LOCAL_ONLY, load_config
from veomni_lite.models.registry import dtype_of

__all__ = ["HFRewardModel"]


def _one_label(config: Any) -> Any:
    config.num_labels = 1
    if getattr(config, "pad_token_id", None) is None:  # transformers pools at the last non-pad token of a batch
        config.pad_token_id = getattr(config, "eos_token_id", None) or 0
    return config


def _named(model: Any) -> Any:
    """The config names the sequence-classification class (a causal LM directory's names its own): what the export's
    family lookup (`veomni_lite.models.registry.REWARD_MODEL`) and `from_pretrained` read."""
    model.config.architectures = [type(model).__name__]
    return model


class HFRewardModel(HFCausalLM):
    """`AutoModelForSequenceClassification` with one label (see the module docstring)."""

    lora_modules_to_save = ("score",)
    peft_task_type = "SEQ_CLS"

    @classmethod
    def from_config(cls, config: Any, dtype: torch.dtype = torch.float32) -> HFRewardModel:
        from transformers import AutoModelForSequenceClassification

        model = AutoModelForSequenceClassification.from_config(_one_label(config), attn_implementation="sdpa",
                                                               dtype=dtype)  # fmt: skip
        return cls(_named(model), dtype_of(config))

    @classmethod
    def from_pretrained(cls, directory: str | Path, dtype: torch.dtype = torch.float32) -> HFRewardModel:
        from transformers import AutoModelForSequenceClassification

        config = _one_label(load_config(directory))
        source = dtype_of(config)
        model = AutoModelForSequenceClassification.from_pretrained(
            str(directory), config=config, attn_implementation="sdpa", dtype=dtype, **LOCAL_ONLY
        )
        return cls(_named(model), source)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_sequence_ids: torch.Tensor | None = None,
        **_: Any,
    ) -> dict[str, torch.Tensor]:
        hidden = self.hidden_states(input_ids, position_ids, attention_sequence_ids)
        # a copy, not a view of the head's [B, S, 1]: FSDP2 warns that an in-place op on a returned view would skip its
        # pre-backward hook
        return {"scores": self.hf_model.score(hidden).squeeze(-1).clone()}
