"""Environments and tasks from the ecosystem's hubs: verifiers and OpenEnv environments as `rl.environment`,
reasoning-gym tasks as a prompt source with their own scoring (docs/agents.md, docs/rl.md).

Each is adapted to the contract of our own environments (`veomni_lite.rl.environments`: one instance per episode,
`reset(row)`, `step(text)`, `close(text)`), so an episode's tokens are ours exactly as for them: the model's sampled
ids kept, the environment's messages rendered by the chat template and out of every loss. The packages are the
optional extra `envs` (`pip install -e ".[envs]"`); a missing one is a ConfigError naming the key on every rank
(the config is read on every rank before any process group), an environment that raises an `EpisodeError` naming
it, the row and the turn, raised on every rank (`agree`).

- `verifiers:NAME` (an installed environment, e.g. from the Environments Hub, or a taskset id verifiers ships) or
  `verifiers:path/to/env.py` (a module in verifiers' own API that exports its `Taskset`, and optionally its `Env`,
  in `__all__`). `rl.environment_kwargs` is verifiers' `[env]` block (`taskset: {...}`, the env's own keys). The
  environment's `Env.run(task, agents)` is its turn logic: each `interaction.turn(message)` of a trainable agent is
  one model turn, `message` the environment's user turn before it; a plain taskset's `SingleAgentEnv` runs one
  turn. The task's `@vf.stop`s on the trace end it, `@vf.reward`s (and judges) score it when it closes, as in a
  verifiers rollout, and `Env.finalize` sees it: the weighted sum is the episode's environment reward. The prompts are
  the taskset's tasks: `data.train_path: verifiers:NAME?take=512` (and `data.eval_path` for held-out ones),
  with the taskset config of `rl.environment_kwargs`. One agent seat is played by the policy; an environment that
  runs a second one (a modelled user) is an EpisodeError.
- `openenv:http://HOST:PORT` (a running server, through OpenEnv's client) or `openenv:path/to/env.py:Class` /
  `openenv:package.module:Class` (an `Environment` subclass run in process). `rl.environment_kwargs`:
  `action_field` (the action's field the model's text goes in, default `message`), `observation_field` (the
  observation's field shown to the model; default: its one text field), `kwargs` (the class's constructor arguments,
  in process), `timeout_s` (per message, a server). The row's `reset` column (a mapping), when present, is the reset's
  keyword arguments; each step's reward adds to the episode's, its `done` ends it.
- `data.train_path: reasoning_gym:TASK?size=512&seed=0&KEY=VALUE...` (any of reasoning-gym's task names, its
  config's keys as query keys, values read as YAML, not URL-decoded): the task's generated questions as user prompts,
  with their `answer`, `question` and `metadata` columns, which the reward built-in `reasoning_gym`
  (`veomni_lite.rl.rewards`) scores with the task's own `score_answer`.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import math
import numbers
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from veomni_lite.config import ConfigError, unknown_key

__all__ = [
    "ENVIRONMENT_KINDS", "PROMPT_KINDS", "HubSource", "OpenEnvEpisode", "VerifiersEpisode", "hub_environment",
    "hub_sources", "require",
]  # fmt: skip

PACKAGES = {"verifiers": "verifiers", "openenv": "openenv-core", "reasoning_gym": "reasoning-gym"}
"""Each hub kind and the package its adapter needs (the `envs` extra pins them)."""
ENVIRONMENT_KINDS = ("verifiers", "openenv")
PROMPT_KINDS = ("reasoning_gym", "verifiers")
VERIFIERS_TASK = "verifiers_task"
"""The column of a verifiers prompt row holding its task's data (what the environment rebuilds the task from)."""
_OPENENV_KEYS = ("action_field", "observation_field", "kwargs", "timeout_s")


def require(kind: str, key: str) -> Any:
    """The hub package of `kind` imported, or a ConfigError naming `key` and how to install it."""
    module = {"verifiers": "verifiers.v1", "openenv": "openenv.core", "reasoning_gym": "reasoning_gym"}[kind]
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(
            f"{key}: {kind} needs the {PACKAGES[kind]} package ({type(exc).__name__}: {exc}); install the extra: "
            "pip install -e '.[envs]'"
        ) from None


