"""Router losses of a Mixture-of-Experts decoder as loss heads of the contract (`router_aux`, `router_z`).

Capture. `routers(model)` lists the router modules of the model's own decoder (layer order) and where their output
holds the logits; `router_outputs(model)` hooks the modules transformers itself records router logits from (the
`OutputRecorder` of `_can_record_outputs["router_logits"]`, e.g. `Qwen3MoeTopKRouter`, whose output 0 is the logits)
and keeps, per layer, the logits [tokens, E] of the LAST forward run inside it (a reference or old-log-probability
pass run before the trained forward is dropped). `routing(model)` says whether a model routes at all.

Which tokens count. Token t has a weight w_t (`token_weights`): 0 on padding (`sequence_ids == -1`; never "labels
IGNORE": a prompt token is routed), 1 on a sample's own token, and m on a shared prefix (`sequence_ids == -2`, kept
once for the m samples of its group, `data.shared_prefix`), so a shared prompt counts once per sample that shares it.

Balance modes (`moe.balance`, the registry `ROUTER_LOSSES`). With p_{l,t} = softmax of layer l's logits at t, c_{l,t}
the 0/1 vector of its top-k experts, L the routed layers and E the experts, every mode uses transformers'
layer-averaged form (`load_balancing_loss_func`): f_i = sum_l sum_t w_t c_{l,t,i} / (L T), P_i = sum_l sum_t w_t
p_{l,t,i} / (L T) over a set of tokens of weight T = sum_t w_t, and loss = E sum_i f_i P_i (f sums to k; f has no
gradient).
- `micro-batch`: the set is the micro-batch shard as transformers sees it (padding masked, each position once):
  transformers' value on it; the head is the mean over the step's micro-batches (on every rank and SP shard) that
  route a token (count 1 each), as the HF drop-in and TRL train.
- `global-batch`: the set is every routed token of the optimizer step on every rank and shard. P is a token mean,
  exact over micro-batches through the loss core (count T); f's counts, E + 1 int64 slots `STEP_SLOTS`, travel in
  the step's one all-reduce, made before the first forward (`RouterLosses.step_slots`, `set_global_counts`), and are:
  - THIS step's, where every micro-batch carries its routing (`ROUTED_EXPERTS` [B, S, L, k]; `expert_counts`): an RL
    step after an old-log-probability pass (which records each sample's experts, replayed or not) or with rollout
    replay. The counts are of those experts: exactly the step's routing on the batch's first step (the old pass ran
    the same tokens with the same weights) and under replay (the forward uses them); without replay, a later step of
    the batch gets its tokens' routing under the batch's starting weights.
  - otherwise the PREVIOUS optimizer step's (its training forwards' counts): exact counts, one step late, at no extra
    forward or collective. The first step has no f: uniform f (k / E each), whose loss is the constant k (no
    gradient); a checkpoint keeps the last step's counts (`state_dict`), so a resumed step trains with the f of the
    uninterrupted run. A routing pre-pass and Qwen's per-micro-batch buffer were measured against it
    (`benchmarks/moe_global_f.py`, docs/moe.md).
- `sequence`: DeepSeek-V3's sequence-wise loss: the set is one sample (a row, a packed segment, with its shared
  prefix); the head is the mean over the step's samples (count: samples), in the same layer-averaged form (DeepSeek
  writes f_i = E / (k T) x count, so its alpha is our coefficient x k). Under Ulysses SP a sample's tokens are on
  several shards: every shard numbers the micro-batch's whole samples alike (`membership`), their counts are summed
  over the SP group (ONE all-reduce of [samples, E + 1] per micro-batch, beside SP's per-layer all-to-alls), each
  shard adds its own tokens' part of P (linear), and the first shard counts the samples.
`router_z`: ST-MoE's z-loss, the token mean of (1/L) sum_l logsumexp(logits_{l,t})^2 (count T).
The coefficients multiply the heads: `moe.aux_loss_coef` (None: the model config's `router_aux_loss_coef`) and
`moe.z_loss_coef` (0: no `router_z` head).

Trainers. `BaseTrainer` runs every trainer's forward (SFT, RL, preference, reward model: whatever output dict it
builds) inside `RouterLosses.routed`, which adds the heads of the model's last forward, and counts them per
micro-batch (`RouterLosses.counts` into `LossStep`); the heads are then normalized like any other by the loss core.
`write_loads` (at log steps): the window's exact per-layer loads over every rank (the training forwards' weighted
routed token-slots since the last log step) in `expert_load.jsonl` and `expert_load.png`, and the metric
`moe/load_imbalance`: the busiest expert's load over the mean load, worst layer, of those window loads (the same on
every rank; a micro-batch of a few tokens alone is nearly always at its ceiling E / k, so the window is what says
whether the experts are balanced).

Under Ulysses SP, `micro-batch` is transformers' value per shard (its mean over shards); `global-batch`, `sequence`
and `router_z` are exact, shared prefixes cut across shards included (`RouterLosses.enable_sequence_parallel`).
A companion model's routers (an RL critic's own MoE value model) are not captured: it trains without router losses.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from veomni_lite.distributed.collectives import all_reduce, collective_device
from veomni_lite.loss_keys import ATTENTION_SEQUENCE_IDS, SEQUENCE_IDS, loss_key, sequences_key, tokens_key
from veomni_lite.metrics.accumulator import MetricSpec
from veomni_lite.models.routing import ROUTED_EXPERTS
from veomni_lite.registries import Registry
from veomni_lite.utils.loss_utils import LossModes

__all__ = [
    *("ROUTER_AUX", "ROUTER_LOSSES", "ROUTER_Z", "RouterLosses", "RouterRecord"),
    *("expert_counts", "load_balancing_loss", "membership", "router_losses", "router_outputs", "routers", "routing"),
    *("routing_sums", "token_weights", "write_loads"),
]

ROUTER_AUX, ROUTER_Z = "router_aux", "router_z"
ROUTER_LOSSES = Registry("router balance")
LOAD_IMBALANCE = "moe/load_imbalance"


# ---------------------------------------------------------------- capture


def _recorder(model: nn.Module) -> tuple[type[nn.Module], int] | None:
    """(router class, index of the logits in its output) that transformers records `router_logits` from."""
    for module in model.modules():
        recorder = (getattr(type(module), "_can_record_outputs", None) or {}).get("router_logits")
        if recorder is not None:
            return recorder.target_class, recorder.index
    return None


def routers(model: nn.Module) -> tuple[list[nn.Module], int]:
    """(the routers of `model`'s own decoder in layer order, the index of the logits in their output); a companion
    model's (`model.companions`, e.g. an RL critic's value model) are not the model's."""
    others = {id(m) for companion in getattr(model, "companions", ()) for m in companion.modules()}
    recorder = _recorder(model)
    if recorder is None:
        return [], 0
    return [m for m in model.modules() if isinstance(m, recorder[0]) and id(m) not in others], recorder[1]


