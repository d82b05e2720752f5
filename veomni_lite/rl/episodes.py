"""Multi-turn episodes, token in and token out: the rollout loop of an agent with tools (`rl.tools`) and an
environment (`rl.environment`).

An episode is its prompt, then turns: the model's tokens (sampled by the rollout engine from the episode so far, the
ids kept as sampled, never re-tokenized), then the environment's tokens (the tools' results as `tool` turns, or the
environment's observation as a `user` turn, rendered with the model's chat template), until the model answers without
a tool call (no environment) or the environment says `done`, or `rl.max_turns` model turns, or `rl.max_episode_tokens`
(prompt included) is reached (those two: `truncated`; so is a model turn cut at `rl.max_new_tokens`); an environment
that did not say done is then closed (`close`, `veomni_lite.rl.environments`).

Turn boundary: the model's turn ends with the end-of-turn token it sampled (ChatML's `<|im_end|>`). The environment's
tokens are the text the chat template renders after that token: with A = the messages so far (the model's turn last,
as text) rendered without a generation prompt and B = the same plus the new tool/user turn(s) rendered with it, B must
start with A (the prefix property; a template that renders earlier turns differently once a turn follows, e.g. one
that drops past reasoning, breaks it and is a `TemplateError` naming the episode), and the environment's text is what
follows the last end-of-turn text in A (ChatML: "\\n") then B after A ("<|im_start|>user\\n<tool_response>\\n...
</tool_response><|im_end|>\\n<|im_start|>assistant\\n"). That text is tokenized alone (add_special_tokens=False): the
chat markers are special tokens, so the ids are those of tokenizing the whole rendering.

Batching: each turn asks the engine for the next model turn of every unfinished episode in one `generate` call (the
embedded engine batches them; vLLM takes token ids in and gives them out), so an episode that ends early stalls
nothing. Turn t of the episode seeded s is sampled with `turn_seed(s, t)`. `more(active)` (the trainer: a MAX over the
ranks) lets every rank call the engine the same number of times, as a collective engine needs.

Tools failing: the tools' own failures (a raise, a timeout; not the model's malformed calls) are named on the console
and, above `rl.max_tool_error_rate` of a tool's calls in a rollout batch, fail the run on every rank
(`veomni_lite.rl.tools.ToolErrors`; `generate_episodes` sums the counts over the ranks, one all-reduce).

Training: the sample's response is every token after the prompt, `response_mask` 1 at the model's tokens and 0 at the
environment's, which are in the sequence (attended to) but out of every loss (their labels IGNORE_INDEX); the reward
functions score the last model turn's text; the environment's rewards (summed) add to the reward as
`rl/rewards/environment`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from veomni_lite.data.checks import DataError
from veomni_lite.engines.base import RolloutEngine, RolloutRequest, SamplingSettings
from veomni_lite.rl.environments import EnvironmentSpec, EpisodeError
from veomni_lite.rl.rollouts import RolloutSample, batch_name
from veomni_lite.rl.tools import Tool, ToolErrors, parse_tool_calls, run_tool_calls

__all__ = ["Agent", "Episode", "EpisodeStart", "TemplateError", "run_episodes", "turn_seed"]


class TemplateError(DataError):
    """The chat template breaks the prefix property an episode's tokens rely on (see the module docstring)."""


