"""PPO's critic (`rl.advantage: gae` with `rl.critic`), composed by `RLTrainer` as one part (`Critic`), and GAE, a
stage of the rollout pipeline (`veomni_lite.rl.pipeline`).

The critic is a value head `nn.Linear(hidden, 1)` (zero-initialised) on a decoder's last hidden state at every
position, on one of two trunks:
- `rl.critic.value_head: true`: the policy's own trunk (one forward serves both);
- `rl.critic.pretrained_dir: DIR`: a separate value model, the decoder of DIR's causal LM (its LM head dropped; verl's
  and OpenRLHF's critic, initialised from a model directory), run on the same inputs inside the policy's forward. It is
  a submodule and companion of the policy (`critic_model`), so FSDP2 shards its layers one by one like the policy's (its
  own shards), it gets the run's attention and Ulysses SP, is filled shard by shard from DIR, checkpointed and resumed
  with the policy, left out of the reference and of the export. Its tokenizer must be the policy's (same vocabulary);
  text models only.
Either way the critic is part of the policy module (`value_head`, `critic_model`), the checkpoint holds it and the
export (the transformers model alone) leaves it out. It trains with the policy in the same optimizer step as its own
loss head `value` (`value_labels`: the response tokens, as `policy_labels`), with its own loss mode
(`loss.modes.value`, else `loss.mode`) and token count: `mean_global_loss` makes both heads exact over GA x DP x SP x
packing with the step's one all-reduce. Its parameters are their own AdamW groups, at `rl.critic.lr` and
`rl.critic.weight_decay`. Under `model.lora` the critic trains whole (the policy through its adapters).

Per rollout batch, on the host, alike on every rank (every rank holds every sample after the passes' gather):
- old values V_t: a no-grad forward on the micro-batches of the old / reference log-probabilities
  (`veomni_lite.rl.logprob_pass`), at the positions that predict each response token (the shifted frame: the state
  before token t);
- token rewards: the sequence reward at the last response token, 0 elsewhere (no KL in the reward: the KL stays a loss
  term, `rl.kl_coef`, as verl's use_kl_loss);
- GAE over each response (`gae`): delta_t = r_t + gamma V_{t+1} - V_t with V after the last token 0 (a truncated
  response is not bootstrapped, as verl), A_t = delta_t + gamma lam A_{t+1}; returns R_t = A_t + V_t;
- the advantages whitened over the batch's trained response tokens, (A - mean) / sqrt(var + 1e-8), var with Bessel's
  correction (verl's masked_whiten); the returns are not.
The value loss per token (`ValueLoss`, verl's clipped value loss): with old values o_t and c = `rl.critic.value_clip`,
  l_t = 0.5 max((v_t - R_t)^2, (o_t + clip(v_t - o_t, -c, c) - R_t)^2)       (c = 0: 0.5 (v_t - R_t)^2)
Critic warm-up (`rl.critic.warmup_steps`, verl's critic_warmup): the first N optimizer steps train the value head only:
the policy loss is multiplied by 0 and every other parameter group steps with lr 0.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from veomni_lite.config import ConfigError, build_section
from veomni_lite.loss_keys import IGNORE_INDEX, loss_weights_key
from veomni_lite.metrics.accumulator import MetricSpec
from veomni_lite.models.hf_attention import route_attention
from veomni_lite.rl.advantages import ADVANTAGES, WHITEN_EPS, gae

VALUE = "value"  # the head's name: `value_labels`, `value_loss`
VALUE_LABELS = f"{VALUE}_labels"
OLD_VALUES = f"{VALUE}_old_values"
RETURNS = f"{VALUE}_returns"
CRITIC_VALUES = (OLD_VALUES, RETURNS)  # float per-token keys of a sample, in the shifted frame like the advantages

__all__ = [
    "CRITIC_VALUES",
    "OLD_VALUES",
    "RETURNS",
    "VALUE",
    "VALUE_LABELS",
    "Critic",
    "CriticSettings",
    "ValueLoss",
    "gae",
    "gae_advantages",
    "whiten",
]


@dataclass(frozen=True)
class CriticSettings:
    """`rl.critic`: `value_head: true` (a value head on the policy's trunk) or `pretrained_dir` (a separate value
    model: a causal LM directory), `lr` and `weight_decay` (the critic's AdamW; absent: `optim.lr`,
    `optim.weight_decay`), `warmup_steps` (verl's critic_warmup, 0) and `value_clip` (verl's cliprange_value 0.5;
    0: unclipped)."""

    value_head: bool = False
    pretrained_dir: str = ""
    lr: float | None = None
    weight_decay: float | None = None
    warmup_steps: int = 0
    value_clip: float = 0.5

    @classmethod
    def parse(cls, raw: CriticSettings | Mapping[str, Any] | None) -> CriticSettings:
        """`rl.critic` as the config loader read it (or a mapping, read here the same way: `build_section`), checked
        (ConfigError naming a bad key)."""
        settings = raw if isinstance(raw, cls) else build_section(cls, raw, "rl.critic")
        if settings.value_head == bool(settings.pretrained_dir):
            raise ConfigError(
                "rl.critic: set value_head: true (a linear value head on the policy's trunk) or pretrained_dir "
                "(a separate value model), exactly one"
            )
        if settings.pretrained_dir and not (Path(settings.pretrained_dir) / "config.json").is_file():
            raise ConfigError(f"rl.critic.pretrained_dir: {settings.pretrained_dir} holds no config.json")
        if settings.lr is not None and not settings.lr > 0:
            raise ConfigError(f"rl.critic.lr: must be > 0, got {settings.lr}")
        if settings.weight_decay is not None and settings.weight_decay < 0:
            raise ConfigError(f"rl.critic.weight_decay: must be >= 0, got {settings.weight_decay}")
        if settings.warmup_steps < 0 or settings.value_clip < 0:
            raise ConfigError("rl.critic.warmup_steps and rl.critic.value_clip: must be >= 0")
        return settings


def whiten(values: torch.Tensor, of: torch.Tensor | None = None, eps: float = WHITEN_EPS) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) with the mean and var (Bessel's correction) of `of` (default `values`): verl's
    masked_whiten; with fewer than 2 values in `of`, centred only."""
    values = values.double()
    of = values if of is None else of.double()
    if of.numel() < 2:
        return values - of.mean() if of.numel() else values
    return (values - of.mean()) * torch.rsqrt(of.var(correction=1) + eps)


