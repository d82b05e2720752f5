"""A rollout batch as samples the trainer collates, and rollouts made elsewhere (`rl.rollouts_path`).

A `RolloutSample` is one response to one prompt, with everything its loss needs, in a form that does not depend on
the layout (so a checkpoint can hold the batch and resume it on any world size): the prompt and response ids, the
prompt's image inputs, the reward and advantage, the engine's log-probabilities, and the old and reference
log-probabilities of its response tokens (filled after the rollout, `RolloutBatch`). `collate_rollouts` makes one
micro-batch: `input_ids` = prompt + response, `policy_labels` the response (IGNORE_INDEX for the prompt, and for the
whole response where `mask_truncated` drops it), and each float per-token key of `veomni_lite.rl.policy_loss` in the
same shifted frame (the value of response token i sits where it is predicted), padded or packed like the ids.
`routed_experts` (routing replay, `rl.routing_replay`): a sample's recorded experts, [prompt + response, MoE layers,
top_k] (uint8 up to 256 experts, else int16 / int32), laid out unshifted like the ids as `ROUTED_EXPERTS` [B, S,
layers, top_k] int32 (padding: experts 0..top_k-1, a valid choice that no kept value depends on).

`rl.rollouts_path`, one JSON object per line: `group` (consecutive rows of the same group, `num_generations` of them),
the prompt (`prompt_ids`, or `prompt` as messages or text, rendered like the prompts of the data files), the response
(`response_ids`, or `response` text, followed by the end-of-turn token unless `truncated`), `reward`, and optionally
`logprobs` (the engine's, one per response token), `truncated` and `images`. An episode (`veomni_lite.rl.episodes`)
gives `turns: [{role, ids | text}, ...]` instead of the response: its turns in order, `ids` taken as given and `text`
tokenized as given (no chat markup added: write it, or give ids); `assistant` turns train, `tool`, `environment` and
`user` turns are in the sequence but in no loss (`response_mask`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from veomni_lite.data.checks import DataError
from veomni_lite.data.sft import row_name
from veomni_lite.loss_keys import IGNORE_INDEX, SEQUENCE_IDS
from veomni_lite.models.routing import ROUTED_EXPERTS
from veomni_lite.rl.critic import CRITIC_VALUES, OLD_VALUES, RETURNS, VALUE_LABELS
from veomni_lite.rl.policy_loss import (
    ADVANTAGES,
    ENGINE_LOGPROBS,
    OLD_LOGPROBS,
    POLICY_LABELS,
    REF_LOGPROBS,
    TEACHER_LOGPROBS,
    TOKEN_VALUES,
)

__all__ = [
    "EVALUATION",
    "ROUTED_EXPERTS",
    "RolloutSample",
    "batch_name",
    "collate_rollouts",
    "prefix_positions",
    "read_rollouts",
]

EVALUATION = -1
"""The batch number of an evaluation's greedy generation (`RLTrainer.evaluate`), which is no rollout batch."""


def batch_name(k: int, step: int) -> str:
    """How errors name batch k at trainer step `step`: rollout batch k, or the evaluation of step `step`'s weights."""
    if k != EVALUATION:
        return f"rollout batch {k}"
    return "the evaluation of the starting weights" if step == 0 else f"the evaluation after step {step}"


