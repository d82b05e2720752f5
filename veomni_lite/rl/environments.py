"""Environments an RL episode talks to (`rl.environment`): loaded from the user's file, one instance per episode.

Contract: `rl.environment` is `path/to/file.py:Class` or `{class: path/to/file.py:Class, kwargs: {...}}` (the file
executed like a reward file, a relative path against the config's directory). The class is instantiated once per
episode, `Class(**kwargs)`, then `reset(row) -> str` (row: the prompt row's columns, its `answer` among them) gives
the first observation (appended to the prompt as a user turn; "" or None: none), and after each model turn without a
tool call `step(text) -> (observation, reward, done)`: the reward (a finite number) adds to the episode's, the
observation becomes the next user turn unless `done`. Optionally `close(text) -> reward` (a finite number or None)
when the episode ends at a limit (`rl.max_turns`, `rl.max_episode_tokens`, a turn cut at `rl.max_new_tokens`) before
the environment said done: `text` is the model's last turn when the environment has not seen it (cut), else None;
its reward adds to the episode's. Any exception, or a return of the wrong shape, is an `EpisodeError` naming the
class, its file, the row and the turn; the trainer agrees on it (`agree`), so every rank raises it. A bad entry
(unknown key, missing file or class) is a `ConfigError` naming `rl.environment`.

`verifiers:...` and `openenv:...` name an environment from those hubs, adapted to this contract
(`veomni_lite.rl.hubs`).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from veomni_lite.config import ConfigError, config_entry
from veomni_lite.data.checks import DataError

__all__ = ["EnvironmentSpec", "EpisodeError", "load_environment"]

_KEYS = ("class", "kwargs")


class EpisodeError(DataError):
    """An environment failed (or returned something else than its contract) in an episode."""


@dataclass(frozen=True)
class EnvironmentSpec:
    """The environment class, its keyword arguments and `where` (file:Class)."""

    cls: type
    kwargs: dict[str, Any] = field(default_factory=dict)
    where: str = ""

    def _error(self, row: str, turn: int, problem: str) -> EpisodeError:
        return EpisodeError(f"environment {self.where} ({self.cls.__name__}), {row}, turn {turn}: {problem}")

    def make(self, columns: Mapping[str, Any], row: str) -> tuple[Any, str]:
        """A new instance and its first observation (`reset(columns)`), or an EpisodeError."""
        try:
            env = self.cls(**self.kwargs)
            first = env.reset(dict(columns))
        except Exception as exc:  # noqa: BLE001 - the user's code: a named error
            raise self._error(row, 0, f"reset raised {type(exc).__name__}: {exc}") from exc
        if first is not None and not isinstance(first, str):
            raise self._error(row, 0, f"reset must return the first observation as text (or None), got {first!r}")
        return env, first or ""

    def step(self, env: Any, text: str, row: str, turn: int) -> tuple[str, float, bool]:
        """`env.step(text)` checked: (observation, reward, done), or an EpisodeError."""
        try:
            out = env.step(text)
        except Exception as exc:  # noqa: BLE001
            raise self._error(row, turn, f"step raised {type(exc).__name__}: {exc}") from exc
        if not isinstance(out, tuple) or len(out) != 3:
            raise self._error(row, turn, f"step must return (observation, reward, done), got {out!r}")
        observation, reward, done = out
        if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or not math.isfinite(reward):
            raise self._error(row, turn, f"step's reward must be a finite number, got {reward!r}")
        if observation is not None and not isinstance(observation, str):
            raise self._error(row, turn, f"step's observation must be text (or None), got {observation!r}")
        return observation or "", float(reward), bool(done)

    def close(self, env: Any, text: str | None, row: str, turn: int) -> float:
        """`env.close(text)` where the class has one (see the module docstring): its reward (0.0 without), or an
        EpisodeError."""
        if not callable(getattr(env, "close", None)):
            return 0.0
        try:
            reward = env.close(text)
        except Exception as exc:  # noqa: BLE001
            raise self._error(row, turn, f"close raised {type(exc).__name__}: {exc}") from exc
        if reward is None:
            return 0.0
        if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or not math.isfinite(reward):
            raise self._error(row, turn, f"close's reward must be a finite number (or None), got {reward!r}")
        return float(reward)


def load_environment(spec: Any, base_dir: str | Path = ".", key: str = "rl.environment") -> EnvironmentSpec | None:
    """The `EnvironmentSpec` of `rl.environment` ("" or None: no environment); a ConfigError naming `key`."""
    from veomni_lite.rl.hubs import ENVIRONMENT_KINDS, hub_environment, split_kind
    from veomni_lite.rl.rewards import user_object

    if not spec:
        return None
    spec = config_entry(key, spec, "class", _KEYS, "an environment")
    target, kwargs = spec["class"], spec.get("kwargs", {}) or {}
    if not isinstance(kwargs, Mapping):
        raise ConfigError(f"{key}.kwargs: expected a mapping, got {kwargs!r}")
    hub = split_kind(target, ENVIRONMENT_KINDS)
    if hub is not None:
        return EnvironmentSpec(*hub_environment(*hub, kwargs, key))
    modules: dict[Path, ModuleType] = {}
    cls, where = user_object(f"{key}.class", target, Path(base_dir), modules)
    if (
        not isinstance(cls, type)
        or not callable(getattr(cls, "reset", None))
        or not callable(getattr(cls, "step", None))
    ):
        raise ConfigError(f"{key}.class: {where} is not a class with reset(row) and step(text) methods")
    return EnvironmentSpec(cls, dict(kwargs), where)