@dataclass(frozen=True)
class ValueLoss:
    """The value head's loss (see the module docstring) as the loss contract wants it."""

    value_clip: float = 0.5

    def __call__(self, values: torch.Tensor, batch: Mapping[str, Any]) -> dict[str, Any]:
        """{"value_loss": this shard's mean over its valid `value_labels` tokens of l_t (times `value_loss_weights`
        where the batch has them; an exact 0 without tokens), "metrics": {"critic/value_loss": (total, count)}} from
        the model's values [B, S] at the batch's positions (shifted frame). No collective."""
        device = values.device
        valid = batch[VALUE_LABELS].to(device) != IGNORE_INDEX
        mask = valid.to(torch.float64)
        v = torch.where(valid, values.double(), 0.0)
        returns = torch.where(valid, batch[RETURNS].to(device, torch.float64), 0.0)
        loss = (v - returns) ** 2
        if self.value_clip:
            old = torch.where(valid, batch[OLD_VALUES].to(device, torch.float64), 0.0)
            clipped = old + (v - old).clamp(-self.value_clip, self.value_clip)
            loss = torch.maximum(loss, (clipped - returns) ** 2)
        loss = 0.5 * loss
        count = mask.sum()
        per_token = loss
        weights = batch.get(loss_weights_key(VALUE))
        if weights is not None:
            per_token = per_token * weights.to(device, torch.float64)
        out = torch.where(valid, per_token, 0.0).sum() / count.clamp(min=1)
        metrics = {"critic/value_loss": (torch.where(valid, loss.detach(), 0.0).sum(), count)}
        return {f"{VALUE}_loss": out.to(torch.promote_types(values.dtype, torch.float32)), "metrics": metrics}