def routing(model: nn.Module) -> bool:
    """Whether the model has routers transformers records logits from (a Mixture-of-Experts decoder)."""
    return bool(routers(model)[0])


@dataclass
class RouterRecord:
    """The router logits of the last forward run inside `router_outputs`: one [tokens, E] tensor per routed layer, in
    layer order, tokens flattened from the micro-batch's [B, S] (this rank's shard)."""

    logits: list[torch.Tensor] = field(default_factory=list)


@contextlib.contextmanager
def router_outputs(model: nn.Module) -> Iterator[RouterRecord]:
    """Record the router logits of `model`'s forwards (see `RouterRecord`); hooks removed on exit. Reusable by any
    code that needs the routing of a forward (the router losses, routing replay)."""
    modules, index = routers(model)
    if not modules:
        raise ValueError(f"{type(model).__name__} has no router transformers records logits from (not an MoE)")
    record = RouterRecord()

    def hook(module: nn.Module, _args: Any, output: Any) -> None:
        if module is modules[0]:  # the first layer's router: a new forward starts
            record.logits = []
        record.logits.append(output[index] if isinstance(output, (tuple, list)) else output)

    handles = [m.register_forward_hook(hook) for m in modules]
    try:
        yield record
    finally:
        for handle in handles:
            handle.remove()


