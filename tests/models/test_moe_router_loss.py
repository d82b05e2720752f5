"""MoE router losses (`veomni_lite.models.moe`): each balance mode against transformers or a float64 reference written
by hand (every sample run alone), over gradient accumulation, padding, packing and shared prompts; the global f in
the step's one all-reduce; which tokens count, with negative controls."""

from __future__ import annotations

import pytest
import torch

from tests.models.moe_fixtures import (
    EXPERTS,
    LAYERS,
    MOE,
    TOP_K,
    RoutedMoE,
    moe_samples,
    packed,
    packed_shared,
    padded,
    reference,
    tiny_moe,
)
from veomni_lite.config import ConfigError, load_config
from veomni_lite.config_sections import MoEConfig
from veomni_lite.data.collator import collate
from veomni_lite.data.packing import padding_micro_batch
from veomni_lite.models import moe
from veomni_lite.models.moe import ROUTER_LOSSES, RouterLosses, membership, router_losses, token_weights
from veomni_lite.plain_loop import LossStep
from veomni_lite.utils import loss_utils
from veomni_lite.utils.loss_utils import STEP_SLOTS, LossModes

F64 = 1e-12  # float64 sums in another order
F32_SUMS = 1e-6  # transformers' load_balancing_loss_func sums in float32 (eps 1.2e-7, a few dozen terms)


def _step(model: RoutedMoE, micro_batches: list[dict]) -> tuple[dict[str, float], list[torch.Tensor]]:
    """One step of the router heads through `LossStep`, as the trainer runs it: (the heads' step values, gradients)."""
    model.zero_grad(set_to_none=True)
    modes = model.router.modes(LossModes())
    step = LossStep(micro_batches, modes, extra_counts=model.router.counts)
    values: dict[str, float] = {}
    for batch, tokens in step:
        outputs = model(**batch)
        scaled = step.scaled({k: outputs[k] for k in model.loss_keys}, tokens)
        sum(scaled.values()).backward()
        for key, value in scaled.items():
            values[key] = values.get(key, 0.0) + float(value.detach())
    step.verify()
    grads = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
    return values, grads


def _reference_grads(loss: torch.Tensor, model: torch.nn.Module) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss.backward()
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]


