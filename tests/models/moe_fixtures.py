"""A tiny Qwen3-MoE (8 experts, top-2) built from its transformers config, a model wrapper that adds the router heads
as the trainer does (for `check_split_invariance`), samples with shared prompts, and the float64 reference of every
router loss written by hand from each sample run alone."""

from __future__ import annotations

import copy
import functools
import types
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tests.models.test_hf_models import float64_norms
from veomni_lite.data.collator import collate
from veomni_lite.loss_keys import IGNORE_INDEX
from veomni_lite.models.hf_causal_lm import HFCausalLM, hf_config_from_dict
from veomni_lite.models.moe import RouterLosses, router_outputs

EXPERTS, TOP_K, LAYERS, VOCAB = 8, 2, 2, 64
MOE = {
    "model_type": "qwen3_moe",
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 32,
    "moe_intermediate_size": 16,
    "num_experts": EXPERTS,
    "num_experts_per_tok": TOP_K,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "router_aux_loss_coef": 0.001,
}


def tiny_moe(dtype: torch.dtype = torch.float64, seed: int = 0) -> HFCausalLM:
    """A fresh copy of the tiny Qwen3-MoE (built once per process: transformers' init is the slow part)."""
    return copy.deepcopy(_built(dtype, seed))


@functools.lru_cache(maxsize=2)
def _built(dtype: torch.dtype, seed: int) -> HFCausalLM:
    torch.manual_seed(seed)
    config = hf_config_from_dict(MOE)
    config._experts_implementation = "eager"  # grouped_mm has no float64 kernel
    model = HFCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():  # transformers initializes the routers at zero: give them a routing to balance
        for name, param in model.named_parameters():
            if name.endswith("gate.weight"):
                param.normal_(0, 0.5)
    return float64_routers(float64_norms(model)) if dtype == torch.float64 else model


def _router_forward(self: nn.Module, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`Qwen3MoeTopKRouter.forward` with the softmax in the logits' dtype (transformers': float32 always)."""
    logits = F.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)
    probs = torch.softmax(logits, dim=-1)
    top, indices = torch.topk(probs, self.top_k, dim=-1)
    if self.norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    return logits, top, indices


def float64_routers(model: nn.Module) -> nn.Module:
    """`model` with every router in float64 (as `float64_norms` for the norms): a shared prefix's gradient sums its
    branches in another order, which float32 routing weights would show at 1e-9."""
    for module in model.modules():
        if type(module).__name__.endswith("TopKRouter"):
            module.forward = types.MethodType(_router_forward, module)
    return model


def moe_samples(seed: int = 1) -> list[dict[str, torch.Tensor]]:
    """Eight samples: two groups of three sharing an untrained prompt (an RL group, a preference pair's prompt), two
    lone ones; lengths 5 to 11."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for group, members in ((0, 3), (1, 1), (2, 3), (3, 1)):
        prompt = torch.randint(1, VOCAB, (3 + group,), generator=g)
        for _ in range(members):
            rest = torch.randint(1, VOCAB, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g)
            ids = torch.cat([prompt, rest])
            labels = ids.clone()
            labels[: prompt.numel()] = IGNORE_INDEX
            samples.append({"input_ids": ids, "labels": labels})
    return samples


def padded(samples: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return collate(samples)


def packed_shared(samples: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return collate(samples, pad_to_multiple_of=4, packing=True, share_prefixes=True)


def packed(samples: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return collate(samples, pad_to_multiple_of=4, packing=True)


class RoutedMoE(nn.Module):
    """`tiny_moe` whose forward adds the router heads as `BaseTrainer` does (`RouterLosses.routed`); `extra_counts`
    is the heads' counts (`RouterLosses.counts`), which `check_split_invariance` adds to each micro-batch's."""

    def __init__(self, balance: str, global_f: torch.Tensor | None = None, z_coef: float = 0.01) -> None:
        super().__init__()
        self.inner = tiny_moe()
        self.router = RouterLosses(self.inner, balance, aux_coef=1.0, z_coef=z_coef)
        self.router.global_f = global_f

    @property
    def loss_keys(self) -> tuple[str, ...]:
        return self.router.loss_keys

    def extra_counts(self, micro_batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        return self.router.counts(micro_batch)

    def enable_sequence_parallel(self, group: Any) -> None:
        self.inner.enable_sequence_parallel(group)
        self.router.enable_sequence_parallel(group)

    def forward(self, **micro_batch: Any) -> dict[str, Any]:
        return self.router.routed(self.inner, micro_batch, lambda batch: self.inner(**batch))


def routed_moe_global(f: torch.Tensor) -> RoutedMoE:
    return RoutedMoE("global-batch", f)


def sample_logits(model: HFCausalLM, sample: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    """Each layer's router logits [n, E] of `sample` run alone (one row, no padding)."""
    ids = sample["input_ids"][None]
    with router_outputs(model) as record:
        model.hidden_states(ids, torch.arange(ids.shape[1])[None])
    return record.logits


def reference(model: HFCausalLM, samples: Sequence[Mapping[str, torch.Tensor]], f: torch.Tensor | None = None) -> dict:
    """By hand, in float64, every sample run alone: the step's own global f (counts / (L T)), the global-batch loss
    E sum_i f_i P_i (with `f`, default the step's own), the sequence loss (mean over samples of E sum_i f_si P_si) and
    the z-loss (token mean of the layer mean of logsumexp^2)."""
    per_sample = [sample_logits(model, s) for s in samples]
    total = sum(logits[0].shape[0] for logits in per_sample)
    counts = torch.zeros(EXPERTS, dtype=torch.float64)
    probs = torch.zeros(EXPERTS, dtype=torch.float64)
    sequence, z = 0.0, 0.0
    for logits in per_sample:
        n = logits[0].shape[0]
        c_s = torch.zeros(EXPERTS, dtype=torch.float64)
        p_s = torch.zeros(EXPERTS, dtype=torch.float64)
        for layer in logits:  # [n, E]: every token of the sample at one layer
            p = torch.softmax(layer, -1)
            c_s = c_s + torch.zeros_like(p).scatter_(-1, torch.topk(p.detach(), TOP_K).indices, 1.0).sum(0)
            p_s = p_s + p.sum(0)
            z = z + (torch.logsumexp(layer, -1) ** 2).sum() / LAYERS
        sequence = sequence + EXPERTS * ((c_s / (LAYERS * n)) * (p_s / (LAYERS * n))).sum()
        counts, probs = counts + c_s, probs + p_s
    own_f = counts / (LAYERS * total)
    f = own_f if f is None else f
    return {
        "f": own_f,
        "counts": counts,
        "tokens": total,
        "global-batch": EXPERTS * (f * probs / (LAYERS * total)).sum(),
        "sequence": sequence / len(samples),
        "z": z / total,
    }