@dataclass
class RolloutSample:
    """One response (see the module docstring). Per-token lists hold one value per response token."""

    group: int
    prompt_ids: list[int]
    response_ids: list[int]
    reward: float = 0.0
    advantage: float = 0.0
    truncated: bool = False
    engine_logprobs: list[float] | None = None
    old_logprobs: list[float] | None = None
    ref_logprobs: list[float] | None = None
    rewards: dict[str, float] = field(default_factory=dict)
    model_inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    prompt_text: str = ""
    response_text: str = ""
    where: str = ""
    version: int = 0  # the policy version (optimizer steps) of the weights that sampled it (partial: its first token)
    versions: list[int] | None = None  # partial rollouts: each response token's version (None: all `version`)
    old_values: list[float] | None = None  # the critic's (`rl.advantage: gae`, `veomni_lite.rl.critic`)
    returns: list[float] | None = None
    token_advantages: list[float] | None = None  # GAE's per token; else `advantage` at every token
    response_mask: list[int] | None = None  # multi-turn: 1 at the model's tokens, 0 at the environment's (None: all 1)
    episode: dict[str, Any] = field(default_factory=dict)  # multi-turn: turns and counts (`veomni_lite.rl.episodes`)
    routed_experts: torch.Tensor | None = None  # routing replay: [len(self), MoE layers, top_k] (module docstring)
    teacher_logprobs: list[float] | None = None  # on-policy distillation's (`rl.teacher`, `veomni_lite.rl.teacher`)

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    def plain(self) -> dict[str, Any]:
        """Its fields as plain data (what a checkpoint and the samples' all-gather carry); `RolloutSample(**plain)`
        rebuilds it."""
        return dict(vars(self))

    def tensors(self, mask_truncated: bool = False) -> dict[str, torch.Tensor]:
        """What `collate_rollouts` takes: unshifted `input_ids`, `policy_labels` and per-token floats at the
        response tokens' own positions (0 elsewhere), plus the image inputs."""
        prompt, response = len(self.prompt_ids), len(self.response_ids)
        ids = torch.tensor(self.prompt_ids + self.response_ids, dtype=torch.long)
        labels = ids.clone()
        labels[:prompt] = IGNORE_INDEX
        if self.response_mask is not None:  # an episode's environment tokens: attended to, never trained
            labels[prompt:][torch.tensor(self.response_mask, dtype=torch.long) == 0] = IGNORE_INDEX
        if mask_truncated and self.truncated:
            labels[:] = IGNORE_INDEX
        out = {"input_ids": ids, POLICY_LABELS: labels, **self.model_inputs}
        if self.routed_experts is not None:
            out[ROUTED_EXPERTS] = self.routed_experts
        values = {
            ADVANTAGES: self.token_advantages if self.token_advantages is not None else [self.advantage] * response,
            OLD_LOGPROBS: self.old_logprobs,
            REF_LOGPROBS: self.ref_logprobs,
            ENGINE_LOGPROBS: self.engine_logprobs,
            TEACHER_LOGPROBS: self.teacher_logprobs,
            OLD_VALUES: self.old_values,
            RETURNS: self.returns,
        }
        for key, value in values.items():
            if value is not None:  # absent: not computed (old on policy, no reference) or not given (engine)
                full = torch.zeros(prompt + response, dtype=torch.float64)
                full[prompt:] = torch.tensor(value, dtype=torch.float64)
                out[key] = full
        return out


def prefix_positions(sequence_ids: torch.Tensor, first: int, shared: int) -> slice:
    """In a packed row's `sequence_ids` (1-D), the positions of the shared prefix (`shared` tokens, -2) before the
    branch starting at `first`: the group's prefix run precedes its branches (`veomni_lite.data.collator.pack`)."""
    end = first
    while int(sequence_ids[end - 1]) != -2:
        end -= 1
    return slice(end - shared, end)


def _shift(value: torch.Tensor) -> torch.Tensor:
    return torch.cat([value[1:], value.new_zeros(1)])


