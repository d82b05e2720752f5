"""Ulysses SP on real gloo ranks: attention, gradients and whole training runs equal the no-SP results."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from examples.attention import causal_attention
from examples.tiny_lm import TinyLMConfig, set_attention_fn
from examples.tiny_vlm import TinyVLM, TinyVLMConfig
from tests.dist_helpers import counting_calls, run_distributed
from tests.trainer.helpers import losses_by_step, read_events, run_trainer, tiny_config
from veomni_lite.distributed.parallel_state import init_parallel_state
from veomni_lite.distributed.sequence_parallel import slice_micro_batch, ulysses_attention
from veomni_lite.utils import loss_utils
from veomni_lite.utils.loss_utils import IGNORE_INDEX, count_loss_token, mean_global_loss

B, S, H, D = 2, 10, 4, 8


def _full_attention_inputs() -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(7)
    return tuple(torch.randn(B, S, H, D, generator=gen, dtype=torch.float64) for _ in range(4))


def _sp_attention(rank: int, world_size: int) -> tuple[torch.Tensor, ...]:
    state = init_parallel_state(1, world_size)
    q, k, v, grad_out = _full_attention_inputs()
    chunk = S // world_size
    shard = slice(rank * chunk, (rank + 1) * chunk)
    q_s, k_s, v_s = (t[:, shard].clone().requires_grad_(True) for t in (q, k, v))
    out = ulysses_attention(causal_attention, state.sp_group)(q_s, k_s, v_s)
    out.backward(grad_out[:, shard])
    return out.detach(), q_s.grad, k_s.grad, v_s.grad


@pytest.mark.slow
def test_ulysses_attention_and_input_grads_equal_full_attention():
    q, k, v, grad_out = _full_attention_inputs()
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = causal_attention(q, k, v)
    out.backward(grad_out)
    results = run_distributed(_sp_attention, 2)
    got = [torch.cat([r[i] for r in results], dim=1) for i in range(4)]
    for actual, expected in zip(got, (out.detach(), q.grad, k.grad, v.grad)):
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-8)


def _tiny_vlm() -> TinyVLM:
    torch.manual_seed(3)
    lm = TinyLMConfig(vocab_size=25, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64)
    return TinyVLM(TinyVLMConfig(lm=lm, num_image_codes=9, image_token_id=3)).double()


def _vlm_batch() -> dict[str, torch.Tensor]:
    """Understanding-style samples whose labels all sit in the second half: the first SP shard has none."""
    gen = torch.Generator().manual_seed(11)
    seq = 20
    input_ids = torch.randint(5, 25, (2, seq), generator=gen)
    input_ids[:, 0] = 1
    input_ids[:, 1:17] = 3  # image placeholders
    labels = torch.full((2, seq), IGNORE_INDEX)
    labels[:, 16:19] = torch.randint(5, 25, (2, 3), generator=gen)
    return {
        "input_ids": input_ids,
        "labels": labels,
        "image_decoder_labels": torch.full((2, seq), IGNORE_INDEX),
        "position_ids": torch.arange(seq).expand(2, seq).clone(),
        "pixel_values": torch.rand(2, 3, 16, 16, generator=gen, dtype=torch.float64),
    }


def _vlm_step(model: TinyVLM, micro_batch: dict[str, torch.Tensor]) -> torch.Tensor:
    outputs = model(**micro_batch)
    token_len = count_loss_token(micro_batch)
    scaled = mean_global_loss({key: outputs[key] for key in model.loss_keys}, token_len, token_len)
    loss = sum(scaled.values())
    loss.backward()
    return loss.detach()


def _sp_vlm_grads(rank: int, world_size: int) -> dict:
    state = init_parallel_state(1, world_size)
    model = _tiny_vlm()
    set_attention_fn(model, ulysses_attention(causal_attention, state.sp_group))
    micro_batch = slice_micro_batch(_vlm_batch(), state.sp_rank, state.sp_size)
    shard_tokens = int(count_loss_token(micro_batch)["foundation_tokens"])
    loss = _vlm_step(model, micro_batch)
    grads = []
    for param in model.parameters():
        grad = param.grad.clone()
        dist.all_reduce(grad)
        grads.append(grad / world_size)  # FSDP's average over the dp x sp mesh
    dist.all_reduce(loss)
    return {"grads": grads, "loss": loss / world_size, "shard_tokens": shard_tokens}


@pytest.mark.slow
def test_vlm_gradients_with_sp2_equal_no_sp_including_a_shard_without_labels():
    model = _tiny_vlm()
    loss = _vlm_step(model, _vlm_batch())
    results = run_distributed(_sp_vlm_grads, 2)
    assert results[0]["shard_tokens"] == 0, "the test needs a shard without valid labels"
    for out in results:
        assert torch.isfinite(out["loss"])
        torch.testing.assert_close(out["loss"], loss, rtol=1e-5, atol=0)
        for got, param in zip(out["grads"], model.parameters()):
            assert torch.isfinite(got).all()
            torch.testing.assert_close(got, param.grad, rtol=1e-5, atol=1e-9)


def _sp_training_run(rank: int, world_size: int, config) -> dict | None:
    with counting_calls(loss_utils, "all_reduce") as calls:
        run_trainer("vlm", config)
    events = read_events(config.train.output_dir)
    return {
        "loss": losses_by_step(events),
        "grad_norm": losses_by_step(events, "train/grad_norm"),
        "loss_collectives": len(calls),
    }


@pytest.mark.slow
@pytest.mark.parametrize(("world_size", "sp_size"), [(2, 2), (4, 2)])
def test_vlm_training_with_sp_equals_no_sp(tmp_path, world_size, sp_size):
    steps = 3
    reference = run_trainer("vlm", tiny_config("vlm", tmp_path / "sp1", max_steps=steps))
    config = tiny_config("vlm", tmp_path / f"sp{sp_size}_w{world_size}", max_steps=steps, sp_size=sp_size)
    result = run_distributed(_sp_training_run, world_size, config, timeout_s=300)[0]
    for key, got in (("train/loss", result["loss"]), ("train/grad_norm", result["grad_norm"])):
        expected = losses_by_step(reference, key)
        assert sorted(got) == sorted(expected)
        for step in expected:
            assert got[step] == pytest.approx(expected[step], rel=1e-4), f"{key} step {step}"
    assert result["loss_collectives"] == steps, "the loss path issues exactly one collective per step under SP"


def test_only_per_position_keys_are_sliced_not_a_vl_batchs_patches():
    """`pixel_values` (image patches) and `image_grid_thw` are not per-position: never padded or sliced under SP, while
    the heads' per-position values (the critic's old values and returns among them) are."""
    from veomni_lite.distributed.sequence_parallel import is_sequence_key

    assert not any(is_sequence_key(key) for key in ("pixel_values", "image_grid_thw"))
    assert all(is_sequence_key(key) for key in ("value_old_values", "value_returns", "policy_advantages", "labels"))
