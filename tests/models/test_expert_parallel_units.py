"""Expert parallelism's pieces in one process: the grouped expert matmul against a per-expert reference (experts
without rows included), and the config errors named before any collective."""

from __future__ import annotations

import pytest
import torch

from tests.models.moe_configs import make_moe
from tests.models.small_hf import small_config
from tests.models.test_moe_families import MOE_RUN
from veomni_lite.config import ConfigError
from veomni_lite.distributed.expert_parallel import check_expert_parallel, expert_modules, grouped_linear
from veomni_lite.models.hf_causal_lm import HFCausalLM, hf_config_from_dict


def _per_expert(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The reference: each expert's rows through its [out, in] weight, one expert at a time."""
    return torch.cat([rows @ w.T for rows, w in zip(x.split(counts.tolist()), weight)])


@pytest.mark.parametrize(
    ("dtype", "width", "grouped"),
    [(torch.float64, 8, False), (torch.float32, 8, True), (torch.float32, 6, False)],  # 6 floats: 24-byte rows
)
def test_grouped_linear_equals_each_expert_alone_with_idle_experts(dtype, width, grouped, monkeypatch):
    """`torch._grouped_mm` where it runs (float32, 16-byte rows), else the padded bmm (float64, odd widths)."""
    calls = []
    original = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or original(*a, **k))
    g = torch.Generator().manual_seed(0)
    counts = torch.tensor([3, 0, 5, 0, 1])  # experts 1 and 3 get no row
    x = torch.randn(int(counts.sum()), width, generator=g, dtype=dtype, requires_grad=True)
    weight = torch.randn(5, 4, width, generator=g, dtype=dtype, requires_grad=True)
    out = grouped_linear(x, weight, counts, transposed=False)
    ref = _per_expert(x, weight, counts)
    tol = 1e-14 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    grads = torch.autograd.grad(out.square().sum(), (x, weight))
    ref_grads = torch.autograd.grad(ref.square().sum(), (x, weight))
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    assert not grads[1][1].any() and not grads[1][3].any()  # an idle expert gets a zero gradient
    transposed = grouped_linear(x, weight.transpose(1, 2), counts, transposed=True)
    torch.testing.assert_close(transposed, ref, rtol=tol, atol=tol)
    assert bool(calls) == grouped


def test_ep_size_that_cannot_split_the_experts_is_a_config_error_naming_it():
    moe = make_moe("qwen3_moe", num_experts=6)
    assert len(expert_modules(moe)) == 2
    check_expert_parallel(moe, 2)
    check_expert_parallel(moe, 3)
    with pytest.raises(ValueError, match=r"parallel\.ep_size \(4\) does not divide the 6 experts of Qwen3MoeExperts"):
        check_expert_parallel(moe, 4)
    dense = HFCausalLM.from_config(
        hf_config_from_dict(
            {
                "model_type": "qwen3",
                "vocab_size": 64,
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": 1,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 8,
            }
        )  # fmt: skip
    )
    check_expert_parallel(dense, 1)
    with pytest.raises(ValueError, match=r"parallel\.ep_size \(2\): HFCausalLM has no fused routed experts"):
        check_expert_parallel(dense, 2)


def test_ep_size_not_dividing_the_world_or_an_hsdp_block_is_a_config_error(tmp_path):
    from tests.models.small_hf import CONFIGS, RUN, SMALL
    from veomni_lite.config import load_config

    def config(world: int, *extra: str):
        args = [*RUN, *SMALL["text"], *MOE_RUN, "--train.output_dir", str(tmp_path), *extra]
        return load_config(CONFIGS["text"], args, world_size=world)

    config(4, "--parallel.ep_size", "4", "--train.global_batch_size", "8")
    with pytest.raises(ConfigError, match=r"parallel\.ep_size \(3\) must be >= 1 and divide the world size \(4 = dp 4"):
        config(4, "--parallel.ep_size", "3", "--train.global_batch_size", "8")
    config(4, "--parallel.ep_size", "2", "--parallel.dp_replicate", "2", "--train.global_batch_size", "8")
    with pytest.raises(ConfigError, match=r"\(4 = dp 4 x sp 1\) / parallel\.dp_replicate \(2\): the experts are"):
        config(4, "--parallel.ep_size", "4", "--parallel.dp_replicate", "2", "--train.global_batch_size", "8")
    assert small_config("text", tmp_path).parallel.ep_size == 1


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_grouped_linear_of_no_row_gives_zero_gradients(dtype):
    """A rank that no other rank sent a row to: nothing out, zero expert gradients (torch's grouped_mm backward fails
    on zero rows, so this runs the padded bmm)."""
    x = torch.zeros(0, 8, dtype=dtype, requires_grad=True)
    weight = torch.randn(4, 16, 8, dtype=dtype, requires_grad=True)
    out = grouped_linear(x, weight, torch.zeros(4, dtype=torch.long), transposed=False)
    assert out.shape == (0, 16)
    out.sum().backward()
    assert weight.grad is not None and not weight.grad.any()