def split_kind(spec: Any, kinds: Sequence[str]) -> tuple[str, str] | None:
    """(kind, target) of a `kind:target` string with a kind of `kinds`, else None."""
    if not isinstance(spec, str):
        return None
    kind, sep, target = spec.partition(":")
    return (kind, target) if sep and kind in kinds else None


def _query(target: str, key: str) -> tuple[str, dict[str, Any]]:
    """`NAME?k=v&...` as (NAME, {k: v as YAML reads it})."""
    name, _, query = target.partition("?")
    if not name:
        raise ConfigError(f"{key}: {target!r} names nothing before its options")
    options = {}
    for part in filter(None, query.split("&")):  # not URL-decoded: `operators=[+,-]` keeps its "+"
        option, sep, value = part.partition("=")
        if not sep or not option:
            raise ConfigError(f"{key}: {part!r} in {target!r} is not KEY=VALUE")
        options[option] = yaml.safe_load(value) if value else ""
    return name, options


def _user_module(at: str, target: str, base_dir: Path) -> Any:
    """The module `target` names: a `.py` file (run because the config names it) or an importable module."""
    from veomni_lite.rl.rewards import _import_file

    if target.endswith(".py"):
        path = Path(target).expanduser()
        path = (path if path.is_absolute() else base_dir / path).resolve()
        if not path.is_file():
            raise ConfigError(f"{at}: {path} does not exist (a relative path resolves against {base_dir})")
        return _import_file(at, path)
    try:
        return importlib.import_module(target)
    except ImportError as exc:
        raise ConfigError(f"{at}: cannot import {target!r} ({type(exc).__name__}: {exc})") from None


# ---------------------------------------------------------------- prompt sources


class HubSource:
    """A prompt source from a hub, read like a data file (`veomni_lite.data.sft.Source`: `path` names its rows,
    `num_rows`, `read(start, stop)`): rows in the `messages` format."""

    def __init__(self, spec: str, rows: list[dict[str, Any]]) -> None:
        self.path = Path(spec)
        self.rows = rows

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    def read(self, start: int, stop: int) -> Iterator[tuple[int, dict[str, Any]]]:
        yield from ((i, self.rows[i]) for i in range(start, min(stop, len(self.rows))))


def hub_sources(
    spec: Any, key: str, environment: str = "", environment_kwargs: Mapping[str, Any] | None = None
) -> list[HubSource] | None:
    """`[HubSource]` for a `reasoning_gym:` or `verifiers:` spec (a string, or a list of one), else None (files).
    A verifiers source reads its taskset with the config of `environment_kwargs` when `environment` names it."""
    specs = [spec] if isinstance(spec, str) else list(spec or [])
    split = [split_kind(s, PROMPT_KINDS) for s in specs]
    if not any(split):
        return None
    if len(specs) != 1:
        raise ConfigError(f"{key}: a hub source ({specs}) is given alone, not in a list with others")
    kind, target = split[0]  # type: ignore[misc]
    if kind == "reasoning_gym":
        return [HubSource(specs[0], _reasoning_gym_rows(target, key))]
    name, views = _query(target, key)
    unknown = [k for k in views if k not in ("skip", "take")]
    if unknown:
        raise unknown_key(key, unknown[0], ("skip", "take"), "a verifiers source takes skip, take")
    same = split_kind(environment, ENVIRONMENT_KINDS) == ("verifiers", name)
    hub = verifiers_hub(name, json.dumps(dict(environment_kwargs or {}) if same else {}, sort_keys=True), key=key)
    return [HubSource(specs[0], hub.rows(int(views.get("skip", 0)), views.get("take")))]


