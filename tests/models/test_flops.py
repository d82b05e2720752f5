"""A mixture of experts' FLOPs count the parameters a token runs through (top-k of the routed experts, the shared
experts, everything dense), for `train/tflops` and MFU: against a hand count from the config, against torch's own
count of every matmul of a forward + backward, and on Qwen3-30B-A3B's config built on the meta device."""

from __future__ import annotations

import pytest
import torch

from tests.models.moe_configs import MOE_TYPES, make_moe, token_batch
from veomni_lite.models.heads import active_parameters, active_shares
from veomni_lite.models.hf_causal_lm import HFCausalLM, hf_config_from_dict


def qwen3_moe_active(h: int, layers: int, heads: int, kv: int, hd: int, experts: int, k: int, inter: int, vocab: int):
    """(active, total) parameters of a Qwen3-MoE (untied head, every layer sparse), counted by hand."""
    attention = h * heads * hd + 2 * h * kv * hd + heads * hd * h + 2 * hd  # q, k, v, o, q_norm, k_norm
    expert = 3 * h * inter  # gate, up, down
    dense = attention + experts * h + 2 * h  # + router, the two layer norms
    embed_head_norm = 2 * vocab * h + h
    active = layers * (dense + k * expert) + embed_head_norm
    return active, layers * (dense + experts * expert) + embed_head_norm


def test_the_tiny_qwen3_moe_counts_top_k_of_its_experts_by_hand():
    model = make_moe("qwen3_moe")  # hidden 32, 2 layers, 4 / 2 heads of 8, 8 experts of 16, top-2, vocab 64
    active, total = qwen3_moe_active(32, 2, 4, 2, 8, 8, 2, 16, 64)
    assert active_parameters(model) == active
    assert sum(p.numel() for p in model.parameters()) == total
    embed = model.hf_model.get_input_embeddings().weight.numel()
    assert model.flops_per_token(12) == 6 * (active - embed) + 12 * 2 * 32 * 12
    every_expert = 6 * (total - embed) + 12 * 2 * 32 * 12  # what the count was before: every expert, every token
    print(f"\ntiny Qwen3-MoE: active {active}, total {total} ({total / active:.2f}x); FLOPs ratio "
          f"{every_expert / model.flops_per_token(12):.2f}")  # fmt: skip
    assert every_expert > model.flops_per_token(12)


@pytest.mark.parametrize("model_type", MOE_TYPES)
def test_every_family_s_routed_experts_count_top_k_of_num_experts(model_type):
    """Each family's expert tensors (and only they) count at top_k / num_experts; shared experts count whole."""
    model = make_moe(model_type)
    shares = active_shares(model)
    params = dict(model.named_parameters())
    routed = {name for name, p in params.items() if id(p) in shares}
    assert routed and all(".mlp.experts." in name for name in routed)
    assert all(shares[id(params[name])] == 2 / params[name].shape[0] for name in routed)
    assert not any(id(p) in shares for name, p in params.items() if "shared_expert" in name)


def counted_flops_per_token(model: HFCausalLM, seq: int) -> float:
    """torch's FlopCounterMode over one forward + backward of a [2, seq] batch, per token."""
    from torch.utils.flop_counter import FlopCounterMode

    batch = token_batch(2, seq)
    with FlopCounterMode(display=False) as counter:
        model(**batch)["foundation_loss"].backward()
    return counter.get_total_flops() / batch["input_ids"].numel()


def test_the_estimate_equals_torch_s_count_of_the_matmuls_with_eager_experts():
    """Eager experts run each routed expert on the tokens routed to it only, so torch counts exactly top_k experts
    per token. The estimate also counts the norm weights at 6 FLOPs each (no matmul), and the attention's 12 L d T,
    which torch's counter does not see on the CPU (its SDPA kernel has no FLOP formula; tests/examples checks that
    term against plain matmuls): exactly that much more. The count of every expert (the control) is off by the
    experts a token skips."""
    model = make_moe("qwen3_moe")
    model.hf_model.set_experts_implementation("eager")
    model.fused_lm_head = False  # the plain head: one matmul forward, two backward
    norms = sum(p.numel() for name, p in model.named_parameters() if "norm" in name)
    counted = counted_flops_per_token(model, 12)
    attention = 12 * 2 * 32 * 12
    assert model.flops_per_token(12) - 6 * norms - attention == counted
    experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    skipped = 6 * experts * (1 - 2 / 8)
    assert model.flops_per_token(12) + skipped - 6 * norms - attention != counted


def test_qwen3_30b_a3b_runs_about_3_3b_parameters_per_token():
    settings = {
        "model_type": "qwen3_moe",
        "hidden_size": 2048,
        "num_hidden_layers": 48,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "intermediate_size": 6144,
        "vocab_size": 151936,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
    }
    with torch.device("meta"):
        model = HFCausalLM.from_config(hf_config_from_dict(settings))
    active, total = qwen3_moe_active(2048, 48, 32, 4, 128, 128, 8, 768, 151936)
    assert active_parameters(model) == active and 3.2e9 < active < 3.4e9
    assert sum(p.numel() for p in model.parameters()) == total and 30e9 < total < 31e9
    embed = model.hf_model.get_input_embeddings().weight
    every_expert = 6 * (total - embed.numel()) + 12 * 48 * 2048 * 4096
    print(f"\nQwen3-30B-A3B: active {active / 1e9:.3f}B of {total / 1e9:.3f}B ({total / active:.2f}x); "
          f"FLOPs per token at 4096: {model.flops_per_token(4096):.4g}, every expert counted "
          f"{every_expert / model.flops_per_token(4096):.2f}x that")  # fmt: skip
    assert model.flops_per_token(4096) == 6 * (active - embed.numel()) + 12 * 48 * 2048 * 4096


def test_qwen3_vl_moe_s_decoder_experts_count_top_k_too():
    from tests.models.test_moe_families import make_vl_moe

    model = make_vl_moe()
    shares = active_shares(model)
    experts = [p for name, p in model.named_parameters() if ".mlp.experts." in name]
    assert len(experts) == 4 and all(shares.get(id(p)) == 2 / 4 for p in experts)  # 2 layers, top-2 of 4
    assert len(shares) == len(experts)