# ---------------------------------------------------------------- tokens and sequences


def token_weights(micro_batch: Mapping[str, Any], sp_rank: int = 0, sp_size: int = 1) -> torch.Tensor:
    """int64 [B * S]: how many samples each routed position of the micro-batch counts for (see the module docstring):
    0 on padding, 1 on a sample's token, m on a prefix shared by m samples; every position without `sequence_ids`.
    Under Ulysses SP (`sp_size` > 1) the micro-batch is shard `sp_rank`'s (see `membership`)."""
    ids = micro_batch.get(SEQUENCE_IDS)
    if ids is None:
        return torch.ones(micro_batch["input_ids"].numel(), dtype=torch.int64, device=micro_batch["input_ids"].device)
    if bool((ids == -2).any()):  # host tensors: the trainer reads the micro-batch before moving it
        return membership(micro_batch, sp_rank, sp_size).sum(0)
    return (ids >= 0).long().reshape(-1)


def membership(micro_batch: Mapping[str, Any], sp_rank: int = 0, sp_size: int = 1) -> torch.Tensor:
    """int64 [N, B * S]: 1 where position t belongs to sample n (a row's or packed segment's own tokens, and the
    shared prefix its branch follows: `veomni_lite.data.collator.pack` puts a group's prefix, then its branches).
    Under Ulysses SP (`sp_size` > 1; the micro-batch is shard `sp_rank`'s, `slice_micro_batch`) this shard's columns of
    the whole micro-batch's membership, so every shard numbers the same N samples alike: packed rows from the whole
    rows' `attention_sequence_ids` (kept whole under SP, a prefix marked <= -2), padded rows one sample a row."""
    ids = micro_batch[SEQUENCE_IDS]
    if sp_size == 1:
        return _membership(ids)
    rows, length = ids.shape
    whole = micro_batch.get(ATTENTION_SEQUENCE_IDS)
    if whole is None:  # padded rows: row r is sample r
        out = torch.zeros(rows, rows, length, dtype=torch.int64, device=ids.device)
        out[torch.arange(rows, device=ids.device), torch.arange(rows, device=ids.device)] = (ids >= 0).long()
        return out.reshape(rows, rows * length)
    start = sp_rank * length
    shard = _membership(whole.clamp(min=-2)).view(-1, rows, whole.shape[1])[:, :, start : start + length]
    return shard.reshape(-1, rows * length)


def _membership(ids: torch.Tensor) -> torch.Tensor:
    """`membership` of whole rows of `sequence_ids`."""
    rows, length = ids.shape
    prefix = ids == -2
    run_starts = prefix & ~F.pad(prefix[:, :-1], (1, 0), value=False)
    group = run_starts.long().cumsum(1)  # 0: before any prefix (lone samples); g: after the row's g-th prefix
    group = torch.where(group > 0, group + torch.arange(rows, device=ids.device)[:, None] * (length + 1), 0)
    own = ids >= 0
    sample = (torch.arange(rows, device=ids.device)[:, None] * (int(ids.max()) + 1 if own.any() else 1) + ids)[own]
    _, inverse = torch.unique(sample, return_inverse=True)
    count = int(inverse.max()) + 1 if inverse.numel() else 0
    positions = torch.nonzero(own.reshape(-1)).squeeze(1)
    out = torch.zeros(count, rows * length, dtype=torch.int64, device=ids.device)
    out[inverse, positions] = 1
    sample_group = torch.zeros(count, dtype=torch.int64, device=ids.device).scatter_reduce(
        0, inverse, group.reshape(-1)[positions], "amax"
    )
    shared = prefix.reshape(-1)[None, :] & (group.reshape(-1)[None, :] == sample_group[:, None])
    return out + (shared & (sample_group[:, None] > 0)).long()