def _reasoning_gym_rows(target: str, key: str) -> list[dict[str, Any]]:
    rg = require("reasoning_gym", key)
    task, options = _query(target, key)
    size, seed = options.pop("size", 500), options.pop("seed", 0)
    if task not in rg.factory.DATASETS:
        from veomni_lite.registries import closest

        guess = closest(task, list(rg.factory.DATASETS))
        hint = f" (did you mean `{guess}`?)" if guess else ""
        raise ConfigError(f"{key}: reasoning-gym has no task {task!r}{hint}")
    try:
        dataset = rg.create_dataset(task, size=size, seed=seed, **options)
    except Exception as exc:  # noqa: BLE001 - the task's own check of its options
        raise ConfigError(f"{key}: reasoning_gym {task} with {options}: {type(exc).__name__}: {exc}") from None
    return [
        {"messages": [{"role": "user", "content": entry["question"]}], "answer": entry["answer"],
         "question": entry["question"], "metadata": entry["metadata"]}
        for entry in dataset
    ]  # fmt: skip


# ---------------------------------------------------------------- environments


def hub_environment(kind: str, target: str, kwargs: Mapping[str, Any], key: str) -> tuple[type, dict[str, Any], str]:
    """(the episode class, its constructor's keyword arguments, where) of `rl.environment: kind:target`."""
    if kind == "verifiers":
        hub = verifiers_hub(target, json.dumps(dict(kwargs), sort_keys=True), key=key)
        return VerifiersEpisode, {"hub": hub}, f"verifiers:{target}"
    require("openenv", key)
    for name in kwargs:
        if name not in _OPENENV_KEYS:
            raise unknown_key(f"{key}_kwargs", str(name), _OPENENV_KEYS, f"openenv takes {', '.join(_OPENENV_KEYS)}")
    fields = {k: kwargs[k] for k in ("action_field", "observation_field") if k in kwargs}
    if target.startswith(("http://", "https://", "ws://", "wss://")):
        if "kwargs" in kwargs:
            raise ConfigError(f"{key}_kwargs.kwargs: constructor arguments are for an environment run in process")
        return OpenEnvEpisode, {"url": target, "timeout_s": float(kwargs.get("timeout_s", 60.0)), **fields}, target
    path, _, name = target.rpartition(":")
    if not path or not name.isidentifier():
        raise ConfigError(f"{key}: openenv:{target!r} is neither a URL nor 'path/file.py:Class' / 'module:Class'")
    cls = getattr(_user_module(key, path, Path(".")), name, None)
    from openenv.core.env_server.interfaces import Environment

    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ConfigError(f"{key}: {target} is not an OpenEnv Environment subclass (got {cls!r})")
    made = {"cls": cls, "kwargs": dict(kwargs.get("kwargs") or {}), **fields}
    return OpenEnvEpisode, made, f"openenv:{target}"


