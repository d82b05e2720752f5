"""Tiny configs of transformers' mixture-of-experts causal LMs (width 32, two decoder layers, nothing downloaded) and
`make_moe`, the wrapper around a seeded model of one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from veomni_lite.models.hf_causal_lm import HFCausalLM, hf_config_from_dict

VOCAB = 64
_ATTENTION = {"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}
_COMMON = {"vocab_size": VOCAB, "num_hidden_layers": 2, "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2}
# model_type -> the config's fields; each has more experts than it routes to (top-2)
MOE_SETTINGS: dict[str, dict[str, Any]] = {
    "qwen3_moe": {
        **_ATTENTION,
        "intermediate_size": 64,
        "moe_intermediate_size": 16,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
    },
    "qwen2_moe": {
        **_ATTENTION,
        "intermediate_size": 64,
        "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 24,
        "num_experts": 8,
        "num_experts_per_tok": 2,
    },
    "mixtral": {**_ATTENTION, "intermediate_size": 16, "num_local_experts": 4, "num_experts_per_tok": 2},
    "olmoe": {**_ATTENTION, "intermediate_size": 16, "num_experts": 4, "num_experts_per_tok": 2},
    "deepseek_v3": {
        "hidden_size": 32,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "intermediate_size": 64,
        "moe_intermediate_size": 16,
        "first_k_dense_replace": 1,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_group": 2,
        "topk_group": 1,
        "n_shared_experts": 1,
        "kv_lora_rank": 16,
        "q_lora_rank": 16,
        "qk_rope_head_dim": 4,
        "qk_nope_head_dim": 4,
        "v_head_dim": 8,
    },
}
MOE_TYPES = tuple(MOE_SETTINGS)


def moe_config(model_type: str, **overrides: Any) -> Any:
    return hf_config_from_dict({"model_type": model_type, **_COMMON, **MOE_SETTINGS[model_type], **overrides})


def make_moe(model_type: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: Any) -> HFCausalLM:
    """The wrapper around a model of the tiny config, initialized from `seed`; DeepSeek-V3's routing bias (a buffer
    transformers leaves at 0) drawn too, so its grouped choice is not a tie. float64 runs the eager experts
    (torch's grouped_mm, transformers' default, takes no float64)."""
    torch.manual_seed(seed)
    model = HFCausalLM.from_config(moe_config(model_type, **overrides), dtype=dtype)
    if dtype == torch.float64:
        model.set_experts_implementation("eager")
    for module in model.modules():
        if hasattr(module, "e_score_correction_bias"):
            module.e_score_correction_bias.normal_(0, 0.1)
    return model


def token_batch(batch: int = 2, seq: int = 12, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random ids (no padding) with their next tokens as labels (the last position ignored) and positions."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, seq), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full((batch, 1), -100)], dim=1)
    return {"input_ids": ids, "labels": labels, "position_ids": torch.arange(seq).expand(batch, seq).clone()}


def build_qwen3_moe() -> HFCausalLM:
    """float64 Qwen3-MoE for the split-invariance harness (a module-level builder spawned processes import)."""
    return make_moe("qwen3_moe", seed=3, dtype=torch.float64)


def build_deepseek_v3() -> HFCausalLM:
    return make_moe("deepseek_v3", seed=3, dtype=torch.float64)


def write_moe_directory(source: Path, out: Path, top_k: int = 2, layers: int = 2) -> Path:
    """A tiny Qwen3-MoE directory at `out` (8 experts, `top_k`, `layers`, seed 0, float32) with the tokenizer of the
    dense model directory `source` (its vocabulary, end and padding ids): a policy for the demos' data."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    shutil.copytree(
        source, out, ignore=shutil.ignore_patterns("*.safetensors", "config.json", "generation_config.json")
    )
    text = AutoConfig.from_pretrained(source)
    config = AutoConfig.for_model(
        "qwen3_moe", vocab_size=text.vocab_size, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_experts=8, num_experts_per_tok=top_k, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=512, router_aux_loss_coef=0.01,
        eos_token_id=text.eos_token_id, pad_token_id=text.pad_token_id, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(out), safe_serialization=True)
    return out