def _close(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    scale = max(float(x.abs().max()) for x in b) or 1.0
    return max(float((x - y).abs().max()) for x, y in zip(a, b)) / scale


LAYOUTS = {  # the same 8 samples: one padded micro-batch, GA 4 x 2 padded, GA 2 x 4 packed with shared prompts, ...
    "padded/1": lambda s: [padded(s)],
    "padded/GA4": lambda s: [padded(s[i : i + 2]) for i in range(0, 8, 2)],
    "packed/GA2": lambda s: [packed(s[:4]), packed(s[4:])],
    "shared/GA2": lambda s: [packed_shared(s[:4]), packed_shared(s[4:])],
    "shared/GA3+budget-pad": lambda s: [packed_shared(s[:3]), packed_shared(s[3:]), padding_micro_batch(padded(s[:2]))],
}


def test_micro_batch_mode_is_transformers_aux_loss_on_the_micro_batch_padding_masked():
    model = tiny_moe()
    batch = padded(moe_samples()[:3])  # rows of 5 to 11 tokens, right-padded
    mask = (batch["sequence_ids"] >= 0).long()
    ours = RouterLosses(model, "micro-batch", aux_coef=None, z_coef=0.0)
    outputs = ours.routed(model, batch, lambda b: model(**b))
    hf = model.hf_model(input_ids=batch["input_ids"], attention_mask=mask, output_router_logits=True)
    assert ours.aux_coef == model.config.router_aux_loss_coef == 0.001  # moe.aux_loss_coef None: the model's
    assert float(outputs["router_aux_loss"].detach()) == pytest.approx(
        0.001 * float(hf.aux_loss.detach()), rel=F32_SUMS
    )
    # negative control: counting the padding (transformers without the mask) is another number
    unmasked = model.hf_model(input_ids=batch["input_ids"], output_router_logits=True).aux_loss
    assert abs(float(unmasked.detach()) - float(hf.aux_loss.detach())) > 1e-4


@pytest.mark.parametrize("balance", ["global-batch", "sequence"])
def test_global_batch_and_sequence_modes_are_the_hand_reference_on_every_layout(balance):
    samples = moe_samples()
    model = RoutedMoE(balance)
    ref = reference(model.inner, samples)
    model.router.global_f = ref["f"]  # global-batch: the step's own f (what the previous step's counts give)
    expected = ref["global-batch" if balance == "global-batch" else "sequence"]
    expected_grads = _reference_grads(expected + 0.01 * ref["z"], model)
    for name, layout in LAYOUTS.items():
        values, grads = _step(model, layout(samples))
        assert values["router_aux_loss"] == pytest.approx(float(expected.detach()), rel=F64), name
        assert values["router_z_loss"] == pytest.approx(0.01 * float(ref["z"].detach()), rel=F64), name
        assert _close(grads, expected_grads) < F64, name


def test_the_steps_counts_give_the_global_f_whatever_the_layout():
    samples = moe_samples()
    model = RoutedMoE("global-batch")
    ref = reference(model.inner, samples)
    for layout in LAYOUTS.values():
        _step(model, layout(samples))
        slots = model.router.step_slots(torch.device("cpu"))
        assert slots.tolist() == [*ref["counts"].long().tolist(), LAYERS * ref["tokens"]]
        model.router.set_global_counts(slots)
        assert torch.allclose(model.router.global_f, ref["f"], rtol=0, atol=1e-15)
    # negative control: the f of one micro-batch is not the global one
    _step(model, [padded(samples[:2])])
    model.router.set_global_counts(model.router.step_slots(torch.device("cpu")))
    assert float((model.router.global_f - ref["f"]).abs().max()) > 1e-3


def test_global_batch_with_a_micro_batch_f_or_counted_padding_misses_the_reference(monkeypatch):
    samples = moe_samples()
    model = RoutedMoE("global-batch")
    ref = reference(model.inner, samples)
    batches = LAYOUTS["padded/GA4"](samples)
    model.router.global_f = reference(model.inner, samples[:2])["f"]  # one micro-batch's f where the global is asked
    values, _ = _step(model, batches)
    assert abs(values["router_aux_loss"] - float(ref["global-batch"].detach())) > 1e-4
    model.router.global_f = ref["f"]
    monkeypatch.setattr(moe, "token_weights", lambda b, *_: torch.ones(b["input_ids"].numel(), dtype=torch.long))
    values, _ = _step(model, batches)  # padding counted
    assert abs(values["router_aux_loss"] - float(ref["global-batch"].detach())) > 1e-4


def test_the_first_step_has_a_uniform_f_whose_loss_is_the_constant_top_k():
    model = RoutedMoE("global-batch", z_coef=0.0)
    model.router.set_global_counts(model.router.step_slots(torch.device("cpu")))  # nothing counted yet
    assert torch.equal(model.router.global_f, torch.full((EXPERTS,), TOP_K / EXPERTS, dtype=torch.float64))
    values, grads = _step(model, [padded(moe_samples()[:4])])
    assert values["router_aux_loss"] == pytest.approx(TOP_K, rel=F64)
    assert max(float(g.abs().max()) for g in grads) < 1e-12


def test_the_previous_steps_counts_travel_in_the_steps_one_all_reduce(monkeypatch):
    calls = []
    original = loss_utils.all_reduce
    monkeypatch.setattr(loss_utils, "all_reduce", lambda *a, **k: calls.append(a[0].numel()) or original(*a, **k))
    monkeypatch.setattr(loss_utils, "group_size", lambda *a: 2)  # reduce as a 2-rank world (sum of one rank here)
    slots = torch.arange(EXPERTS + 1, dtype=torch.int64)
    step = LossStep([padded(moe_samples()[:2])], extra_counts={"router_aux_tokens": 1}, slots=slots)
    assert step.tokens[STEP_SLOTS] is slots
    assert torch.equal(step.step_slots(("foundation_loss", "router_aux_loss")), slots)
    (_, tokens), loss = next(iter(step)), torch.tensor(1.0, requires_grad=True)
    step.scaled({"foundation_loss": loss, "router_aux_loss": loss}, tokens)
    assert calls == [loss_utils.MAX_LOSS_KEYS + 5 + EXPERTS + 1], "one all-reduce: 8 counts, 5 agreement, E + 1"


def test_token_weights_count_a_shared_prompt_once_per_sample_and_never_the_padding():
    samples = moe_samples()[:4]  # a group of three sharing a 3-token prompt, then a lone sample
    batch = collate(samples, pad_to_multiple_of=64, packing=True, share_prefixes=True)
    weights = token_weights(batch)
    assert int(weights.sum()) == sum(s["input_ids"].numel() for s in samples)
    ids = batch["sequence_ids"].reshape(-1)
    assert set(weights[ids == -2].tolist()) == {3} and set(weights[ids == -1].tolist()) == {0}
    members = membership(batch)
    assert members.shape[0] == 4 and members.sum(1).tolist() == [s["input_ids"].numel() for s in samples]
    assert token_weights(padding_micro_batch(batch)).sum() > 0  # the data's; the heads zero a padding micro-batch
    counts = RouterLosses(tiny_moe(), "global-batch", 1.0, 0.0).counts(padding_micro_batch(batch))
    assert int(counts["router_aux_tokens"]) == 0


def test_the_moe_section_and_its_registry():
    assert ROUTER_LOSSES.names() == ["micro-batch", "global-batch", "sequence"]
    config = load_config(None, ["--moe.balance", "global-batch", "--moe.aux_loss_coef", "0.01"], world_size=1)
    assert (config.moe.balance, config.moe.aux_loss_coef, config.moe.z_loss_coef) == ("global-batch", 0.01, 0.0)
    assert load_config(None, ["--moe.aux_loss_coef", "null"], world_size=1).moe.aux_loss_coef is None
    with pytest.raises(ConfigError, match="moe.balance"):
        load_config(None, ["--moe.balance", "global"], world_size=1)
    assert router_losses(tiny_moe(), MoEConfig(balance="sequence")).balance == "sequence"  # SP too (distributed tests)
    assert router_losses(torch.nn.Linear(2, 2), MoEConfig()) is None  # a dense model: no router heads


def test_a_vision_language_moe_routes_through_the_same_hook():
    """Qwen3-VL-MoE (the decoder `models/qwen2_vl.py` wraps for the VL families): the text routers are captured, the
    micro-batch head is transformers' aux_loss times the text config's coefficient."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    text = {
        **{k: v for k, v in MOE.items() if k not in ("model_type", "router_aux_loss_coef")},
        "rope_parameters": {"rope_type": "default", "mrope_section": [2, 1, 1], "rope_theta": 10000.0},
    }
    vision = {"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2, "out_hidden_size": 32}
    config = AutoConfig.for_model("qwen3_vl_moe", text_config=text, vision_config=vision)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config)
    batch = {"input_ids": torch.randint(1, 60, (2, 7))}
    ours = RouterLosses(model, "micro-batch", aux_coef=None, z_coef=0.0)
    outputs = ours.routed(model, batch, lambda b: model(**b, output_router_logits=True))
    expected = config.get_text_config().router_aux_loss_coef * float(outputs["aux_loss"].detach())
    assert float(outputs["router_aux_loss"].detach()) == pytest.approx(expected, rel=F32_SUMS)