# ---------------------------------------------------------------- the balance modes


@dataclass
class RouterInputs:
    """What a balance mode reads of one micro-batch's forward (layer sums: no [L, T, E] tensor is kept)."""

    probs: torch.Tensor  # [T, E] sum over the L layers of the router probabilities (float32 or wider)
    chosen: torch.Tensor  # [T, E] sum over the layers of the 0/1 top-k assignments (no gradient)
    layers: int
    weights: torch.Tensor  # [T] int64 (`token_weights`)
    micro_batch: Mapping[str, Any]
    global_f: torch.Tensor | None  # [E] the step's f (global-batch), None: uniform
    top_k: int
    sp: tuple[int, int, Any] = (0, 1, None)  # Ulysses SP: (this shard's rank, sp size, the SP group)


def routing_sums(
    logits: list[torch.Tensor], top_k: int, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sum_l p_l [T, E], sum_l c_l [T, E], loads [L, E] = sum_t w_t c_{l,t}) with p = softmax of the logits in
    float32 (float64 kept) and c the top-k 0/1 assignments (no gradient); no [L, T, E] tensor is built."""
    probs, chosen, loads = None, None, []
    for layer in logits:
        p = F.softmax(layer if layer.dtype == torch.float64 else layer.float(), dim=-1)
        c = torch.zeros_like(p).scatter_(-1, p.detach().topk(top_k, dim=-1).indices, 1.0)
        probs = p if probs is None else probs + p
        chosen = c if chosen is None else chosen + c
        loads.append(weights.to(c.dtype) @ c)
    return probs, chosen, torch.stack(loads)


def load_balancing_loss(probs: torch.Tensor, chosen: torch.Tensor, layers: int, weights: torch.Tensor) -> torch.Tensor:
    """E sum_i f_i P_i over the tokens of `weights` [T] (transformers' `load_balancing_loss_func` with
    attention_mask = weights): f_i = sum_t w_t chosen_{t,i} / (L T), P_i = sum_t w_t probs_{t,i} / (L T)."""
    w = weights.to(probs.dtype)[:, None]
    total = w.sum().clamp(min=1) * layers
    return probs.shape[-1] * ((chosen * w).sum(0) / total * ((probs * w).sum(0) / total)).sum()


@ROUTER_LOSSES.register("micro-batch", metrics=(loss_key(ROUTER_AUX),))
def micro_batch_balance(x: RouterInputs) -> torch.Tensor:
    """transformers' value on this micro-batch (shard), each routed position once; its count is 1."""
    return load_balancing_loss(x.probs, x.chosen, x.layers, (x.weights > 0).long())


@ROUTER_LOSSES.register("global-batch", metrics=(loss_key(ROUTER_AUX),))
def global_batch_balance(x: RouterInputs) -> torch.Tensor:
    """The local token mean (weights w) of E sum_i f_i p_{t,i} / L with the step's global f; count T."""
    experts = x.probs.shape[-1]
    f = x.global_f if x.global_f is not None else torch.full((experts,), x.top_k / experts, dtype=torch.float64)
    per_token = experts * (x.probs / x.layers * f.to(x.probs)).sum(-1)
    w = x.weights.to(x.probs.dtype)
    return (per_token * w).sum() / w.sum().clamp(min=1)


@ROUTER_LOSSES.register("sequence", metrics=(loss_key(ROUTER_AUX),))
def sequence_balance(x: RouterInputs) -> torch.Tensor:
    """The sum over this micro-batch's samples of each one's E sum_i f_i P_i, over the local count T (the core
    multiplies by T and divides by the step's samples: the mean over samples). Under Ulysses SP a sample's tokens
    are on several shards: its counts (f's, and T_s) are summed over the SP group (one all-reduce of [N, E + 1] per
    micro-batch), and each shard adds its tokens' part of P, which sums linearly over the shards."""
    sp_rank, sp_size, sp_group = x.sp
    members = membership(x.micro_batch, sp_rank, sp_size).to(x.probs)  # [N, T]
    counts = torch.cat([members @ x.chosen, members.sum(1, keepdim=True)], dim=1).detach()  # [N, E + 1]
    if sp_size > 1:
        counts = all_reduce(counts.double(), op="sum", group=sp_group).to(x.probs)
    sizes = counts[:, -1:].clamp(min=1) * x.layers  # L T_s
    f, p = counts[:, :-1] / sizes, members @ x.probs / sizes
    return x.probs.shape[-1] * (f * p).sum() / x.weights.sum().clamp(min=1).to(x.probs.dtype)