def collate_rollouts(
    samples: Sequence[Mapping[str, torch.Tensor]], collate: Callable[..., dict[str, torch.Tensor]], packing: bool
) -> dict[str, torch.Tensor]:
    """`RolloutSample.tensors` of several samples -> one micro-batch: `collate` (the model's own collate function,
    taking `labels`) makes the ids, labels and positions; each float key any sample has is shifted like the labels and
    padded with 0 (or packed at the sample's positions; 0 for a sample without it). With the critic's returns,
    `value_labels` is a copy of `policy_labels`."""
    floats = TOKEN_VALUES + CRITIC_VALUES
    kept = (*floats, ROUTED_EXPERTS)
    base = [{("labels" if k == POLICY_LABELS else k): v for k, v in s.items() if k not in kept} for s in samples]
    batch = collate(base)
    batch[POLICY_LABELS] = batch.pop("labels")
    rows, length = batch["input_ids"].shape[:2]
    # packed: each sample's positions by its id (a shared prefix holds none of them; their values there are 0)
    where = [batch[SEQUENCE_IDS][0] == sample for sample in range(len(samples))] if packing else []
    for key in (k for k in floats if any(k in s for s in samples)):
        shifted = [
            _shift(s[key]) if key in s else torch.zeros(len(s["input_ids"]), dtype=torch.float64) for s in samples
        ]
        if packing:
            out = torch.zeros(length, dtype=torch.float64)
            for at, value in zip(where, shifted):
                out[at] = value[value.numel() - int(at.sum()) :]
            batch[key] = out[None]
        else:
            out = torch.zeros(rows, length, dtype=torch.float64)
            for row, value in enumerate(shifted):
                out[row, : value.numel()] = value
            batch[key] = out
    if any(ROUTED_EXPERTS in s for s in samples):
        batch[ROUTED_EXPERTS] = _lay_out_experts(samples, batch, where)
    if RETURNS in batch:  # the critic's head trains on the policy's tokens
        batch[VALUE_LABELS] = batch[POLICY_LABELS].clone()
    return batch


def _lay_out_experts(
    samples: Sequence[Mapping[str, torch.Tensor]], batch: Mapping[str, torch.Tensor], where: list[torch.Tensor]
) -> torch.Tensor:
    """The samples' `routed_experts` at their tokens' positions in the collated `batch` (unshifted, like the ids):
    [B, S, layers, top_k] int32; a packed shared prefix gets its first sample's (the same tokens, run once)."""
    missing = [i for i, s in enumerate(samples) if ROUTED_EXPERTS not in s]
    if missing:
        raise ValueError(f"routing replay: samples {missing} of the micro-batch have no recorded experts")
    layers, top_k = samples[0][ROUTED_EXPERTS].shape[1:]
    rows, length = batch["input_ids"].shape[:2]
    out = torch.arange(top_k, dtype=torch.int32).expand(rows, length, layers, top_k).clone()
    filled: set[int] = set()
    for index, sample in enumerate(samples):
        experts = sample[ROUTED_EXPERTS].to(torch.int32)
        if experts.shape != (len(sample["input_ids"]), layers, top_k):
            raise ValueError(
                f"routing replay: sample {index} holds experts {tuple(experts.shape)} for "
                f"{len(sample['input_ids'])} tokens, {layers} layers, top_k {top_k}"
            )
        if not where:
            out[index, : len(experts)] = experts
            continue
        at = torch.nonzero(where[index])[:, 0]
        shared = len(experts) - len(at)
        out[0, at] = experts[shared:]
        if shared:
            prefix = prefix_positions(batch[SEQUENCE_IDS][0], int(at[0]), shared)
            if prefix.start not in filled:  # the group's first sample's
                filled.add(prefix.start)
                out[0, prefix] = experts[:shared]
    return out


def _ids(value: Any, where: str, key: str, vocab_size: int) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise DataError(f"{where}: {key!r} must be a list of token ids")
    bad = [t for t in value if not 0 <= t < vocab_size]
    if bad:
        raise DataError(f"{where}: {key!r} holds {bad[:5]}, outside the vocabulary [0, {vocab_size})")
    return value


TURN_ROLES = {"assistant": 1, "tool": 0, "environment": 0, "user": 0}


def _turns(turns: Any, where: str, encode: Callable[[str], list[int]], vocab_size: int) -> tuple[list[int], list[int]]:
    """A given episode's response ids and `response_mask` (see the module docstring); a DataError naming the turn."""
    if not isinstance(turns, list) or not turns:
        raise DataError(f"{where}: 'turns' must be a non-empty list of {{role, ids | text}}")
    ids: list[int] = []
    mask: list[int] = []
    for index, turn in enumerate(turns):
        at = f"turns[{index}]"
        if not isinstance(turn, Mapping) or turn.get("role") not in TURN_ROLES or ("ids" in turn) == ("text" in turn):
            raise DataError(f"{where}: {at} must be {{role: one of {sorted(TURN_ROLES)}, ids or text}}, got {turn!r}")
        part = _ids(turn["ids"], where, f"{at}.ids", vocab_size) if "ids" in turn else encode(str(turn["text"]))
        ids += part
        mask += [TURN_ROLES[turn["role"]]] * len(part)
    if not any(mask):
        raise DataError(f"{where}: 'turns' has no assistant tokens to train")
    return ids, mask