class OpenEnvEpisode:
    """One episode of an OpenEnv environment (see the module docstring): in process (`cls`) or through the client of
    the server at `url`."""

    def __init__(
        self,
        cls: type | None = None,
        kwargs: Mapping[str, Any] | None = None,
        url: str = "",
        timeout_s: float = 60.0,
        action_field: str = "message",
        observation_field: str = "",
    ) -> None:
        self.action_field, self.observation_field = action_field, observation_field
        self.client = self.env = None
        if url:
            from openenv.core.generic_client import GenericEnvClient

            self.client = GenericEnvClient(base_url=url, message_timeout_s=timeout_s).sync()
            self.client.connect()
        else:
            assert cls is not None
            self.env = cls(**dict(kwargs or {}))
            self.action_cls = _action_class(cls)

    def _result(self, out: Any) -> tuple[str, float, bool]:
        if self.client is not None:  # a StepResult of the observation as a mapping
            observation, reward, done = dict(out.observation or {}), out.reward, out.done
        else:
            observation = out.model_dump()
            reward, done = observation.pop("reward", None), observation.pop("done", False)
        for base in ("done", "reward", "metadata"):
            observation.pop(base, None)
        name = self.observation_field
        if not name:
            texts = [k for k, v in observation.items() if isinstance(v, str)]
            if len(texts) != 1:
                raise ValueError(f"the observation {observation} has {len(texts)} text fields: set observation_field")
            name = texts[0]
        if name not in observation:
            raise ValueError(f"the observation has no field {name!r} (it has {sorted(observation)})")
        if reward is not None and (isinstance(reward, bool) or not isinstance(reward, numbers.Real)):
            raise ValueError(f"the observation's reward is {reward!r}, not a number")
        return str(observation[name] or ""), float(reward or 0.0), bool(done)

    def reset(self, row: Mapping[str, Any]) -> str:
        options = dict(row.get("reset") or {})
        out = self.client.reset(**options) if self.client is not None else self.env.reset(**options)
        text, _, done = self._result(out)
        if done:
            raise ValueError("the environment's reset says done before any turn")
        return text

    def step(self, text: str) -> tuple[str, float, bool]:
        if self.client is not None:
            result = self._result(self.client.step({self.action_field: text}))
        else:
            result = self._result(self.env.step(self.action_cls(**{self.action_field: text})))
        if result[2]:
            self.close(None)
        return result

    def close(self, text: str | None) -> float:
        """The episode is over (the environment's session ends; a limit's end earns nothing more)."""
        if self.client is not None:
            self.client.disconnect()
            self.client = None
        if self.env is not None and callable(getattr(self.env, "close", None)):
            self.env.close()
        return 0.0


def _action_class(cls: type) -> type:
    """The Action class of an OpenEnv environment: its `step`'s annotation."""
    import typing

    from openenv.core.env_server.types import Action

    hint = typing.get_type_hints(cls.step).get("action")
    if not (isinstance(hint, type) and issubclass(hint, Action)):
        raise ValueError(f"{cls.__name__}.step does not annotate its action with an Action subclass (got {hint!r})")
    return hint


# ---- verifiers


_HUBS: dict[tuple[str, str], VerifiersHub] = {}


def verifiers_hub(name: str, kwargs_json: str, key: str) -> VerifiersHub:
    """The loaded environment `name` with the `[env]` block `kwargs_json`, once per process (the prompt sources and
    `rl.environment` share it); a ConfigError naming `key`."""
    hub = _HUBS.get((name, kwargs_json))
    if hub is None:
        hub = _HUBS[name, kwargs_json] = VerifiersHub(name, json.loads(kwargs_json), key)
    return hub


class VerifiersHub:
    """A verifiers environment loaded once: its `Env` (turn logic), its taskset (the prompts) and task type."""

    def __init__(self, name: str, kwargs: Mapping[str, Any], key: str) -> None:
        vf = require("verifiers", key)
        self.vf, self.name = vf, name
        taskset_id = name
        if name.endswith(".py"):  # a file: its module, registered under a name verifiers imports (lowercase)
            module = _user_module(key, name, Path("."))
            taskset_id = module.__name__.lower()
            sys.modules[taskset_id] = module
        block = dict(kwargs)
        taskset = dict(block.pop("taskset", None) or {})
        try:
            self.env = vf.load_environment(vf.resolve_env_config({**block, "taskset": {**taskset, "id": taskset_id}}))
        except Exception as exc:  # noqa: BLE001 - verifiers' own complaint, named
            raise ConfigError(f"{key}: verifiers:{name}: {type(exc).__name__}: {exc}") from None
        self.task_cls = type(self.env.taskset).task_type()

    def rows(self, skip: int = 0, take: int | None = None) -> list[dict[str, Any]]:
        """The taskset's tasks (a view: `skip`, `take`) as prompt rows: the system prompt and prompt as messages, the
        task's data (`VERIFIERS_TASK`) and its `answer` where it has one."""
        tasks = self.env.taskset.skip(skip) if skip else self.env.taskset
        rows = []
        for task in tasks.take(take) if take is not None else tasks:
            data = task.data
            messages = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
            if isinstance(data.prompt, str):
                messages.append({"role": "user", "content": data.prompt})
            elif data.prompt:
                messages += [m.model_dump(mode="json", exclude_none=True) for m in data.prompt]
            row = {"messages": messages, VERIFIERS_TASK: data.model_dump(mode="json")}
            if getattr(data, "answer", None) is not None:
                row["answer"] = str(data.answer)
            rows.append(row)
        return rows

    def task(self, row: Mapping[str, Any]) -> Any:
        if VERIFIERS_TASK not in row:
            raise ValueError(f"the row has no {VERIFIERS_TASK!r} column: its prompts come from data.train_path: "
                             f"verifiers:{self.name}")  # fmt: skip
        data = self.task_cls.data_type().model_validate(row[VERIFIERS_TASK])
        return self.task_cls(data, self.env.taskset.config.task)


