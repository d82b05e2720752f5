"""The `rl.vllm` section (`VLLMSettings`: which servers, how to reach them, the limits) and the engine's one error
(`EngineError`). Reaching the servers: `url` (one server) or `urls` (several), servers the user started
(OpenAI-compatible, with `VLLM_SERVER_DEV_MODE=1` for the weight routes), or `launch: N` (`true` = 1): rank 0 starts N
servers itself (`server.VLLMServer`). `api_key_env` names an environment variable holding a key sent with every request
(`Authorization: Bearer`), and given to launched servers (`VLLM_API_KEY`, vLLM's `--api-key`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from veomni_lite.config import build_section

NAME = "vLLM engine"


class EngineError(RuntimeError):
    """The rollout engine failed (did not start, died, answered with an error or not within the timeout, or holds
    other weights than the trainer's); the message names the engine, the server and the request."""


@dataclass
class VLLMSettings:
    """The `rl.vllm` section (read by the config loader; checked by `VLLMSettings.parse`). Exactly one of `url`,
    `urls` and `launch` says which servers the rollouts go to."""

    url: str = ""
    """A running server's base URL (e.g. http://10.0.0.5:8000), started by the user in dev mode."""
    urls: list[str] = field(default_factory=list)
    """Several running servers' base URLs; a rollout batch's samples are spread over them, every one synced."""
    launch: bool | int = 0
    """Rank 0 starts this many servers itself, each on 127.0.0.1 and a port of its own (`true` = 1)."""
    api_key_env: str = ""
    """The name of an environment variable (read on rank 0) holding an API key sent with every request as
    `Authorization: Bearer <key>`, and given to launched servers (vLLM's `--api-key`, as `VLLM_API_KEY`). vLLM checks
    it on its /v1 routes only, not on the dev-mode weight routes (docs/vllm.md, Security). Empty: no key."""
    python: str = ".venv-vllm/bin/python"
    """The interpreter of an environment with vLLM (`make vllm-env`), for `launch`."""
    sync_dir: str = "/dev/shm/veomni_lite_vllm"
    """Where rank 0 writes the weights for the servers to reload (a directory per run under it, removed at close); every
    server must read the same path (same node, or a shared file system)."""
    start_timeout_s: float = 300.0
    """`launch`: seconds for the servers to answer /health."""
    request_timeout_s: float = 600.0
    """Every HTTP call's limit (a whole rollout batch's generation included)."""
    probe_tolerance: float = 0.1
    """Largest mean |engine - trainer| log-probability of the probe's tokens at a server's first sync: the server
    serves the trainer's model at a precision near the trainer's (another model differs by nats; a bfloat16 engine
    measured up to 0.013 against a float32 trainer, float32 ~2e-7). Later syncs are checked relative to the previous
    weights, with no tolerance to set (`SyncCheck`)."""
    server_args: list[str] = field(default_factory=list)
    """`launch`: more arguments for each server (e.g. ["--dtype", "float32", "--max-model-len", "4096"])."""
    max_concurrency: int = 256
    """Requests (samples) in flight at once per server."""
    max_restarts: int = 3
    """`launch`: how many times over the run rank 0 relaunches a launched server that died after it served (all servers
    together); a relaunched server is synced and rejoins. 0: a dead launched server is not relaunched. With several
    servers a dead one's requests go to the others either way (docs/vllm.md, Faults)."""

    @classmethod
    def parse(cls, section: VLLMSettings | Mapping[str, Any] | None) -> VLLMSettings:
        """`rl.vllm` as the config loader read it (or a mapping, read here the same way: `build_section`), checked;
        ValueError (a ConfigError where a key is unknown or of the wrong type) naming the key."""
        settings = section if isinstance(section, cls) else build_section(cls, section, "rl.vllm")
        launch = settings.launch
        if isinstance(launch, bool):
            settings.launch = int(launch)
        elif not isinstance(launch, int) or launch < 0:
            raise ValueError(f"rl.vllm.launch: true or a count of servers to start (>= 1), got {launch!r}")
        if sum((bool(settings.url), bool(settings.urls), bool(settings.launch))) != 1:
            raise ValueError(
                "rl.vllm: give exactly one of url (a running server), urls (several running servers) and launch "
                "(true, or how many servers rank 0 starts)"
            )
        for key, url in [("url", settings.url)] * bool(settings.url) + [("urls", u) for u in settings.urls]:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"rl.vllm.{key}: must start with http:// or https://, got {url!r}")
        if len(set(settings.server_urls)) != len(settings.server_urls):
            raise ValueError(f"rl.vllm.urls: a server is listed twice: {settings.urls}")
        if settings.api_key_env and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", str(settings.api_key_env)):
            raise ValueError(f"rl.vllm.api_key_env: the name of an environment variable, got {settings.api_key_env!r}")
        for key in ("start_timeout_s", "request_timeout_s", "probe_tolerance", "max_concurrency"):
            if not getattr(settings, key) > 0:
                raise ValueError(f"rl.vllm.{key}: must be > 0, got {getattr(settings, key)}")
        if isinstance(settings.max_restarts, bool) or not settings.max_restarts >= 0:
            raise ValueError(f"rl.vllm.max_restarts: must be an integer >= 0, got {settings.max_restarts!r}")
        if not isinstance(settings.server_args, list) or not all(isinstance(a, str) for a in settings.server_args):
            raise ValueError("rl.vllm.server_args: must be a list of strings")
        return settings

    @property
    def server_urls(self) -> list[str]:
        """The user-started servers' base URLs (`url` or `urls`, without a trailing slash); [] with `launch`."""
        return [url.rstrip("/") for url in ([self.url] if self.url else self.urls)]

    def api_key(self) -> str:
        """The key `api_key_env` names ("" when none is named); EngineError when the variable is unset or empty."""
        if not self.api_key_env:
            return ""
        key = os.environ.get(self.api_key_env, "")
        if not key:
            raise EngineError(
                f"{NAME}: rl.vllm.api_key_env names the environment variable {self.api_key_env}, which is unset or "
                f"empty on rank 0"
            )
        return key