def expert_counts(experts: torch.Tensor, weights: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int64 [E + 1] of a given routing `experts` [B, S, L, top_k] with token weights `weights` [B * S]: per expert
    sum_l sum_t w_t c_{l,t,i}, then L T (T = sum_t w_t): what a training forward adds to a step's counts."""
    layers, top_k = experts.shape[-2:]
    chosen = experts.reshape(-1).long().to(weights.device)
    slot_weights = weights.long().repeat_interleave(layers * top_k)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=weights.device).index_add_(0, chosen, slot_weights)
    return torch.cat([counts, (weights.sum() * layers).reshape(1)])


def z_loss(logits: list[torch.Tensor], weights: torch.Tensor) -> torch.Tensor:
    """The local token mean (weights w) of (1/L) sum_l logsumexp(logits_{l,t})^2 (ST-MoE)."""
    z = sum(torch.logsumexp(x if x.dtype == torch.float64 else x.float(), -1) ** 2 for x in logits) / len(logits)
    w = weights.to(z.dtype)
    return (z * w).sum() / w.sum().clamp(min=1)


# ---------------------------------------------------------------- the heads of a trainer


def _weights(micro_batch: Mapping[str, Any], sp_rank: int = 0, sp_size: int = 1) -> torch.Tensor:
    """`token_weights`, all 0 in a no-target micro-batch (`padding_flag`: a copy run only to keep the ranks' counts of
    micro-batches equal under a token budget)."""
    weights = token_weights(micro_batch, sp_rank, sp_size)
    return torch.zeros_like(weights) if bool(micro_batch.get("padding_flag", False)) else weights


class RouterLosses:
    """The router heads of one MoE model: counts per micro-batch (`counts`), the heads of a captured forward
    (`heads`, `routed`) and, for `global-batch`, the f of a step: `step_slots` gives the previous step's local counts
    to the step's all-reduce, `set_global_counts` takes their sum (see the module docstring)."""

    def __init__(self, model: nn.Module, balance: str, aux_coef: float | None, z_coef: float, at: str = "moe") -> None:
        self.balance = balance
        self.fn: Callable[[RouterInputs], torch.Tensor] = ROUTER_LOSSES.get(balance, f"{at}.balance").fn
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.aux_coef = float(config.router_aux_loss_coef if aux_coef is None else aux_coef)
        self.z_coef = float(z_coef)
        self.top_k = int(config.num_experts_per_tok)
        self.experts = int(getattr(config, "num_experts", None) or config.num_local_experts)
        self.global_f: torch.Tensor | None = None
        self._step_counts: torch.Tensor | None = None  # this step's local [E + 1]: sum_l sum_t w c, then L T
        self._window_loads: torch.Tensor | None = None  # [L, E] weighted loads since the last `write_loads`
        self.sp: tuple[int, int, Any] = (0, 1, None)  # (shard rank, size, group) under Ulysses SP

    def enable_sequence_parallel(self, group: Any) -> None:
        """The micro-batches are shards of Ulysses SP `group`: whole samples are counted over it."""
        self.sp = (dist.get_rank(group), dist.get_world_size(group), group)

    def _weights(self, micro_batch: Mapping[str, Any]) -> torch.Tensor:
        return _weights(micro_batch, self.sp[0], self.sp[1])

    @property
    def loss_keys(self) -> tuple[str, ...]:
        return (loss_key(ROUTER_AUX),) + ((loss_key(ROUTER_Z),) if self.z_coef else ())

    def modes(self, modes: LossModes) -> LossModes:
        """`modes` with the router heads' own (whatever `loss.mode` says): a mean over micro-batches or tokens
        (token-mean over their counts), over samples for `sequence` (seq-mean-token-sum)."""
        aux = "seq-mean-token-sum" if self.balance == "sequence" else "token-mean"
        per_head = {**modes.per_head, ROUTER_AUX: aux, ROUTER_Z: "token-mean"}
        return LossModes(modes.default, per_head, modes.scale_factor)

    @staticmethod
    def specs() -> list[MetricSpec]:
        return [MetricSpec(LOAD_IMBALANCE, "max", ".3f")]

    def counts(self, micro_batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """The micro-batch's counts of the router heads (the loss core's n, summed into the step's D)."""
        tokens = self._weights(micro_batch).sum()
        out = {tokens_key(ROUTER_Z): tokens} if self.z_coef else {}
        if self.balance == "micro-batch":
            out[tokens_key(ROUTER_AUX)] = (tokens > 0).long()
        else:
            out[tokens_key(ROUTER_AUX)] = tokens
        if self.balance == "sequence":
            sp_rank, sp_size, _ = self.sp
            samples = torch.full_like(tokens, membership(micro_batch, sp_rank, sp_size).shape[0])
            if sp_size > 1:  # every shard numbers the whole micro-batch's samples: the first shard counts them
                real = not bool(micro_batch.get("padding_flag", False))
                out[sequences_key(ROUTER_AUX)] = samples if sp_rank == 0 and real else torch.zeros_like(samples)
            else:
                out[sequences_key(ROUTER_AUX)] = torch.where(tokens > 0, samples, 0)
        return out

    def heads(self, record: RouterRecord, micro_batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """{"router_aux_loss", ["router_z_loss"]}: the coefficient times each head's local mean; a training forward's
        loads join the log window's (`write_loads`)."""
        if not record.logits:
            raise RuntimeError("MoE router loss: no router logits were recorded in this forward")
        weights = self._weights(micro_batch).to(record.logits[0].device)
        probs, chosen, loads = routing_sums(record.logits, self.top_k, weights)
        x = RouterInputs(probs, chosen, len(record.logits), weights, micro_batch, self.global_f, self.top_k, self.sp)
        out = {loss_key(ROUTER_AUX): self.aux_coef * self.fn(x)}
        if self.z_coef:
            out[loss_key(ROUTER_Z)] = self.z_coef * z_loss(record.logits, weights)
        loads = loads.double()
        if torch.is_grad_enabled():  # training forwards only
            self._window_loads = loads if self._window_loads is None else self._window_loads + loads
        if self.balance == "global-batch" and torch.is_grad_enabled():
            local = torch.cat([loads.sum(0), (weights.sum() * len(record.logits)).reshape(1)]).round().long()
            self._step_counts = local if self._step_counts is None else self._step_counts + local
        return out

    def routed(
        self,
        model: nn.Module,
        micro_batch: Mapping[str, Any],
        forward: Callable[[Mapping[str, Any]], Mapping[str, Any]],
    ) -> dict[str, Any]:
        """`forward(micro_batch)`'s outputs plus the router heads of `model`'s last forward in it (whatever a trainer's
        forward builds, its trained forward runs last: reference passes run before), their metrics merged."""
        with router_outputs(model) as record:
            outputs = forward(micro_batch)
        heads = self.heads(record, micro_batch)
        return {**outputs, **heads}

    def step_slots(self, device: torch.device, micro_batches: Sequence[Mapping[str, Any]] = ()) -> torch.Tensor | None:
        """`global-batch`: the extra slots [E + 1] of this step's all-reduce, local counts: this step's own where
        every micro-batch carries its routing (`ROUTED_EXPERTS`: RL's old pass or rollout, `expert_counts`), else
        the previous step's (zeros before any); None for the other modes."""
        if self.balance != "global-batch":
            return None
        counts = self._step_counts
        self._step_counts = None
        if micro_batches and all(ROUTED_EXPERTS in mb for mb in micro_batches):
            counts = sum(expert_counts(mb[ROUTED_EXPERTS], self._weights(mb), self.experts) for mb in micro_batches)
        return (
            counts.to(device) if counts is not None else torch.zeros(self.experts + 1, dtype=torch.int64, device=device)
        )

    def state_dict(self, group: Any, is_main: bool) -> dict[str, Any]:
        """Collective (at a checkpoint, every rank): `global-batch`'s counts of the last step summed over `group`, which
        the next step's all-reduce would sum; rank 0 then holds them all (the others zeros), so that sum is unchanged
        and a resume on any world size restores it (`load_state_dict`)."""
        if self.balance != "global-batch":
            return {}
        counts = self.step_slots(collective_device(group))
        counts = all_reduce(counts, op="sum", group=group)
        self._step_counts = counts if is_main else torch.zeros_like(counts)
        return {"step_counts": counts.cpu().tolist()}

    def load_state_dict(self, state: Mapping[str, Any], is_main: bool) -> None:
        """The counts `state_dict` saved, on rank 0 (the others none): the resumed step trains with the f the
        uninterrupted run would have."""
        if "step_counts" in state:
            counts = torch.tensor(state["step_counts"], dtype=torch.int64)
            self._step_counts = counts if is_main else torch.zeros_like(counts)

    def set_global_counts(self, totals: torch.Tensor) -> None:
        """The previous step's counts summed over every rank: f_i = counts_i / (L T); none yet: uniform f."""
        total = totals[-1].double()
        uniform = torch.full((self.experts,), self.top_k / self.experts, dtype=torch.float64, device=totals.device)
        self.global_f = torch.where(total > 0, totals[:-1].double() / total.clamp(min=1), uniform)


def router_losses(model: nn.Module, moe: Any) -> RouterLosses | None:
    """The router heads of `model` under the config section `moe` (`MoEConfig`), None for a model that does not route
    (under Ulysses SP, `RouterLosses.enable_sequence_parallel`)."""
    if not routing(model):
        return None
    return RouterLosses(model, moe.balance, moe.aux_loss_coef, moe.z_loss_coef)


def write_loads(router: RouterLosses, step: int, output_dir: Path, group: Any, is_main: bool) -> float | None:
    """At a log step, on every rank: the window's per-layer expert loads (weighted routed token-slots) summed over
    `group` (ONE all-reduce, at log steps only), appended by rank 0 to `expert_load.jsonl` ({step, loads [L][E],
    imbalance [L]: the busiest expert's load over the mean}) and drawn as `expert_load.png` (load / mean, layer x
    expert). Returns the worst layer's imbalance (`moe/load_imbalance`, the same on every rank), None without a
    training forward in the window."""
    loads = router._window_loads
    router._window_loads = None
    if loads is None:  # no training forward since the last write: every rank alike (the same steps ran)
        return None
    loads = all_reduce(loads, op="sum", group=group).cpu()
    relative = loads / loads.mean(-1, keepdim=True).clamp(min=1e-12)
    imbalance = float(relative.max())
    if not is_main:
        return imbalance
    row = {"step": step, "loads": loads.tolist(), "imbalance": relative.max(-1).values.tolist()}
    with open(output_dir / "expert_load.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    figure = Figure(figsize=(max(4.0, 0.3 * loads.shape[1] + 2), max(2.5, 0.3 * loads.shape[0] + 1.5)))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    image = axes.imshow(relative.numpy(), aspect="auto", cmap="viridis")
    figure.colorbar(image, ax=axes, label="load / mean")
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.yaxis.set_major_locator(MaxNLocator(integer=True))
    axes.set_xlabel("expert")
    axes.set_ylabel("layer")
    axes.set_title(f"expert load, the log window ending at step {step}")
    figure.tight_layout()
    tmp = output_dir / "expert_load.tmp.png"
    figure.savefig(tmp, format="png")
    os.replace(tmp, output_dir / "expert_load.png")
    return imbalance
