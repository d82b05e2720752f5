"""Routing replay (`veomni_lite.models.routing`) on every covered family's tiny model (float32, CPU, one process): a
recording holds each MoE layer's top-k per token, a replayed forward hands the experts exactly the given indices,
replaying a forward's own routing reproduces its output and gradients exactly, a different routing changes the output
while the router still gets a gradient, and `routing_mismatch` counts the differing token-layer decisions."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.models.moe_configs import MOE_TYPES, VOCAB, make_moe, token_batch
from tests.models.test_hf_models import make_lm
from veomni_lite.models.routing import record_routing, replay_routing, routers, routing_mismatch

FAMILIES = (*MOE_TYPES, "gpt_oss")


class GptOss(nn.Module):
    """transformers' GPT-OSS (its attention sinks need the eager attention, which the trainer's wrapper does not run)
    with the wrapper's call: `(input_ids, position_ids) -> {"logits"}`."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import AutoModelForCausalLM, GptOssConfig

        config = GptOssConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, pad_token_id=0,
        )  # fmt: skip
        torch.manual_seed(0)
        self.hf_model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
        for module in self.hf_model.modules():  # transformers initializes the router at 0: every choice a tie
            if type(module).__name__ == "GptOssTopKRouter":
                nn.init.normal_(module.weight, std=0.5)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, **_) -> dict[str, torch.Tensor]:
        return {"logits": self.hf_model(input_ids=input_ids, position_ids=position_ids).logits}


def build(family: str) -> nn.Module:
    return GptOss() if family == "gpt_oss" else make_moe(family)