class ValueHead(nn.Module):
    """`nn.Linear(hidden, 1)`, zero-initialised (every value starts at 0, so the first advantages are the plain
    returns), applied to the trunk's last hidden states."""

    def __init__(self, hidden_size: int, dtype: torch.dtype, device: torch.device | None = None) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, 1, dtype=dtype, device=device)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.linear(hidden).squeeze(-1)


def attach_value_head(model: nn.Module, captured: dict[str, Any], critic_model: nn.Module | None = None) -> None:
    """Add `model.value_head` (and `model.critic_model`, a separate value model, when given) and a forward hook on
    the policy's trunk (`model.hf_model.model`) that writes the values [B, S] of each forward into
    `captured["values"]`: the head on the trunk's last hidden states, or on the value model's trunk run on the same
    inputs (inside the policy's forward, where FSDP2 has gathered the root). `captured["paused"]`: no values."""
    trunk = getattr(getattr(model, "hf_model", None), "model", None)
    if trunk is None:
        raise ConfigError(f"rl.critic: {type(model).__name__} has no decoder trunk (hf_model.model)")
    config = (critic_model if critic_model is not None else model).config
    hidden = getattr(config, "text_config", config).hidden_size
    first = next(model.parameters())
    if critic_model is not None:
        model.critic_model = critic_model
        model.companions = (critic_model,)  # its own attention, SP and FSDP2 units (`with_companions`)
    model.value_head = ValueHead(hidden, first.dtype, first.device)  # on meta where the model is

    def capture(_module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if captured.get("paused"):
            return
        if critic_model is not None:
            route_attention(critic_model.config)  # the policy's attention keywords mean the same to both decoders
            output = model.critic_model.hf_model.model(*args, **kwargs)
        captured["values"] = model.value_head(output.last_hidden_state)

    trunk.register_forward_hook(capture, with_kwargs=True)


def value_model(directory: str, policy: nn.Module) -> nn.Module:
    """The separate value model of `directory` in the policy's dtype, built as the policy is (whole, or on the meta
    device where the policy is, to be filled shard by shard: `Critic.materialize`), its LM head dropped. A
    ConfigError where it cannot serve as the policy's critic (a VL policy, another vocabulary, no decoder trunk)."""
    from veomni_lite.models.pretrained import load_config, load_model
    from veomni_lite.models.sharded_load import build_on_meta

    policy_config = policy.config
    if hasattr(policy_config, "vision_config"):
        raise ConfigError("rl.critic.pretrained_dir: a separate value model is for text policies; use value_head: true")
    vocab = load_config(directory).vocab_size
    if vocab != policy_config.vocab_size:
        raise ConfigError(
            f"rl.critic.pretrained_dir: {directory} has vocab_size {vocab}, the policy {policy_config.vocab_size}: "
            "the critic reads the policy's token ids, so it needs the policy's tokenizer"
        )
    first = next(policy.parameters())
    model = build_on_meta(directory, first.dtype) if first.is_meta else load_model(directory, first.dtype)
    if getattr(getattr(model, "hf_model", None), "model", None) is None:
        raise ConfigError(f"rl.critic.pretrained_dir: {type(model).__name__} of {directory} has no decoder trunk")
    model.hf_model.lm_head = nn.Identity()  # unused: the value head reads the trunk
    model.requires_grad_(True)
    return model


def _policy_params(optimizer: torch.optim.Optimizer) -> list[nn.Parameter]:
    return [param for group in optimizer.param_groups if not group.get("critic") for param in group["params"]]


def _initial_state(optimizer: torch.optim.Optimizer, params: Sequence[nn.Parameter]) -> None:
    """`optimizer`'s state for `params` as before their first update (step 0, zero moments: what AdamW would make at
    it), made now: a zero-gradient step at lr 0 (as DCP's `_init_optim_state` makes a fresh optimizer's) with the step
    counters then reset. So a checkpoint taken before the policy first updates (in a critic warm-up) holds every
    parameter's state, as DCP's load requires."""
    rates = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    for param in params:
        param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for group, rate in zip(optimizer.param_groups, rates):
        group["lr"] = rate
    for param in params:
        optimizer.state[param]["step"].zero_()


class Critic:
    """The critic part of an `RLTrainer`; `Critic.of(rl)` is None without `rl.advantage: gae`."""

    def __init__(self, settings: CriticSettings) -> None:
        self.settings = settings
        self.loss = ValueLoss(settings.value_clip)
        self.captured: dict[str, torch.Tensor] = {}
        self._warm_step = False  # the step whose loss was computed last is a warm-up step

    @classmethod
    def of(cls, rl: Any) -> Critic | None:
        """The critic of the `rl` section, None unless its advantage estimator needs one (`gae`)."""
        needs_critic = ADVANTAGES.get(rl.advantage, "rl.advantage").needs_critic
        return cls(CriticSettings.parse(rl.critic)) if needs_critic else None

    def attach(self, model: nn.Module) -> nn.Module:
        """The policy with its critic (called on the built model, before `model.lora` and FSDP2)."""
        directory = self.settings.pretrained_dir
        attach_value_head(model, self.captured, value_model(directory, model) if directory else None)
        return model

    def parameters(self, model: nn.Module) -> list[nn.Parameter]:
        """The critic's parameters in `model` (the value head's, and the value model's)."""
        parts = [model.value_head] + ([model.critic_model] if self.settings.pretrained_dir else [])
        return [param for part in parts for param in part.parameters()]

    def train_whole(self, model: nn.Module) -> None:
        """Under `model.lora`, which froze the whole wrapper: the critic trains whole."""
        for param in self.parameters(model):
            param.requires_grad_(True)

    @torch.no_grad()
    def materialize(self, model: nn.Module, fill: Any) -> None:
        """A sharded build filled from the directories: `fill(model)` (the trainer's `materialize`) without the
        critic, which the policy's directory does not hold, then the value model's shards from its own directory and
        the head's zeroed (its initial values). Collective."""
        from veomni_lite.models.sharded_load import load_into_shards, loadable

        parts = {name: model._modules.pop(name) for name in ("value_head", "critic_model") if name in model._modules}
        try:
            fill(model)
        finally:
            model._modules.update(parts)
        if "critic_model" in parts:
            if not loadable(parts["critic_model"], self.settings.pretrained_dir):
                raise ConfigError(
                    f"rl.critic.pretrained_dir: {self.settings.pretrained_dir} is not read shard by shard; set "
                    "model.load_sharded: false"
                )
            load_into_shards(parts["critic_model"], self.settings.pretrained_dir)
        for param in parts["value_head"].parameters():
            param.zero_()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Forwards inside the block compute no values (the reference's log-probabilities)."""
        self.captured["paused"] = True
        try:
            yield
        finally:
            self.captured.pop("paused")

    def take(self) -> torch.Tensor:
        """The values of the model's last forward."""
        return self.captured.pop("values")

    def warming_up(self, step: int) -> bool:
        """The step about to train (after `step` trained ones) is a warm-up step (the policy does not update)."""
        return step < self.settings.warmup_steps

    def optimizer(self, model: nn.Module, optim: Any) -> torch.optim.Optimizer:
        """The trainer's AdamW (`build_optimizer`) with the critic's parameters in their own groups (`critic`: True)
        at `rl.critic.lr` (else `optim.lr`), decayed at `rl.critic.weight_decay` (else `optim.weight_decay`) on the
        parameters the policy's are (`optim.weight_decay_on`)."""
        from veomni_lite.trainer.base import build_optimizer, parameter_groups

        decay = optim.weight_decay if self.settings.weight_decay is None else self.settings.weight_decay
        mine = {id(p) for p in self.parameters(model)}
        out = []
        decayed, kept = parameter_groups(model, optim.weight_decay, optim.weight_decay_on)
        for group, critic_decay in ((decayed, decay), (kept, 0.0)):
            out.append({**group, "params": [p for p in group["params"] if id(p) not in mine]})
            critic = [p for p in group["params"] if id(p) in mine]
            if critic:
                lr = self.settings.lr or optim.lr
                out.append({**group, "params": critic, "lr": lr, "weight_decay": critic_decay, "critic": True})
        optimizer = build_optimizer(model, optim, out)
        if self.settings.warmup_steps:
            _initial_state(optimizer, [param for group in optimizer.param_groups for param in group["params"]])
            optimizer.register_step_pre_hook(self._policy_waits)
        return optimizer

    def _policy_waits(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        """Before a warm-up step's update: the policy's gradients dropped, so AdamW leaves the policy's parameters and
        state alone (no step counted, no moments from zero or value-loss gradients) and its first update after the
        warm-up is a fresh Adam step, as verl's actor, which does not step during critic_warmup."""
        if self._warm_step:
            for param in _policy_params(optimizer):
                param.grad = None

    def scheduler(self, optimizer: torch.optim.Optimizer, optim: Any, max_steps: int) -> Any:
        """`optim.schedule` for every group, the policy's delayed by the warm-up: its groups train at lr 0 for
        `rl.critic.warmup_steps` steps, then run the schedule of the remaining steps (verl's actor does not step
        during critic_warmup); the critic's run the whole schedule."""
        from veomni_lite.trainer.base import build_scheduler

        warmup = self.settings.warmup_steps
        if warmup >= max_steps:
            raise ConfigError(
                f"rl.critic.warmup_steps ({warmup}) must be fewer than the run's {max_steps} optimizer steps: the "
                "policy does not train during the critic's warm-up"
            )
        delays = [0 if group.get("critic") else warmup for group in optimizer.param_groups]
        return build_scheduler(optimizer, optim, max_steps, delays)

    def add_value_loss(
        self, outputs: dict[str, Any], batch: Mapping[str, Any], policy_key: str, step: int
    ) -> dict[str, Any]:
        """The policy's `outputs` with the value loss and its metrics added (`policy_key`'s loss times 0 in
        warm-up; `step`: the optimizer steps trained before this one)."""
        value = self.loss(self.take(), batch)
        self._warm_step = self.warming_up(step)  # read by `_policy_waits` at this step's update
        if self._warm_step:
            outputs[policy_key] = outputs[policy_key] * 0.0
        outputs[f"{VALUE}_loss"] = value[f"{VALUE}_loss"]
        outputs["metrics"] = {**outputs.get("metrics", {}), **value["metrics"]}
        return outputs

    @torch.no_grad()
    def old_values(self, micro_batch: Mapping[str, Any], forward: Callable[[Mapping[str, Any]], Any]) -> torch.Tensor:
        """[B, S] values of a prepared micro-batch (float64, host): the last forward's (the old log-probabilities'
        pass, under the current weights), else `forward(micro_batch)`'s (the policy's log-probability forward)."""
        if "values" not in self.captured:
            forward(micro_batch)
        return self.take().double().cpu()

    def specs(self) -> list[MetricSpec]:
        """The critic's metric specs."""
        return [
            MetricSpec("critic/value_loss", "mean"),
            MetricSpec("critic/values/mean", "mean"),
            MetricSpec("critic/values/min", "min"),
            MetricSpec("critic/values/max", "max"),
            MetricSpec("critic/returns/mean", "mean"),
            MetricSpec("critic/explained_variance", "mean"),
        ]


def gae_advantages(samples: Sequence[Any], rl: Any) -> dict[str, Any]:
    """The pipeline's GAE stage: each sample's token advantages and returns from its `old_values` (`apply_gae`); returns
    the batch's `rl/advantage/*` and critic metrics (the same values on every rank)."""
    metrics = apply_gae(samples, rl.gamma, rl.lam, rl.mask_truncated)
    pending: dict[str, Any] = {}
    kept = [s for s in samples if not (rl.mask_truncated and s.truncated)]
    if kept:  # `rl/advantage/*` of the trained tokens (whole batch, alike on every rank: the mean stays exact)
        advantages = torch.cat([torch.tensor(s.token_advantages, dtype=torch.float64)[model_tokens(s)] for s in kept])
        count = float(advantages.numel())
        pending["rl/advantage/mean"] = (advantages.sum(), count)
        pending["rl/advantage/_sq"] = ((advantages * advantages).sum(), count)
        pending["rl/advantage/min"], pending["rl/advantage/max"] = advantages.min(), advantages.max()
    for name, value in metrics.items():
        extreme = name.endswith(("/min", "/max"))
        pending[name] = torch.tensor(value, dtype=torch.float64) if extreme else (value, 1.0)
    return pending


def model_tokens(sample: Any) -> torch.Tensor:
    """The indices of a sample's response tokens that the model sampled (an episode's `response_mask`; else all)."""
    mask = sample.response_mask
    if mask is None:
        return torch.arange(len(sample.response_ids))
    return torch.tensor(mask, dtype=torch.bool).nonzero().flatten()


def apply_gae(samples: Sequence[Any], gamma: float, lam: float, mask_truncated: bool) -> dict[str, Any]:
    """See `gae_advantages`: samples with `reward`, `response_ids`, `old_values`, `truncated` (and an episode's
    `response_mask`); sets `token_advantages` and `returns`. An episode's GAE runs over its model tokens alone, the
    environment's skipped (they are no actions: verl's multi-turn GAE), its reward at its last model token; the
    environment's tokens get advantage and return 0 (they are in no loss). A sample left out of the loss
    (`mask_truncated` and truncated) gets its GAE but is not in the whitening statistics nor the metrics."""
    raw, values, returns, kept = [], [], [], []
    for sample in samples:
        at = model_tokens(sample)
        old = torch.tensor(sample.old_values, dtype=torch.float64)[at]
        rewards = torch.zeros_like(old)
        if rewards.numel():
            rewards[-1] = sample.reward
        advantages, sample_returns = gae(rewards, old, gamma, lam)
        full = torch.zeros(len(sample.response_ids), dtype=torch.float64)
        sample.returns = full.index_put((at,), sample_returns).tolist()
        raw.append(advantages)
        values.append(old)
        returns.append(sample_returns)
        kept.append(not (mask_truncated and sample.truncated))
    trained = [a for a, keep in zip(raw, kept) if keep]
    flat = torch.cat(trained) if trained else torch.zeros(0, dtype=torch.float64)
    for sample, advantages in zip(samples, raw):
        full = torch.zeros(len(sample.response_ids), dtype=torch.float64)
        sample.token_advantages = full.index_put((model_tokens(sample),), whiten(advantages, flat)).tolist()
    return critic_metrics([v for v, keep in zip(values, kept) if keep], [r for r, keep in zip(returns, kept) if keep])


def critic_metrics(values: Sequence[torch.Tensor], returns: Sequence[torch.Tensor]) -> dict[str, Any]:
    """The batch's critic metrics over its trained response tokens: values' mean, min, max and the explained variance
    1 - Var(R - V) / Var(R) (population variances from the batch's exact sums; absent when Var(R) is 0)."""
    v = torch.cat(list(values)) if values else torch.zeros(0, dtype=torch.float64)
    r = torch.cat(list(returns)) if returns else torch.zeros(0, dtype=torch.float64)
    if not v.numel():
        return {}
    n = float(v.numel())
    residual = r - v
    var_r = (r * r).sum() / n - (r.sum() / n) ** 2
    var_e = (residual * residual).sum() / n - (residual.sum() / n) ** 2
    out = {
        "critic/values/mean": float(v.mean()),
        "critic/values/min": float(v.min()),
        "critic/values/max": float(v.max()),
        "critic/returns/mean": float(r.mean()),
    }
    if float(var_r) > 0:
        out["critic/explained_variance"] = 1.0 - float(var_e) / float(var_r)
    return out
