"""The `rl` config section of `trainers/train_rl.py` (read with `load_config(..., sections={"rl": RLConfig})`).

Each field names the peers' default it follows. The policy head is `policy`: its mode is `loss.modes.policy` or
`loss.mode` (token-mean, DAPO's and verl's default; seq-mean-token-mean the original GRPO; seq-mean-token-sum-norm with
`loss.scale_factor` = `max_new_tokens` Dr. GRPO).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from veomni_lite.config import ConfigError, build_section
from veomni_lite.engines.vllm.settings import VLLMSettings
from veomni_lite.registries import Registry
from veomni_lite.rl.advantages import ADVANTAGES
from veomni_lite.rl.critic import CriticSettings
from veomni_lite.rl.policy_loss import IS_CORRECTIONS, POLICY, POLICY_LOSSES
from veomni_lite.rl.teacher import TeacherSettings

__all__ = ["POLICY", "DynamicSampling", "OverlongBuffer", "RLConfig"]


@dataclass
class RLConfig:
    """Online RL: rollouts, rewards, advantages and the policy loss (see `veomni_lite.rl`)."""

    engine: Literal["transformers", "vllm"] = "transformers"
    """What samples the rollouts: transformers' `generate` on each rank's copy of the current weights (embedded), or a
    vLLM server (`rl.vllm`)."""
    routing_replay: Literal["none", "old", "rollout"] = "none"
    """Mixture-of-experts policies: the experts the training forward routes each token to. `none`: its own top-k;
    `old`: the ones the old log-probabilities' pass chose (off policy; on policy that pass is the training forward
    itself, so nothing changes); `rollout`: the ones the embedded engine chose while generating (R3), replayed by
    the old and reference passes too. The router's weights are recomputed from the training forward's logits at
    the replayed experts, so the router still trains (`veomni_lite.models.routing`). Default none: replay needs an
    MoE policy (a dense one is a ConfigError) and keeps [tokens, layers, top_k] experts per sample (docs/rl.md)."""
    prompts_per_step: int = 8
    """Prompts per rollout batch (each sampled `num_generations` times); the batch is `rl.epochs` passes of optimizer
    steps of `train.global_batch_size` responses."""
    num_generations: int = 8
    """Responses per prompt, the group its advantages are relative to (TRL's default 8)."""
    max_new_tokens: int = 256
    """Longest response; a response cut here is `truncated` (TRL's max_completion_length 256)."""
    temperature: float = 1.0
    """Sampling temperature; the trainer's log-probabilities are those of logits / temperature (verl, TRL: 1.0)."""
    top_p: float = 1.0
    """Nucleus sampling (1: off)."""
    top_k: int = 0
    """Top-k sampling (0: off)."""
    rewards: list[dict[str, Any]] = field(default_factory=list)
    """`[{name, function, weight}]`, summed with their weights: `exact_match`, `math`, `regex` (with `pattern`), or a
    user's `path/to/file.py:function` (see `veomni_lite.rl.rewards`)."""
    advantage: str = "grpo"
    """A registered advantage estimator (`veomni_lite.rl.advantages`, `register_advantage`). Per group: grpo (R -
    mean) / (std + eps), dr_grpo R - mean, rloo R - mean of the others; reinforce_pp (REINFORCE++, verl's
    `adv_estimator: reinforce_plus_plus`) R whitened over the whole rollout batch's response tokens (the KL stays in
    the loss, `rl.kl_coef`, as verl's use_kl_loss); gae: PPO with a critic (`rl.critic`, `rl.gamma`, `rl.lam`; see
    `veomni_lite.rl.critic`)."""
    critic: CriticSettings | None = None
    """`rl.advantage: gae`: `{value_head: true | pretrained_dir: DIR, lr, weight_decay, warmup_steps, value_clip}`
    (`veomni_lite.rl.critic.CriticSettings`; verl's critic model path, lr, critic_warmup 0, cliprange_value 0.5)."""
    gamma: float = 1.0
    """GAE's discount (verl's 1.0; OpenRLHF's 1.0)."""
    lam: float = 1.0
    """GAE's lambda (verl's 1.0; OpenRLHF uses 0.95)."""
    advantage_eps: float = 1e-6
    """eps of grpo's std (verl's 1e-6; TRL adds 1e-4)."""
    policy_loss: str = "ppo_clip"
    """A registered policy loss (`veomni_lite.rl.policy_loss`, `register_policy_loss`). ppo_clip: PPO's clipped token
    ratio; gspo: the sequence ratio exp(mean of the sequence's log-ratios)."""
    clip_low: float = 0.2
    """Lower clip range: the ratio is clipped at 1 - clip_low (PPO's 0.2; GSPO uses about 3e-4)."""
    clip_high: float = 0.2
    """Upper clip range, 1 + clip_high (0.2; DAPO's clip-higher 0.28; GSPO about 4e-4)."""
    dual_clip: float = 0.0
    """Dual-clip constant c > 1 bounding the loss of negative advantages at -A c (0: off; verl's clip_ratio_c 3)."""
    kl_coef: float = 0.0
    """Weight of the KL penalty against the frozen reference (0: no reference model; TRL's beta default 0.0, verl's
    kl_loss_coef 0.001 when use_kl_loss)."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """k1 logp - ref, k2 (logp - ref)^2 / 2, k3 exp(ref - logp) - (ref - logp) - 1 (TRL's and verl's low_var_kl)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (verl's entropy_coeff 0)."""
    importance_sampling: str = "none"
    """A registered correction of the rollout engine's (behaviour) log-probabilities against the trainer's old ones
    (`veomni_lite.rl.policy_loss`, `register_is_correction`), weighting each token's policy loss: token / sequence
    truncated IS min(exp(old - engine), is_cap) of the token (of the whole sequence's sum; verl's TIS); token_mask /
    sequence_mask the weight exp(old - engine) kept inside [is_low, is_cap] and 0 outside (the token / the whole
    sequence dropped; verl's masked IS); icepop token_mask's weight (IcePop); none: no weight."""
    is_cap: float = 2.0
    """The upper bound of `importance_sampling`: the truncation of token / sequence, the mask's upper edge (verl's
    rollout_is_threshold 2.0; IcePop's beta 5)."""
    is_low: float = 0.5
    """The mask's lower edge of token_mask / sequence_mask / icepop (verl's default 1 / 2.0; IcePop's alpha 0.5)."""
    decoupled: bool = False
    """AReaL's decoupled PPO: the ratio clipped around the old pass's (proximal) policy, every token weighted by the
    behaviour policy's importance weight exp(old - engine), bounded by `importance_sampling` (none: unbounded,
    AReaL's default; token_mask with is_low 0 and is_cap C: AReaL's behav_imp_weight_cap C). The other corrections
    apply their weight so already."""
    epochs: int = 1
    """Passes over each rollout batch (TRL's num_iterations, verl's ppo_epochs: 1)."""
    mask_truncated: bool = False
    """Responses cut at `max_new_tokens` leave the loss (numerator and denominator), still counted in the reward
    metrics (TRL's mask_truncated_completions, DAPO's overlong filtering)."""
    rollouts_path: str = ""
    """A JSONL of rollouts made elsewhere, trained on instead of generating (see `veomni_lite.rl.rollouts`)."""
    rollouts_sample: int = 4
    """Rollouts written to rollouts.jsonl and TensorBoard's text tab at each log (0: none)."""
    vllm: VLLMSettings | None = None
    """`rl.engine: vllm`: the servers, exactly one of `url` (one running server), `urls` (several, a rollout batch's
    samples spread over them, every one synced) and `launch` (true, or how many servers rank 0 starts on 127.0.0.1);
    `api_key_env` (the name of an environment variable holding the key sent with every request), `python`,
    `sync_dir`, `start_timeout_s`, `request_timeout_s`, `probe_tolerance` (the first sync's bound; later syncs are
    checked against the previous weights), `server_args`, `max_concurrency` (per server)
    (`veomni_lite.engines.vllm.VLLMSettings`, docs/vllm.md)."""
    dynamic_sampling: DynamicSampling | None = None
    """DAPO's dynamic sampling (verl's `algorithm.filter_groups`; off when empty): `{metric, max_generation_rounds}`.
    Groups whose `metric` (`reward`, the total, as verl's default `acc`/score; or a reward's name, `rl/rewards/<name>`)
    is equal across the group are dropped and further rounds of prompts (the next of the prompt order) generated until
    `rl.prompts_per_step` groups learn; more than `max_generation_rounds` rounds (DAPO's recipe: 10; verl's
    max_num_gen_batches, whose 0 = no limit is not offered) is a `DynamicSamplingError` (`DynamicSampling`)."""
    overlong_buffer: OverlongBuffer | None = None
    """DAPO's soft overlong punishment (verl's `reward_model.overlong_buffer`; off when empty): `{length, penalty}`:
    responses longer than `max_new_tokens - length` tokens get a reward falling linearly to -`penalty` at
    `max_new_tokens` (DAPO: length 4096 of 20480, penalty 1.0), logged as `rl/rewards/overlong`."""
    # --- multi-turn episodes (`veomni_lite.rl.episodes`, docs/agents.md) ---
    tools: list[str] = field(default_factory=list)
    """`[path/to/file.py:function, ...]`: functions the model may call (`<tool_call>` or Llama-3 JSON), their schemas
    given to the chat template (`veomni_lite.rl.tools`; TRL's GRPOTrainer `tools`)."""
    environment: str = ""
    """`path/to/file.py:Class`: one instance per episode, `reset(row)`, `step(text) -> (observation, reward, done)`
    (`veomni_lite.rl.environments`; verl's interaction); or a hub's: `verifiers:NAME` (or `verifiers:path/env.py`),
    `openenv:URL` or `openenv:path/env.py:Class` (`veomni_lite.rl.hubs`, docs/agents.md)."""
    environment_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the environment's class; verifiers: its `[env]` block; OpenEnv: `action_field`,
    `observation_field`, `kwargs`, `timeout_s`."""
    max_turns: int = 4
    """Most model turns of an episode (verl's multi_turn max_assistant_turns; TRL's max_tool_calling_iterations)."""
    max_episode_tokens: int = 0
    """Longest episode, prompt included (0: data.max_seq_len); reaching it ends the episode, truncated."""
    tool_timeout_s: float = 10.0
    """Per tool call: a call running longer is stopped and its result is an error the model reads."""
    max_tool_error_rate: float = 0.5
    """A tool failing on its own (raising, timing out) in more than this fraction of its calls of a rollout batch (all
    ranks; once it ran `veomni_lite.rl.tools.MIN_TOOL_CALLS` = 16 times there) fails the run, naming the tool and its
    first error; in [0, 1], 1: never. The model's malformed calls do not count."""
    teacher: TeacherSettings | None = None
    """On-policy distillation (off when empty): `{pretrained_dir: DIR | url: BASE, coef: 1.0, ...}`: a teacher's
    log-probabilities of the sampled tokens, the per-token reverse KL -coef (old_t - teacher_t) added to the rewards'
    advantage (alone without `rl.rewards`); the teacher's tokenizer must be the student's
    (`veomni_lite.rl.teacher.TeacherSettings`, docs/rl.md)."""
    async_steps: int = 0
    """The staleness bound k in rollout batches (`veomni_lite.rl.rollout_queue`): 0 synchronous; k: batch b is sampled
    by the weights of batch b - k while the batches before it train; an older sample is dropped and generated again
    (`rl/staleness/{mean,max,dropped}`); `rl.importance_sampling` or `rl.decoupled` corrects by the engine's
    log-probabilities (prime-rl's max_async_level, AReaL's max_head_offpolicyness, verl's staleness_threshold)."""
    partial_rollouts: bool = False
    """k >= 2: responses generate in k chunks, each by the weights of the batch it starts at, so a generation
    continues across weight updates, each token with its own version and log-probability (verl's partial_rollout)."""

    @property
    def filter_groups(self) -> DynamicSampling | None:
        """`rl.dynamic_sampling` parsed (None: off); a bad entry is a ConfigError naming the key."""
        return DynamicSampling.parse(self.dynamic_sampling) if self.dynamic_sampling else None

    @property
    def overlong(self) -> OverlongBuffer | None:
        """`rl.overlong_buffer` parsed (None: off); a bad entry is a ConfigError naming the key."""
        return OverlongBuffer.parse(self.overlong_buffer, self.max_new_tokens) if self.overlong_buffer else None

    @property
    def multi_turn(self) -> bool:
        """Whether rollouts are episodes (tools or an environment)."""
        return bool(self.tools or self.environment)

    @property
    def rollout_size(self) -> int:
        """Responses per rollout batch."""
        return self.prompts_per_step * self.num_generations

    def validate(self, config: Any) -> None:
        """Cross-field checks against the rest of `config` (ConfigError naming the key)."""
        positive = {
            "rl.prompts_per_step": self.prompts_per_step,
            "rl.num_generations": self.num_generations,
            "rl.max_new_tokens": self.max_new_tokens,
            "rl.epochs": self.epochs,
        }
        for key, value in positive.items():
            if value < 1:
                raise ConfigError(f"{key}: must be >= 1, got {value}")
        if not self.temperature > 0:
            raise ConfigError(f"rl.temperature: must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"rl.top_p: must be in (0, 1], got {self.top_p}")
        for key, value in {
            "rl.clip_low": self.clip_low,
            "rl.clip_high": self.clip_high,
            "rl.top_k": self.top_k,
        }.items():
            if value < 0:
                raise ConfigError(f"{key}: must be >= 0, got {value}")
        if self.dual_clip and self.dual_clip <= 1:
            raise ConfigError(f"rl.dual_clip: must be > 1 (or 0: off), got {self.dual_clip}")
        correction = IS_CORRECTIONS.get(self.importance_sampling, "rl.importance_sampling")
        if "is_cap" in correction.hyperparameters and not self.is_cap > 0:
            raise ConfigError(f"rl.is_cap: must be > 0, got {self.is_cap}")
        if "is_low" in correction.hyperparameters and not 0 <= self.is_low < self.is_cap:
            raise ConfigError(f"rl.is_low: must be in [0, rl.is_cap = {self.is_cap}), got {self.is_low}")
        estimator = ADVANTAGES.get(self.advantage, "rl.advantage")
        POLICY_LOSSES.get(self.policy_loss, "rl.policy_loss")
        if estimator.needs_critic or self.critic:
            if not estimator.needs_critic:
                raise ConfigError(f"rl.critic: set, but rl.advantage is {self.advantage!r}; the critic is for "
                                  f"{_flagged(ADVANTAGES, 'needs_critic')}")  # fmt: skip
            CriticSettings.parse(self.critic)
            if not (0 <= self.gamma <= 1 and 0 <= self.lam <= 1):
                raise ConfigError(f"rl.gamma and rl.lam: must be in [0, 1], got {self.gamma}, {self.lam}")
        if self.num_generations < estimator.extra.get("min_group_size", 1):
            raise ConfigError(f"rl.num_generations: {self.advantage} compares a group's responses, needs >= "
                              f"{estimator.extra['min_group_size']}")  # fmt: skip
        if self.engine == "vllm" and not self.rollouts_path:
            try:
                VLLMSettings.parse(self.vllm)
            except (TypeError, ValueError) as exc:
                raise ConfigError(str(exc)) from None
        elif self.vllm and self.engine != "vllm":
            raise ConfigError(f"rl.vllm: set, but rl.engine is {self.engine!r}; set rl.engine: vllm or drop rl.vllm")
        if self.routing_replay == "rollout" and (self.engine == "vllm" or self.rollouts_path):
            raise ConfigError(
                "rl.routing_replay: rollout replays the experts the engine routed each token to; "
                + (
                    "rl.rollouts_path's rollouts carry none"
                    if self.rollouts_path
                    else "the vLLM engine does not return the experts its server routed to"
                )
                + ": use rl.routing_replay old, or rl.engine transformers"
            )
        if self.routing_replay == "rollout" and self.multi_turn:
            raise ConfigError(
                "rl.routing_replay: rollout records the experts of one generate call per response; an episode's "
                "turns are several, with environment tokens between them: use rl.routing_replay old"
            )
        check_staleness(self)
        if self.environment_kwargs and not self.environment:
            raise ConfigError("rl.environment_kwargs: set, but rl.environment is not; name the class it is for")
        if self.multi_turn:
            self.validate_multi_turn(config)
        filter_groups, overlong = self.filter_groups, self.overlong  # each parsed: a ConfigError names its key
        if (filter_groups or overlong) and self.rollouts_path:
            raise ConfigError(
                "rl.dynamic_sampling / rl.overlong_buffer: act on generated rollouts; drop them or rl.rollouts_path"
            )
        if filter_groups and config.train.epochs:
            raise ConfigError(
                "rl.dynamic_sampling: a rollout batch takes a varying number of prompts, so train.epochs has no fixed "
                "length; set train.max_steps instead"
            )
        names = {r.get("name") for r in self.rewards if isinstance(r, dict)} | ({"overlong"} if overlong else set())
        if filter_groups and filter_groups.metric != "reward" and filter_groups.metric not in names:
            raise ConfigError(
                f"rl.dynamic_sampling.metric: {filter_groups.metric!r} is neither `reward` (the total) nor a reward's "
                f"name ({', '.join(sorted(str(n) for n in names))})"
            )
        if self.teacher:
            TeacherSettings.parse(self.teacher)
        if not self.rewards and not self.rollouts_path and not self.environment and not self.teacher:
            raise ConfigError(
                "rl.rewards: give at least one reward function ([{name, function, weight}]), or rl.teacher"
            )
        from veomni_lite.rl.rewards import load_rewards  # a user's file runs here because the config names it

        load_rewards(self.rewards)  # each entry checked (ConfigError naming it) before any process group
        batch = config.train.global_batch_size
        if self.rollout_size % batch:
            raise ConfigError(
                f"train.global_batch_size ({batch}) must divide the rollout batch (rl.prompts_per_step "
                f"{self.prompts_per_step} x rl.num_generations {self.num_generations} = {self.rollout_size})"
            )
        if batch % self.num_generations:
            raise ConfigError(
                f"train.global_batch_size ({batch}) must hold whole groups of rl.num_generations "
                f"({self.num_generations}) responses"
            )

    def validate_multi_turn(self, config: Any) -> None:
        """The multi-turn keys checked, the tools and environment loaded (ConfigError naming the key)."""
        if self.max_turns < 1:
            raise ConfigError(f"rl.max_turns: must be >= 1, got {self.max_turns}")
        if not self.tool_timeout_s > 0:
            raise ConfigError(f"rl.tool_timeout_s: must be > 0, got {self.tool_timeout_s}")
        if not 0.0 <= self.max_tool_error_rate <= 1.0:
            raise ConfigError(
                f"rl.max_tool_error_rate: must be in [0, 1] (1: never fail the run), got {self.max_tool_error_rate}"
            )
        if self.max_episode_tokens < 0 or self.max_episode_tokens > config.data.max_seq_len:
            raise ConfigError(
                f"rl.max_episode_tokens: must be in [0, data.max_seq_len = {config.data.max_seq_len}] (0: that), got "
                f"{self.max_episode_tokens}"
            )
        if self.async_steps:
            raise ConfigError("rl.async_steps: generates single-turn rollouts; episodes (rl.tools, "
                              "rl.environment) need rl.async_steps: 0")  # fmt: skip
        from veomni_lite.rl.environments import load_environment
        from veomni_lite.rl.tools import load_tools

        load_tools(self.tools)
        load_environment({"class": self.environment, "kwargs": self.environment_kwargs} if self.environment else "")


@dataclass(frozen=True)
class DynamicSampling:
    """`rl.dynamic_sampling` (see `RLConfig.dynamic_sampling`)."""

    metric: str = "reward"
    max_generation_rounds: int = 10

    @classmethod
    def parse(cls, entry: DynamicSampling | Mapping[str, Any]) -> DynamicSampling:
        """The section as the config loader read it (or a mapping, read the same way: `build_section`), checked; a bad
        key or value is a ConfigError naming it."""
        return replace(entry if isinstance(entry, cls) else build_section(cls, entry, "rl.dynamic_sampling"))

    def __post_init__(self) -> None:
        if self.max_generation_rounds < 1:
            raise ConfigError(
                f"rl.dynamic_sampling.max_generation_rounds: must be >= 1, got {self.max_generation_rounds}"
            )


@dataclass(frozen=True)
class OverlongBuffer:
    """`rl.overlong_buffer` (see `RLConfig.overlong_buffer`)."""

    length: int = 0
    """Required: the buffer's tokens before `rl.max_new_tokens`."""
    penalty: float = 1.0

    @classmethod
    def parse(cls, entry: OverlongBuffer | Mapping[str, Any], max_new_tokens: int) -> OverlongBuffer:
        """The section as the config loader read it (or a mapping, read the same way: `build_section`), `0 < length <=
        max_new_tokens`, `penalty >= 0`; else a ConfigError naming the key."""
        made = entry if isinstance(entry, cls) else build_section(cls, entry, "rl.overlong_buffer")
        if not made.length:
            raise ConfigError("rl.overlong_buffer.length: required (the buffer's tokens before rl.max_new_tokens)")
        if not 0 < made.length <= max_new_tokens:
            raise ConfigError(
                f"rl.overlong_buffer.length: must be in (0, rl.max_new_tokens={max_new_tokens}], got {made.length}"
            )
        if not made.penalty >= 0:
            raise ConfigError(f"rl.overlong_buffer.penalty: must be >= 0, got {made.penalty}")
        return made


def check_staleness(rl: RLConfig) -> None:
    """`rl.async_steps` and `rl.partial_rollouts` against each other and the rest of `rl` (ConfigError)."""
    if rl.async_steps < 0:
        raise ConfigError(f"rl.async_steps: the staleness bound in rollout batches, >= 0; got {rl.async_steps}")
    if rl.async_steps and rl.rollouts_path:
        raise ConfigError("rl.async_steps: generates rollouts while the trainer trains; rl.rollouts_path has them")
    if rl.partial_rollouts and rl.async_steps < 2:
        raise ConfigError(f"rl.partial_rollouts: needs rl.async_steps >= 2 (got {rl.async_steps}): with 1 "
                          "a batch generates within one batch's training, across no update")  # fmt: skip
    if rl.partial_rollouts and rl.max_new_tokens < rl.async_steps:
        raise ConfigError(f"rl.partial_rollouts: rl.max_new_tokens ({rl.max_new_tokens}) must be >= "
                          f"rl.async_steps ({rl.async_steps}), the chunks a response generates in")  # fmt: skip
    if rl.partial_rollouts and rl.routing_replay == "rollout":
        raise ConfigError("rl.partial_rollouts: a response of several chunks has no one routing record; use "
                          "rl.routing_replay old")  # fmt: skip
    if rl.async_steps > 1 and rl.dynamic_sampling:
        raise ConfigError(f"rl.async_steps: {rl.async_steps} with rl.dynamic_sampling: a batch's first "
                          "block is known once the one before is filtered; use 0 or 1")  # fmt: skip
    if rl.async_steps and rl.importance_sampling == "none" and not rl.decoupled:
        raise ConfigError(
            f"rl.async_steps: {rl.async_steps} samples with weights up to that many rollout batches old: set "
            "rl.importance_sampling "
            f"({', '.join(n for n in IS_CORRECTIONS.names() if n != 'none')}) or rl.decoupled so the engine's "
            "log-probabilities correct it"
        )


def _flagged(registry: Registry, flag: str) -> str:
    """The names of `registry`'s entries whose `flag` is set, for an error message."""
    return ", ".join(name for name in registry.names() if getattr(registry.get(name, ""), flag))