def logits(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(input_ids=batch["input_ids"], position_ids=batch["position_ids"])["logits"]


def experts_see(model: nn.Module) -> tuple[list[torch.Tensor], list]:
    """(a list that each MoE layer's experts module appends the indices it is called with to, the hook handles)."""
    seen: list[torch.Tensor] = []
    experts = [module.experts for module in model.modules() if isinstance(getattr(module, "experts", None), nn.Module)]
    handles = [e.register_forward_pre_hook(lambda _, args: seen.append(args[1].clone())) for e in experts]
    return seen, handles


def router_grads(model: nn.Module, out: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad()
    out.square().mean().backward()
    return [router.weight.grad.clone() for router in routers(model)]


@pytest.mark.parametrize("family", FAMILIES)
def test_replaying_a_forward_s_own_routing_reproduces_it_exactly(family):
    model = build(family)
    batch = token_batch(2, 12)
    with record_routing(model) as recorded:
        natural = logits(model, batch)
    expected_layers = 1 if family == "deepseek_v3" else 2  # DeepSeek-V3's first layer is dense here
    assert len(recorded) == expected_layers
    assert all(r.shape == (24, 2) and r.dtype == torch.long for r in recorded)
    natural_grads = router_grads(model, natural)
    seen, handles = experts_see(model)
    with replay_routing(model, recorded):
        replayed = logits(model, batch)
        replayed_grads = router_grads(model, replayed)
    for handle in handles:
        handle.remove()
    assert torch.equal(replayed, natural)
    assert all(torch.equal(a, b) for a, b in zip(replayed_grads, natural_grads))
    assert all(torch.equal(s, r) for s, r in zip(seen, recorded)) and len(seen) == len(recorded)


def other_routing(recorded: list[torch.Tensor], experts: int, seed: int = 1) -> list[torch.Tensor]:
    """Per token and layer, top_k distinct experts drawn at random (most differ from the recording)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(r.shape[0], experts, generator=g).argsort(-1)[:, : r.shape[1]] for r in recorded]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_replayed_routing_is_what_the_experts_get_and_the_router_still_trains(family):
    model = build(family)
    batch = token_batch(2, 12)
    with record_routing(model) as recorded:
        natural = logits(model, batch)
    given = other_routing(recorded, routers(model)[0].num_experts)
    seen, handles = experts_see(model)
    with replay_routing(model, given), record_routing(model) as during:
        replayed = logits(model, batch)
        grads = router_grads(model, replayed)
    for handle in handles:
        handle.remove()
    assert len(seen) == len(given) and all(torch.equal(s, g) for s, g in zip(seen, given))
    assert all(torch.equal(d, g) for d, g in zip(during, given))  # a recording inside a replay holds the replay
    assert (replayed - natural).abs().max() > 1e-3
    assert all(torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads)
    # the router's gradient is that of the replayed choice: the own routing's differs
    assert not all(torch.equal(a, b) for a, b in zip(grads, router_grads(model, natural)))


@pytest.mark.parametrize("normalize", [True, False])
def test_the_routing_weights_are_the_softmax_at_the_replayed_experts_renormalized(normalize):
    """Qwen3-MoE: the weights the experts get are softmax(router logits) at the replayed experts, divided by their
    sum where norm_topk_prob, computed by hand."""
    model = make_moe("qwen3_moe", norm_topk_prob=normalize)
    batch = token_batch(1, 6)
    with record_routing(model) as recorded:
        logits(model, batch)
    given = other_routing(recorded, 8)
    router = routers(model)[0]
    inputs, weights = [], []
    router.register_forward_hook(lambda _, args, output: inputs.append(args[0]))
    model.hf_model.model.layers[0].mlp.experts.register_forward_pre_hook(lambda _, args: weights.append(args[2]))
    with replay_routing(model, given):
        logits(model, batch)
    probs = torch.softmax(inputs[0].reshape(-1, 32) @ router.weight.T, dim=-1).gather(-1, given[0])
    expected = probs / probs.sum(-1, keepdim=True) if normalize else probs
    torch.testing.assert_close(weights[0], expected, rtol=1e-6, atol=1e-7)


def test_mismatch_counts_the_token_layer_decisions_whose_expert_sets_differ():
    a = [torch.tensor([[0, 1], [2, 3], [4, 5]]), torch.tensor([[1, 2], [3, 0], [5, 6]])]
    b = [torch.tensor([[1, 0], [2, 4], [4, 5]]), torch.tensor([[1, 2], [0, 3], [6, 7]])]  # order within top-k ignored
    differing, counted = routing_mismatch(a, b)
    assert (int(differing), int(counted)) == (2, 6)
    differing, counted = routing_mismatch(a, b, mask=torch.tensor([True, False, True]))
    assert (int(differing), int(counted)) == (1, 4)
    assert [int(x) for x in routing_mismatch(a, a)] == [0, 6]
    with pytest.raises(ValueError, match="layer 1 has shapes"):
        routing_mismatch(a, [a[0], a[1][:2]])


def test_a_replay_of_the_wrong_shape_or_on_a_dense_model_is_a_clear_error():
    model = make_moe("qwen3_moe")
    batch = token_batch(2, 12)
    with record_routing(model) as recorded:
        logits(model, batch)
    with pytest.raises(ValueError, match=r"1 layers of routing for 2 MoE layers"), replay_routing(model, recorded[:1]):
        pass
    shape = r"layer 1 routes \(24, 2\) \(tokens, top_k\), the given routing is \(20, 2\)"
    with pytest.raises(ValueError, match=shape), replay_routing(model, [recorded[0], recorded[1][:20]]):
        logits(model, batch)
    with pytest.raises(ValueError, match="no mixture-of-experts router"), record_routing(make_lm()):
        pass


def test_qwen3_vl_moe_records_and_replays_its_decoder_s_routing():
    """The VL wrapper (image tokens in the batch): one recording per decoder layer over the row-major [B, S] tokens;
    replaying it reproduces the logits exactly, another routing reaches the experts."""
    from tests.models.test_hf_models import IMAGE, PAD
    from tests.models.test_moe_families import make_vl_moe
    from tests.models.test_vl_families import samples, without_labels
    from veomni_lite.models.qwen2_vl import collate_qwen2_vl

    model = make_vl_moe()
    batch = without_labels(collate_qwen2_vl(samples(), IMAGE, 2, PAD))
    with record_routing(model) as recorded:
        natural = model(**batch)["logits"]
    assert len(recorded) == 2 and all(r.shape == (batch["input_ids"].numel(), 2) for r in recorded)
    with replay_routing(model, recorded):
        assert torch.equal(model(**batch)["logits"], natural)
    given = other_routing(recorded, 4)
    seen, handles = experts_see(model)
    with replay_routing(model, given):
        model(**batch)
    for handle in handles:
        handle.remove()
    assert len(seen) == 2 and all(torch.equal(s, g) for s, g in zip(seen, given))
