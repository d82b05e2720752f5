"""A transformers causal LM (Qwen2, Llama, ... any `AutoModelForCausalLM`) behind the trainer's model contract.

Built from a config dict (`{"model_type": "qwen2", "hidden_size": 64, ...}`, no download) or a local
`from_pretrained` directory. `forward(input_ids, position_ids, labels)` takes this rank's (possibly SP-sliced)
micro-batch with labels already shifted once (a packed row adds `attention_sequence_ids`, its whole row's samples on
the host, from which `decoder_attention_inputs` builds the block mask or flash-attention's boundaries), and returns
`{"foundation_loss": mean cross-entropy over this rank's valid targets}` (an exact 0 without targets), the LM head
fused with the cross-entropy unless `fused_lm_head` is False (`lm_head_loss`); with `logprobs=LogprobRequest(...)`
the targets' log-probabilities (and entropies) the policy and preference heads read, fused the same way
(`lm_head_logprobs`); without either it returns `{"logits"}`. The decoder runs with the positions it is given (global
positions under SP), so no model code changes for Ulysses.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from veomni_lite.loss_keys import ATTENTION_SEQUENCE_IDS
from veomni_lite.models.contract import TrainableModel
from veomni_lite.models.heads import LogprobRequest, decoder_flops_per_token, lm_head_logprobs, lm_head_loss
from veomni_lite.models.hf_attention import decoder_attention_inputs, enable_ulysses
from veomni_lite.models.pretrained import LOCAL_ONLY, load_config, save_config
from veomni_lite.models.registry import dtype_of


def hf_config_from_dict(settings: Mapping[str, Any]) -> Any:
    """A transformers config from `{"model_type": ..., **fields}`."""
    from transformers import AutoConfig

    settings = dict(settings)
    model_type = settings.pop("model_type", None)
    if not model_type:
        raise ValueError(f"model.hf needs a 'model_type' (e.g. 'qwen2'); got keys {sorted(settings)}")
    return AutoConfig.for_model(model_type, **settings)


class HFCausalLM(TrainableModel):
    """`AutoModelForCausalLM` with the loss head of the contract; `hf_model` is the plain transformers model.
    `export_dtype`: the dtype `veomni_lite.export` writes by default (the source directory's or config's)."""

    def __init__(self, hf_model: nn.Module, export_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.hf_model = hf_model
        self.export_dtype = export_dtype

    @classmethod
    def from_config(cls, config: Any, dtype: torch.dtype = torch.float32) -> HFCausalLM:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
        return cls(model, dtype_of(config))

    @classmethod
    def from_pretrained(cls, directory: str | Path, dtype: torch.dtype = torch.float32) -> HFCausalLM:
        """The directory's weights, cast to `dtype` whatever dtype the files hold."""
        from transformers import AutoModelForCausalLM

        source = dtype_of(load_config(directory))
        model = AutoModelForCausalLM.from_pretrained(
            str(directory), attn_implementation="sdpa", dtype=dtype, **LOCAL_ONLY
        )
        return cls(model, source)

    @property
    def config(self) -> Any:
        return self.hf_model.config

    fused_lm_head = True  # `model.fused_lm_head`: the loss without the whole logits (see `lm_head_loss`)
    host_inputs = (ATTENTION_SEQUENCE_IDS,)  # the trainer leaves it on the host: see `decoder_attention_inputs`

    def set_attn_implementation(self, name: str) -> None:
        """The decoder's attention (`model.attn_implementation`); transformers checks that it is installed."""
        self.hf_model.set_attn_implementation(name)

    def set_experts_implementation(self, name: str) -> None:
        """A mixture of experts' expert kernels (`model.experts_implementation`: transformers' `eager`, `batched_mm`,
        `grouped_mm` (its default where it runs), ...); a ValueError names the ones transformers has."""
        self.hf_model.set_experts_implementation(name)

    @property
    def loss_keys(self) -> tuple[str, ...]:
        return ("foundation_loss",)

    @property
    def layers(self) -> nn.ModuleList:
        return self.hf_model.model.layers

    def hidden_states(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_sequence_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The decoder's last hidden states [B, S, H]."""
        attention = decoder_attention_inputs(self.config, attention_sequence_ids, input_ids.device)
        hidden = self.hf_model.model(input_ids=input_ids, position_ids=position_ids, use_cache=False, **attention)
        return hidden.last_hidden_state

    def logits(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_sequence_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.hf_model.lm_head(self.hidden_states(input_ids, position_ids, attention_sequence_ids))

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        foundation_loss_weights: torch.Tensor | None = None,
        attention_sequence_ids: torch.Tensor | None = None,
        logprobs: LogprobRequest | None = None,
        **_: Any,
    ) -> dict[str, torch.Tensor]:
        if logprobs is not None:
            hidden = self.hidden_states(input_ids, position_ids, attention_sequence_ids)
            return lm_head_logprobs(self.hf_model.lm_head, hidden, logprobs, self.fused_lm_head)
        if labels is None:
            return {"logits": self.logits(input_ids, position_ids, attention_sequence_ids)}
        hidden = self.hidden_states(input_ids, position_ids, attention_sequence_ids)
        loss = lm_head_loss(self.hf_model.lm_head, hidden, labels, foundation_loss_weights, self.fused_lm_head)
        return {"foundation_loss": loss}

    def flops_per_token(self, seq_len: int) -> float:
        embed = self.hf_model.get_input_embeddings().weight
        return decoder_flops_per_token(
            self, self.config.num_hidden_layers, self.config.hidden_size, seq_len, exclude=(embed,)
        )

    def enable_sequence_parallel(self, sp_group: dist.ProcessGroup) -> None:
        enable_ulysses(self.config, (layer.self_attn for layer in self.layers), sp_group)

    def save_config(self, directory: str | Path) -> None:
        """`directory/config.json`: the transformers config this model is rebuilt from (see `veomni_lite.export`),
        with the dtype the export writes by default."""
        save_config(self.config, directory, self.export_dtype)

    def save_pretrained(self, directory: str | Path) -> list[str]:
        """Write a directory `AutoModelForCausalLM.from_pretrained` loads (config + safetensors); returns the files."""
        self.config._attn_implementation = "sdpa"
        self.hf_model.save_pretrained(str(directory), safe_serialization=True)
        return sorted(p.name for p in Path(directory).iterdir())