def turn_seed(seed: int, turn: int) -> int:
    """The sampling seed of model turn `turn` of the episode seeded `seed` (63 bits)."""
    digest = hashlib.blake2b(f"{seed}/turn/{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@dataclass
class EpisodeStart:
    """What an episode starts from: the prompt's messages, its row's columns (the answer among them), name, seed."""

    messages: list[dict[str, Any]]
    columns: dict[str, Any]
    where: str
    seed: int
    group: int = 0
    model_inputs: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class Episode:
    """An episode's tokens and what happened in it (see the module docstring)."""

    start: EpisodeStart
    prompt_ids: list[int]
    messages: list[dict[str, Any]]
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: list[dict[str, Any]] = field(default_factory=list)
    tool_calls: dict[str, int] = field(default_factory=dict)
    tool_errors: int = 0
    tool_runs: list[tuple[str, str]] = field(default_factory=list)  # (tool, its failure or "") per call that ran
    env_reward: float = 0.0
    env_done: bool = False  # the environment said done (else it is closed at the episode's end)
    unseen: str | None = None  # the model's last turn when cut before the environment saw it
    done: bool = False
    truncated: bool = False
    last_text: str = ""
    prompt_text: str = ""
    env: Any = None

    @property
    def model_turns(self) -> int:
        return sum(turn["role"] == "assistant" for turn in self.turns)

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    def _add(self, role: str, ids: Sequence[int], text: str, logprobs: Sequence[float] | None = None) -> None:
        model = role == "assistant"
        self.response_ids += list(ids)
        self.response_mask += [int(model)] * len(ids)
        self.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(ids)
        self.turns.append({"role": role, "text": text, "tokens": len(ids)})

    def sample(self, version: int = 0) -> RolloutSample:
        """The episode as one `RolloutSample` of its group (reward filled by the scoring)."""
        model = sum(self.response_mask)
        stats = {
            "turns": self.turns, "tool_calls": self.tool_calls, "tool_errors": self.tool_errors,
            "tool_runs": self.tool_runs, "model_tokens": model, "env_tokens": len(self.response_ids) - model,
            "env_reward": self.env_reward,
        }  # fmt: skip
        return RolloutSample(
            group=self.start.group, prompt_ids=list(self.prompt_ids), response_ids=list(self.response_ids),
            truncated=self.truncated, engine_logprobs=list(self.logprobs), model_inputs=self.start.model_inputs,
            response_text=self.last_text, where=self.start.where, version=version, prompt_text=self.prompt_text,
            response_mask=list(self.response_mask), episode=stats,
        )  # fmt: skip


class Agent:
    """How episodes run: the tokenizer and chat template (None: the tokenizer's), the tools, the environment, the
    limits (`rl.max_turns`, `rl.max_episode_tokens`, `rl.tool_timeout_s`, `rl.max_tool_error_rate`)."""

    def __init__(
        self,
        tokenizer: Any,
        tools: Sequence[Tool] = (),
        environment: EnvironmentSpec | None = None,
        max_turns: int = 4,
        max_episode_tokens: int = 1024,
        tool_timeout_s: float = 10.0,
        chat_template: str | None = None,
        max_tool_error_rate: float = 0.5,
    ) -> None:
        self.tokenizer = tokenizer
        self.tools = list(tools)
        self.environment = environment
        self.max_turns = max_turns
        self.max_episode_tokens = max_episode_tokens
        self.tool_timeout_s = tool_timeout_s
        self.chat_template = chat_template
        self.schemas = [tool.schema for tool in self.tools] or None
        self.tool_failures = ToolErrors(self.tools, max_tool_error_rate)

    def render(self, messages: list[dict[str, Any]], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=self.schemas, chat_template=self.chat_template, tokenize=False,
            add_generation_prompt=generation_prompt,
        )  # fmt: skip

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def begin(self, start: EpisodeStart) -> Episode:
        """A new episode: the environment made and reset (its first observation a user turn), the prompt rendered."""
        messages = [dict(m) for m in start.messages]
        env = None
        if self.environment is not None:
            env, first = self.environment.make(start.columns, start.where)
            if first:
                messages.append({"role": "user", "content": first})
        text = self.render(messages, True)
        episode = Episode(start, self.encode(text), messages, tool_calls={t.name: 0 for t in self.tools}, env=env)
        episode.prompt_text = text
        return episode

    def continuation(self, episode: Episode, end_text: str, new: list[dict[str, Any]]) -> tuple[list[int], str]:
        """The environment's ids and text after the model's end-of-turn token (see the module docstring)."""
        before = self.render(episode.messages, False)
        after = self.render(episode.messages + new, True)
        turn = len(episode.turns)
        if not after.startswith(before):
            at = next((i for i, (a, b) in enumerate(zip(before, after)) if a != b), min(len(before), len(after)))
            raise TemplateError(
                f"{episode.start.where}, turn {turn}: the chat template renders the episode's earlier turns "
                f"differently once a {new[0]['role']} turn follows (at character {at}: {before[at : at + 40]!r} became "
                f"{after[at : at + 40]!r}), so the model's sampled tokens would not be the training sequence's; use a "
                "template whose renderings extend each other (data.chat_template)"
            )
        cut = before.rfind(end_text) if end_text else -1
        if cut < 0:
            raise TemplateError(
                f"{episode.start.where}, turn {turn}: the chat template does not end the assistant's turn with the "
                f"end-of-turn token {end_text!r} the model sampled"
            )
        text = before[cut + len(end_text) :] + after[len(before) :]
        return self.encode(text), text

    def after_model_turn(self, episode: Episode, text: str, end_text: str) -> None:
        """The tools' results or the environment's observation appended (or the episode ended)."""
        episode.messages.append({"role": "assistant", "content": text})
        calls, problems = parse_tool_calls(text) if self.tools else ([], [])
        turn = episode.model_turns
        if calls or problems:
            results = run_tool_calls(self.tools, calls, problems, self.tool_timeout_s)
            for call in calls:
                episode.tool_calls[call.name] = episode.tool_calls.get(call.name, 0) + 1
            if problems:  # calls that did not parse (counted apart from the tools' own)
                episode.tool_calls["error"] = episode.tool_calls.get("error", 0) + len(problems)
            episode.tool_errors += sum(r.error for r in results)
            episode.tool_runs += [(r.name, r.failure) for r in results if r.ran]
            new = [{"role": "tool", "name": r.name, "content": r.text} for r in results]
        elif episode.env is not None:
            assert self.environment is not None
            observation, reward, done = self.environment.step(episode.env, text, episode.start.where, turn)
            episode.env_reward += reward
            if done:
                episode.done = episode.env_done = True
                return
            new = [{"role": "user", "content": observation}]
        else:
            episode.done = True  # the model answered
            return
        if turn >= self.max_turns:
            episode.done = episode.truncated = True
            return
        ids, rendered = self.continuation(episode, end_text, new)
        if len(episode) + len(ids) >= self.max_episode_tokens:  # no room for a model token after them
            episode.done = episode.truncated = True
            return
        episode.messages += new
        episode._add(new[0]["role"], ids, rendered)

    def finish(self, episode: Episode) -> None:
        """An episode the environment did not end, closed (`close`, its reward added; see `environments`)."""
        if episode.env is not None and not episode.env_done:
            assert self.environment is not None
            reward = self.environment.close(episode.env, episode.unseen, episode.start.where, episode.model_turns)
            episode.env_reward += reward
            episode.env_done = True


def run_episodes(
    engine: RolloutEngine,
    starts: Sequence[EpisodeStart],
    settings: SamplingSettings,
    agent: Agent,
    more: Callable[[bool], bool] = lambda active: active,
) -> tuple[list[Episode], Exception | None]:
    """Every start's episode (see the module docstring), and the first EpisodeError or TemplateError met (after which
    this rank's episodes stop; it still calls the engine as often as `more` says, then the caller agrees on it)."""
    problem: Exception | None = None
    episodes: list[Episode] = []
    try:
        episodes = [agent.begin(start) for start in starts]
    except (EpisodeError, TemplateError) as exc:
        problem = exc
    stop_ids = set(settings.stop_ids)
    decode = agent.tokenizer.decode
    turn = 0
    while True:
        active = [] if problem is not None else [e for e in episodes if not e.done]
        room = {id(e): agent.max_episode_tokens - len(e) for e in active}
        for episode in [e for e in active if room[id(e)] < 1]:
            episode.done = episode.truncated = True
        active = [e for e in active if not e.done]
        if not more(bool(active)):
            break
        budget = min(settings.max_new_tokens, max((room[id(e)] for e in active), default=1))
        requests = [
            RolloutRequest(e.prompt_ids + e.response_ids, [turn_seed(e.start.seed, turn)], e.start.model_inputs)
            for e in active
        ]
        results = engine.generate(requests, replace(settings, max_new_tokens=max(budget, 1)))
        try:
            for episode, (rollout,) in zip(active, results):
                limit = room[id(episode)]
                ids, logprobs = list(rollout.response_ids[:limit]), list(rollout.logprobs[:limit])
                ended = bool(ids) and ids[-1] in stop_ids and rollout.finish_reason != "length"
                ended = ended and len(ids) == len(rollout.response_ids)
                body = ids[:-1] if ended else ids
                text = decode(body, skip_special_tokens=False)
                episode._add("assistant", ids, text, logprobs)
                episode.last_text = decode(body, skip_special_tokens=True)
                if not ended:
                    episode.done = episode.truncated = True
                    episode.unseen = text
                    continue
                agent.after_model_turn(episode, text, decode([ids[-1]], skip_special_tokens=False))
        except (EpisodeError, TemplateError) as exc:
            problem = exc
        turn += 1
    try:
        for episode in episodes if problem is None else ():
            agent.finish(episode)
    except EpisodeError as exc:
        problem = exc
    return episodes, problem


def episode_metrics(samples: Sequence[RolloutSample]) -> dict[str, Any]:
    """This rank's share of the episode metrics (values: (total, count) for means, tensors for extrema)."""
    episodes = [s.episode for s in samples if s.episode]
    if not episodes:
        return {}
    n = float(len(episodes))

    def tensor(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float64)

    turns = tensor([sum(t["role"] == "assistant" for t in e["turns"]) for e in episodes])
    calls = tensor([sum(v for k, v in e["tool_calls"].items() if k != "error") for e in episodes])
    out: dict[str, Any] = {
        "rl/turns/mean": (turns.sum(), n),
        "rl/turns/max": turns.max(),
        "rl/tool_calls/mean": (calls.sum(), n),
        "rl/tool_errors": (tensor([e["tool_errors"] for e in episodes]).sum(), n),
        "rl/episode_truncated": (tensor([float(s.truncated) for s in samples if s.episode]).sum(), n),
        "rl/episode/model_tokens": (tensor([e["model_tokens"] for e in episodes]).sum(), n),
        "rl/episode/env_tokens": (tensor([e["env_tokens"] for e in episodes]).sum(), n),
    }
    names = sorted({k for e in episodes for k in e["tool_calls"] if k != "error"})
    for name in names:
        out[f"rl/tool_calls/{name}"] = (tensor([e["tool_calls"].get(name, 0) for e in episodes]).sum(), n)
    runs = [run for e in episodes for run in e.get("tool_runs", [])]
    for name in sorted({name for name, _ in runs}):  # the tool's own failures per call that ran
        failures = tensor([float(bool(f)) for t, f in runs if t == name])
        out[f"rl/tool_error_rate/{name}"] = (failures.sum(), float(failures.numel()))
    return out


def starts_of(prompts: Sequence[Any], indices: Sequence[int], seeds: Mapping[int, Sequence[int]]) -> list[EpisodeStart]:
    """The episodes of prompts `indices` (each `Prompt` with its messages), one per seed of `seeds[i]`."""
    starts = []
    for i in indices:
        prompt = prompts[i]
        columns = {**prompt.columns, "answer": prompt.answer}
        for seed in seeds[i]:
            starts.append(EpisodeStart(prompt.messages, columns, prompt.where, seed, i, prompt.model_inputs))
    return starts


def make_agent(rl: Any, data: Any, tokenizer: Any, template: str | None) -> Agent:
    """The `Agent` of an `rl` section with tools or an environment (its config loaded them once already), with the
    `data` section's limits and chat `template` (None: the tokenizer's)."""
    from veomni_lite.rl.environments import load_environment
    from veomni_lite.rl.tools import load_tools

    environment = load_environment({"class": rl.environment, "kwargs": rl.environment_kwargs} if rl.environment else "")
    return Agent(
        tokenizer, load_tools(rl.tools), environment, rl.max_turns, rl.max_episode_tokens or data.max_seq_len,
        rl.tool_timeout_s, template, rl.max_tool_error_rate,
    )  # fmt: skip


def generate_episodes(
    context: Any,
    k: int,
    prompts: Sequence[Any],
    indices: list[int],
    count: int,
    settings: SamplingSettings,
    step: int,
    sample_seed: Callable[[int, int, int, int], int],
    score: Callable[[Any, int, list[RolloutSample], Sequence[Any], int], None],
) -> list[RolloutSample]:
    """`veomni_lite.rl.rollout_batch.generate` for episodes (`context`: the pipeline's `RolloutContext`; `step`: the
    weights' version; `score`: the pipeline's scoring stage, `rollout_batch.score`): this rank's prompts' episodes as
    scored samples. The turns are agreed over the ranks (the engine may be collective); an environment or template
    failure on any rank, and a reward failure, are the same named error on every rank."""
    from veomni_lite.distributed.collectives import agree, agreed_count

    seeds = {i: [sample_seed(context.seed, k, i, j) for j in range(count)] for i in indices}
    starts = starts_of(prompts, indices, seeds)
    episodes, problem = run_episodes(
        context.engine, starts, settings, context.agent,
        lambda active: agreed_count(int(active), context.control_group) > 0,
    )  # fmt: skip
    agree(problem, EpisodeError, context.control_group, where=f"{batch_name(k, step)}: ")
    if context.agent.tools:  # every rank alike (rl.tools)
        runs = [run for episode in episodes for run in episode.tool_runs]
        is_main = context.parallel.rank == 0
        context.agent.tool_failures.check(runs, context.control_group, is_main, where=f"{batch_name(k, step)}: ")
    samples = [episode.sample(step) for episode in episodes]  # prompt_text: as rendered with the tools
    score(context, k, samples, [prompts[s.group] for s in samples], step)
    if context.agent.environment is not None:
        for sample in samples:
            sample.rewards["environment"] = sample.episode["env_reward"]
            sample.reward += sample.episode["env_reward"]
    return samples