def read_rollouts(
    path: str | Path,
    num_generations: int,
    encode_prompt: Callable[[Mapping[str, Any], str], tuple[list[int], str, dict[str, torch.Tensor]]],
    encode_response: Callable[[str], list[int]],
    end_of_turn: int,
    vocab_size: int,
) -> list[RolloutSample]:
    """Every row of the JSONL at `path` as a `RolloutSample` (see the module docstring); a bad row (a missing key, a
    group of the wrong size or out of order, logprobs of the wrong length, ids outside the vocabulary) is a
    DataError naming the file and row. `encode_prompt(row, where)` -> (ids, text, image inputs)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"rl.rollouts_path: {path} does not exist")
    samples: list[RolloutSample] = []
    groups: list[Any] = []
    with path.open(encoding="utf-8") as handle:
        for index, line in enumerate(handle):
            if not line.strip():
                continue
            where = row_name(path, index)
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{where}: not JSON ({exc.msg} at column {exc.colno})") from None
            missing = [k for k in ("group", "reward") if k not in row]
            if "prompt_ids" not in row and "prompt" not in row:
                missing.append("prompt_ids or prompt")
            if "response_ids" not in row and "response" not in row and "turns" not in row:
                missing.append("response_ids, response or turns")
            if missing:
                raise DataError(f"{where}: missing {missing} (the row has {sorted(row)})")
            if not groups or groups[-1] != row["group"]:
                if groups and len(samples) % num_generations:
                    raise DataError(f"{where}: group {groups[-1]!r} has {len(samples) % num_generations} rows, "
                                    f"not rl.num_generations = {num_generations}")  # fmt: skip
                if row["group"] in groups:
                    raise DataError(f"{where}: group {row['group']!r} appears again after other groups")
                groups.append(row["group"])
            truncated = bool(row.get("truncated", False))
            if "prompt_ids" in row:
                prompt_ids, text, inputs = _ids(row["prompt_ids"], where, "prompt_ids", vocab_size), "", {}
            else:
                prompt_ids, text, inputs = encode_prompt(row, where)
            mask = None
            if "turns" in row:
                response, mask = _turns(row["turns"], where, encode_response, vocab_size)
            elif "response_ids" in row:
                response = _ids(row["response_ids"], where, "response_ids", vocab_size)
            else:
                response = encode_response(str(row["response"])) + ([] if truncated else [end_of_turn])
            if not response:
                raise DataError(f"{where}: the response is empty")
            logprobs = row.get("logprobs")
            if logprobs is not None and (not isinstance(logprobs, list) or len(logprobs) != len(response)):
                raise DataError(
                    f"{where}: 'logprobs' must hold one number per response token ({len(response)}), got "
                    f"{len(logprobs) if isinstance(logprobs, list) else type(logprobs).__name__}"
                )
            reward = row["reward"]
            if not isinstance(reward, (int, float)) or isinstance(reward, bool) or reward != reward:
                raise DataError(f"{where}: 'reward' must be a finite number, got {reward!r}")
            samples.append(
                RolloutSample(
                    group=len(groups) - 1, prompt_ids=prompt_ids, response_ids=response, reward=float(reward),
                    truncated=truncated, engine_logprobs=[float(x) for x in logprobs] if logprobs else None,
                    model_inputs=inputs, prompt_text=text, response_text=str(row.get("response", "")), where=where,
                    response_mask=mask,
                )
            )  # fmt: skip
    if len(samples) % num_generations:
        raise DataError(f"{path}: the last group has {len(samples) % num_generations} rows, not {num_generations}")
    if not samples:
        raise DataError(f"{path}: no rollouts")
    return samples