class _Seat:
    """The policy in one of the environment's agent seats (an `Agents` member): `interaction(task)` turn by turn,
    `run(task)` one turn."""

    def __init__(self, episode: VerifiersEpisode, name: str) -> None:
        self.episode, self.name, self.trainable = episode, name, True

    @property
    def interaction(self) -> Any:
        import contextlib

        @contextlib.asynccontextmanager
        async def interaction(task: Any, **_: Any) -> Any:
            yield self.episode.open(self, task)
            await self.episode.close_trace()  # not when the body raised: the episode fails

        return interaction

    async def run(self, task: Any, **_: Any) -> Any:
        async with self.interaction(task) as chat:
            await chat.turn()
        return self.episode.trace


class _Chat:
    """`Interaction` of the policy's seat: each `turn(message)` is one model turn of the episode."""

    def __init__(self, episode: VerifiersEpisode) -> None:
        self.episode = episode

    @property
    def trace(self) -> Any:
        return self.episode.trace

    async def turn(self, message: Any = None) -> Any:
        return await self.episode.model_turn(message)


class VerifiersEpisode:
    """One episode of a verifiers environment (see the module docstring): its `Env.run` runs as a coroutine on an
    event loop of its own, stepped to each model turn it awaits."""

    def __init__(self, hub: VerifiersHub) -> None:
        self.hub, self.vf = hub, hub.vf
        self.loop = asyncio.new_event_loop()
        self.trace: Any = None
        self.seat: _Seat | None = None
        self.task: Any = None
        self.wanted = asyncio.Event()  # the environment awaits a model turn after the user message `message`
        self.message = ""
        self.reply: asyncio.Future | None = None  # the model's text for it (None: the episode is over)
        self.ended = False  # no more model turns: later turns come back terminated
        self.runner: asyncio.Task | None = None

    # the environment's side (coroutines on self.loop)

    def open(self, seat: _Seat, task: Any) -> _Chat:
        if (self.seat is not None and self.seat is not seat) or (self.trace is not None and self.trace.is_completed):
            raise RuntimeError(f"the environment runs a second agent ({seat.name}); one seat is the policy's")
        if not seat.trainable:
            raise RuntimeError(f"the environment's agent {seat.name!r} is not trainable (a model of its own), "
                               "which the policy cannot play")  # fmt: skip
        vf = self.vf
        self.seat, self.task = seat, task
        self.trace = vf.Trace(
            task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
            agent=vf.AgentInfo(config=vf.AgentConfig(), name=seat.name),
        )
        data = task.data
        if data.system_prompt:
            self._node(vf.SystemMessage(content=data.system_prompt))
        if isinstance(data.prompt, str):
            self._node(vf.UserMessage(content=data.prompt))
        for message in data.prompt if isinstance(data.prompt, list) else []:
            self._node(message)
        return _Chat(self)

    def _node(self, message: Any, sampled: bool = False) -> None:
        parent = len(self.trace.nodes) - 1 if self.trace.nodes else None
        self.trace.nodes.append(self.vf.MessageNode(parent=parent, message=message, sampled=sampled))

    async def model_turn(self, message: Any) -> Any:
        from verifiers.v1.session import call_hook, hook_boundary

        vf = self.vf
        for stop in self.task.hooks("stop") if not self.ended else ():  # the task's @vf.stop on the trace
            if hook_boundary(stop, allow_trace=True) is vf.Trace and await call_hook(stop, {vf.Trace: self.trace}):
                self.trace.stop(stop.__name__)
                self.ended = True
        if self.ended:
            return vf.Segment([], terminated=True)
        if message is None and any(node.sampled for node in self.trace.nodes):
            raise RuntimeError("a turn without a user message after the first (the model would answer itself)")
        text = message if isinstance(message, str) or message is None else _message_text(message)
        if text is not None:
            self._node(vf.UserMessage(content=text))
        self.message = text or ""
        self.reply = self.loop.create_future()
        self.wanted.set()
        reply = await self.reply
        if reply is None:
            self.ended = True
            return vf.Segment([], terminated=True)
        answer = vf.AssistantMessage(content=reply)
        self._node(answer, sampled=True)
        return vf.Segment([answer])

    async def close_trace(self) -> None:
        """The interaction's end: the trace completed and scored by the task (as a verifiers rollout closes)."""
        self.ended = True
        if not self.trace.is_completed:
            self.trace.is_completed = self.trace.ok = True
            await self.task.score(self.trace)

    async def _run(self, task: Any) -> float:
        vf, env = self.vf, self.hub.env
        agents = vf.Agents(env.config, lambda name, config: _Seat(self, name))
        await env.setup(agents)
        await env.run(task, agents)
        if self.trace is None:
            raise RuntimeError(f"{type(env).__name__}.run() ran no agent")
        episode = vf.Episode(env=vf.EnvInfo(id=env.config.env_id), task=self.trace.task, traces=[self.trace])
        await env.finalize(task, episode)
        reward = float(self.trace.reward)
        if not math.isfinite(reward):
            raise ValueError(f"the task's rewards sum to {reward}")
        return reward

    async def _next(self) -> None:
        """Run the environment until it asks for a model turn or ends."""
        assert self.runner is not None
        wanted = asyncio.ensure_future(self.wanted.wait())
        await asyncio.wait({self.runner, wanted}, return_when=asyncio.FIRST_COMPLETED)
        wanted.cancel()
        await asyncio.gather(wanted, return_exceptions=True)

    def _advance(self) -> tuple[str, float, bool]:
        self.wanted.clear()
        self.loop.run_until_complete(self._next())
        if self.wanted.is_set():
            return self.message, 0.0, False
        assert self.runner is not None and self.runner.done()
        try:
            return "", self.runner.result(), True
        finally:
            self.loop.close()

    # the episode's side (our contract)

    def reset(self, row: Mapping[str, Any]) -> str:
        self.runner = self.loop.create_task(self._run(self.hub.task(row)))
        observation, _, done = self._advance()
        if done:
            raise RuntimeError("the environment ended before the model's first turn")
        return observation

    def step(self, text: str) -> tuple[str, float, bool]:
        assert self.reply is not None
        self.reply.set_result(text)
        return self._advance()

    def close(self, text: str | None) -> float:
        """The episode ended at a limit: `text` (the model's last turn, cut at rl.max_new_tokens; None: none) joins the
        trace, the environment's pending turn comes back terminated (as a verifiers limit), and it runs to its end."""
        if self.loop.is_closed():
            return 0.0
        if text is not None:
            self._node(self.vf.AssistantMessage(content=text), sampled=True)
        self.ended = True
        if self.reply is not None and not self.reply.done():
            self.reply.set_result(None)
        observation, reward, done = self._advance()
        if not done:
            raise RuntimeError("the environment asked for another turn after its turns were terminated")
        return reward


def _message_text(messages: Any) -> str:
    """A turn given as messages, as the text of one user turn."""
    parts = []
    for message in messages:
        content = message.get("content") if isinstance(message, Mapping) else getattr(message, "content", "")
        if not isinstance(content, str):
            raise ValueError(f"a turn's message {message!r} is not text")
        parts.append(content)
    return "\n\n".join(parts)
