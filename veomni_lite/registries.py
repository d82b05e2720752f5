"""Registries of algorithms chosen by name in a config: advantage estimators and policy losses (`veomni_lite.rl`),
pair losses (`veomni_lite.preference`), router losses (MoE) and importance-sampling corrections.

A `Registry` maps a config name to an `Entry`: the function, the metric names it logs, whether it needs a frozen
reference or a critic, and its hyperparameters (the config fields it reads, with their defaults). Adding an algorithm
is one decorated function and its test:

    @register_policy_loss("my_clip", metrics=("rl/clip_fraction",), hyperparameters={"clip_low": 0.2})
    def my_clip(...): ...

`Registry.get(name, at)` is the lookup every config check goes through: an unknown name is a `ConfigError` naming the
key `at`, the closest known name and every known one.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from veomni_lite.config_sections import ConfigError

__all__ = ["Entry", "Registry", "closest"]


def closest(name: str, known: Iterable[str], cutoff: float = 0.6) -> str | None:
    """The name in `known` closest to a mistyped `name` (difflib's ratio at least `cutoff`), else None."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=cutoff)
    return close[0] if close else None


@dataclass(frozen=True)
class Entry:
    """One registered algorithm: `fn` and what the trainer must know about it before running it."""

    name: str
    fn: Callable[..., Any]
    metrics: tuple[str, ...] = ()
    """The metric names it records (the trainer declares them up front, so every rank packs the same keys)."""
    needs_reference: bool = False
    """It reads the frozen reference model's log-probabilities."""
    needs_critic: bool = False
    """It reads a critic's values."""
    hyperparameters: Mapping[str, Any] = field(default_factory=dict)
    """The config fields it reads, with their defaults."""
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Anything else a kind of registry keeps per entry."""

    def read(self, section: Any) -> dict[str, Any]:
        """Its hyperparameters' values in a config `section` (each the section's attribute of the same name)."""
        return {name: getattr(section, name) for name in self.hyperparameters}


class Registry:
    """Names -> `Entry` for one kind of algorithm (`kind` names it in errors, e.g. "policy loss")."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, Entry] = {}

    def register(
        self,
        name: str,
        *,
        metrics: Iterable[str] = (),
        needs_reference: bool = False,
        needs_critic: bool = False,
        hyperparameters: Mapping[str, Any] | None = None,
        **extra: Any,
    ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """A decorator registering its function under `name` (a second registration of a name is an error)."""

        def add(fn: Callable[..., Any]) -> Callable[..., Any]:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._entries[name] = Entry(
                name, fn, tuple(metrics), needs_reference, needs_critic, dict(hyperparameters or {}), dict(extra)
            )
            return fn

        return add

    def get(self, name: str, at: str) -> Entry:
        """The entry named `name`; else a ConfigError naming the config key `at`, the closest name and all names."""
        if name in self._entries:
            return self._entries[name]
        guess = closest(str(name), self._entries)
        hint = f" (did you mean `{guess}`?)" if guess else ""
        raise ConfigError(f"{at}: unknown {self.kind} {name!r}{hint}; expected one of {self.names()}")

    def names(self) -> list[str]:
        """The registered names, in registration order."""
        return list(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries
