"""Rollouts on vLLM servers (`rl.engine: vllm`), over HTTP with the standard library only: the trainer never imports
vllm (its CPU build pins a transformers older than ours), so the servers run from another environment.

Reaching them (`VLLMSettings`, the `rl.vllm` section): `url` (one server) or `urls` (several), servers the user started
(OpenAI-compatible, with `VLLM_SERVER_DEV_MODE=1` for the weight routes), or `launch: N` (`true` = 1): rank 0 starts N
servers (`VLLMServer`, `python -m vllm.entrypoints.openai.api_server` with the interpreter `python`) from the run's
`model.pretrained_dir`, each on 127.0.0.1 and a free port, in dev mode, in a session of its own, and ends each one's
whole process group at `close`, when it does not answer /health within `start_timeout_s`, at interpreter exit, when the
trainer process dies, and when the server itself ends (`vllm_boot`: a watchdog in the group). For a text model a server
never tokenizes (`--skip-tokenizer-init`: ids in, ids out); for a vision-language model it renders prompts itself
(below). It ignores the model directory's generation config. `api_key_env` names an environment variable holding a key
sent with every request (`Authorization: Bearer`), and given to launched servers (`VLLM_API_KEY`, vLLM's `--api-key`).

Only rank 0 talks to the servers; `generate` and `sync_weights` are collective over the trainer's control group (every
rank calls them, with its own requests): every rank's requests are gathered on rank 0, sent as one wave of concurrent
HTTP requests spread over the servers (`spread`: contiguous shares of the samples, so a prompt's samples mostly share a
server and its prefix cache), and the rollouts broadcast back. Why rank 0 alone: a launched server listens on loopback
of rank 0's node, which other nodes cannot reach, and one wave holding the whole rollout batch fills vLLM's batches
better than world-size smaller ones. A failure on rank 0 (no answer within `request_timeout_s`, an HTTP error, a
launched server gone) is the same `EngineError` on every rank, naming the engine, the server's URL and the request
(`agree`). While rank 0 waits on the servers, every rank joins a small all-reduce each second, so no collective waits
on rank 0 for long (`parallel.collective_timeout_s` need not cover a server's start or a batch's generation).

Sampling: one `/v1/completions` request per sample: the prompt's ids, `n` 1 and the sample's own `seed` (so a sample
is a function of its prompt, seed, weights and settings, not of its batch or its server), temperature, top_p, top_k,
`max_tokens`, `stop_token_ids` with `ignore_eos` (only the trainer's end-of-turn ids end a response, kept in it),
`logprobs` 0 with `return_token_ids`. Greedy: temperature 0. vLLM's draws differ from the embedded engine's for the
same seed.

Vision-language prompts: vLLM's completions route takes no images beside token ids, so a request with images goes to
`/v1/chat/completions` with the same settings and the prompt's chat fields (`RolloutRequest.chat`: its messages, each
image a PNG data URL of the trainer's decoded pixels, and the run's chat template when it overrides the model's; a
launched server trusts a request's template). The server applies the template and its image processor; the prompt ids
it returns must equal the trainer's rendering (`prompt_ids`, placeholders expanded), or the request is an EngineError
naming the first difference (another chat template, or an image processor that sizes images otherwise).

Log-probabilities: a launched server runs with `--logprobs-mode processed_logprobs`, the sampled token's log-softmax
after temperature and after top-k/top-p. Without top-k/top-p that is exactly the trainer's quantity, log softmax(logits
/ T) (the embedded engine's); with them, vLLM's is of the filtered distribution, renormalized: for a kept token it is
the trainer's minus log(the kept mass), so `rl/logprob_diff` grows by that mass and the truncated correction
(`rl.importance_sampling`) sees it. vLLM's default `raw_logprobs` is log softmax(logits) at temperature 1: a user's
server should be started with `--logprobs-mode processed_logprobs` (the probe below cannot tell: prompt
log-probabilities are raw in every mode).

Weight sync (`sync_weights`, collective): rank 0 writes the full weights (transformers' names, tied weights under each
name) as `model.safetensors`, with the model's `config.json`, into `rl.vllm.sync_dir`/<run>/, and POSTs to every
server (at once) `/collective_rpc` `reload_weights` with that directory, then `/reset_prefix_cache` (a cached prompt
would otherwise reuse results of the old weights) and, for a vision-language model, `/reset_encoder_cache` (the
images' vision-encoder outputs are of the old weights too; without the reset vLLM 0.32's engine dies, "Encoder cache
miss", on the next wave of images it has seen). Then each server's sync check (`SyncCheck`) on its prompt
log-probabilities of a fixed token sequence (`probe_ids`) against the trainer's (`reference`, a collective forward of
the trainer's model on every rank); a failed check is an `EngineError` on every rank (the engine does not serve the
trainer's weights).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from veomni_lite.distributed.collectives import agree, all_gather_objects, all_reduce, group_size
from veomni_lite.engines import vllm_boot
from veomni_lite.engines.base import Rollout, RolloutEngine, RolloutRequest, SamplingSettings

logger = logging.getLogger(__name__)

__all__ = ["EngineError", "SyncCheck", "VLLMEngine", "VLLMServer", "VLLMSettings", "spread"]

NAME = "vLLM engine"
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
# Variables torchrun sets for the trainer's ranks, which vLLM's own process setup must not read as its own.
_TORCHRUN_ENV = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
    "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE",
)  # fmt: skip


class EngineError(RuntimeError):
    """The rollout engine failed (did not start, died, answered with an error or not within the timeout, or holds
    other weights than the trainer's); the message names the engine, the server and the request."""


@dataclass
class VLLMSettings:
    """The `rl.vllm` section (a mapping in the config; see `VLLMSettings.parse`). Exactly one of `url`, `urls` and
    `launch` says which servers the rollouts go to."""

    url: str = ""
    """A running server's base URL (e.g. http://10.0.0.5:8000), started by the user in dev mode."""
    urls: list[str] = field(default_factory=list)
    """Several running servers' base URLs; a rollout batch's samples are spread over them, every one synced."""
    launch: int = 0
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

    @classmethod
    def parse(cls, section: Mapping[str, Any]) -> VLLMSettings:
        """The settings of `rl.vllm`; ValueError naming an unknown key or a bad value."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(section) - known)
        if unknown:
            raise ValueError(f"rl.vllm: unknown key(s) {unknown}; known: {sorted(known)}")
        settings = cls(**dict(section))
        launch = settings.launch
        if isinstance(launch, bool):
            settings.launch = int(launch)
        elif not isinstance(launch, int) or launch < 0:
            raise ValueError(f"rl.vllm.launch: true or a count of servers to start (>= 1), got {launch!r}")
        if not isinstance(settings.urls, list) or not all(isinstance(u, str) and u for u in settings.urls):
            raise ValueError(f"rl.vllm.urls: must be a list of URLs, got {settings.urls!r}")
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


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def cpu_server_args(server_args: Sequence[str]) -> list[str]:
    """What a server on this machine's CPUs needs (none where CUDA is there): vLLM 0.32's CPU build kills its engine
    ("CPU Generator does not use offset") when a seeded request's prompt is prefilled in chunks, which a wave of
    requests longer than its token budget causes, so chunked prefill is off unless `server_args` say otherwise."""
    if torch.cuda.is_available() or any("chunked-prefill" in arg for arg in server_args):
        return []
    return ["--no-enable-chunked-prefill"]


def spread(count: int, servers: int) -> list[range]:
    """Samples 0..count-1 in `servers` contiguous shares whose sizes differ by at most one (the first ones larger):
    a prompt's samples, adjacent in a wave, mostly go to one server, which computes their prompt once (prefix cache)."""
    base, extra = divmod(count, servers)
    bounds = [0]
    for share in range(servers):
        bounds.append(bounds[-1] + base + (share < extra))
    return [range(bounds[k], bounds[k + 1]) for k in range(servers)]


class VLLMServer:
    """A vLLM OpenAI-compatible server this process starts on 127.0.0.1 (see the module docstring) and stops, with
    every process it starts: they share a process group of their own (`vllm_boot`), whose id is `pid`. Build it on a
    thread that lives as long as the server: Linux's parent-death signal, which ends the server with the trainer,
    follows the creating thread."""

    MODULE = SERVER_MODULE
    """What the server process runs (`python -m MODULE`); tests put a stand-in here."""

    def __init__(
        self,
        python: str,
        model_dir: str,
        log_path: str | Path,
        server_args: Sequence[str] = (),
        port: int = 0,
        renders_prompts: bool = False,
        api_key: str = "",
    ) -> None:
        """`renders_prompts`: the server loads the tokenizer and processor and trusts a request's chat template (VL).
        `api_key`: the key the server requires on its /v1 routes (vLLM's `--api-key`, passed as `VLLM_API_KEY` so it
        is not on a command line other users can read); "": none."""
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.api_key = api_key
        self._code: int | None = None
        self._stopped = False
        args = [
            "--model", str(model_dir), "--host", "127.0.0.1", "--port", str(self.port), "--enforce-eager",
            "--trust-request-chat-template" if renders_prompts else "--skip-tokenizer-init", "--generation-config",
            "vllm", "--logprobs-mode", "processed_logprobs", "--seed", "0", *cpu_server_args(server_args), *server_args,
        ]  # fmt: skip
        env = {key: value for key, value in os.environ.items() if key not in _TORCHRUN_ENV}
        env["VLLM_SERVER_DEV_MODE"] = "1"  # /collective_rpc and /reset_prefix_cache; never reachable off loopback
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on a CPU build (ignored on GPU)
        env.pop("VLLM_API_KEY", None)  # the key is the run's (rl.vllm.api_key_env) or none
        if api_key:
            env["VLLM_API_KEY"] = api_key
        if not Path(python).is_file():
            raise EngineError(f"{NAME}: rl.vllm.python {python!r} does not exist (make vllm-env builds .venv-vllm)")
        boot = [python, "-I", vllm_boot.__file__, str(os.getpid()), self.MODULE, *args]
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                boot, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True
            )
        self.pid = self.process.pid  # also the process group's id (a session of its own)
        atexit.register(self.stop)
        logger.info("%s: started pid %d on %s (log %s)", NAME, self.pid, self.url, self.log_path)

    def exited(self, wait_s: float = 0.0) -> int | None:
        """The server's exit code (-N: killed by signal N), or None while it runs, waiting up to `wait_s` seconds for
        it to end. The server is not reaped before `stop`, so its pid keeps naming its process group."""
        deadline = time.monotonic() + wait_s
        while self._code is None:
            self._code = self._status()
            if self._code is not None or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        return self._code

    def _status(self) -> int | None:
        """The exit code if the server has exited, seen without reaping it (waitid WNOWAIT)."""
        if not hasattr(os, "waitid"):  # pragma: no cover - no waitid (macOS): poll, which reaps
            return self.process.poll()
        try:
            info = os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:  # reaped already
            return self.process.poll()
        if info is None:
            return None
        return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def wait_ready(self, timeout_s: float, started: float) -> None:
        """Until GET /health answers 200; EngineError (server stopped) when it exits or `timeout_s` after
        `started` (a `time.monotonic()`) passes."""
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        while True:
            code = self.exited()
            if code is not None:
                self.stop()
                raise EngineError(
                    f"{NAME} (launched, pid {self.pid}) exited with code {code} before it was ready; the end of its "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            with (
                contextlib.suppress(OSError, urllib.error.URLError),
                urllib.request.urlopen(
                    urllib.request.Request(self.url + "/health", headers=headers), timeout=5
                ) as answer,
            ):
                if answer.status == 200:
                    return
            if time.monotonic() - started > timeout_s:
                self.stop()
                raise EngineError(
                    f"{NAME} (launched, pid {self.pid}) did not answer GET {self.url}/health within "
                    f"rl.vllm.start_timeout_s = {timeout_s:g} s; stopped it. The end of its log {self.log_path}:\n"
                    f"{self.log_tail()}"
                )
            time.sleep(0.5)

    def terminate(self) -> None:
        """Ask the server's whole process group to shut down (SIGTERM), without waiting; `stop` finishes."""
        if not self._stopped:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGTERM)

    def stop(self) -> None:
        """End the server's whole process group (`vllm_boot.end_group`: SIGTERM, up to 10 s, SIGKILL), whether the
        server runs or has exited, then reap it (idempotent)."""
        if self._stopped:
            return
        vllm_boot.end_group(self.pid)  # the server is not reaped yet: its pid still names its group
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=30)
        self._code = self.process.returncode if self._code is None else self._code
        self._stopped = True
        atexit.unregister(self.stop)


class SyncCheck:
    """Whether one server serves the trainer's weights after a sync, from its log-probabilities of the probe
    (`engine`) against the trainer's (`trainer`), in a way that holds whatever the engine's precision: a bfloat16
    engine sits 1e-3 to 3e-2 from a float32 trainer, a gap that grows as the weights train, so no fixed tolerance on it
    holds over a long run.

    The first sync: mean |engine - trainer| <= `tolerance` (the server serves the trainer's model). Every later sync
    is compared with an earlier one, its reference: a sync that applies moves the engine's values as it moves the
    trainer's, up to the engine's numeric noise; a skipped one leaves them where they were. So `followed`, the
    projection of the engine's change since the reference onto the trainer's (<dE, dT> / <dT, dT>), is 1 up to
    rms(noise change) / rms(dT) for a sync that applied, and 0 for a skipped one. The check decides only when the
    trainer moved by rms(dT) > `FACTOR` x `noise` (the largest rms |engine - trainer| of a sync that decided), and then
    refuses |followed - 1| > 0.5: a sync that applied is refused only if the engine's noise changed, along the
    trainer's change, by more than twice its largest value so far. The reference is the previous sync when the trainer
    moved far enough since it, else the last sync that decided, so that several small moves add up: a reload that stops
    applying is caught at the first sync whose trainer has moved far enough from the last sync that applied. (A single
    sync skipped amid syncs that apply can pass when the trainer moved too little to tell, its rollouts then sampled by
    the previous weights, within the noise.)"""

    FACTOR = 4.0
    FLOOR = 1e-6  # the noise floor of a float32 engine (measured ~2e-7)

    def __init__(self, tolerance: float) -> None:
        self.tolerance = tolerance
        self.previous: tuple[int, torch.Tensor, torch.Tensor] | None = None  # version, engine, trainer
        self.anchor: tuple[int, torch.Tensor, torch.Tensor] | None = None  # the last sync that decided
        self.noise = 0.0
        self.gap = float("nan")
        """The last sync's mean |engine - trainer|."""
        self.followed: float | None = None
        """The last sync's `followed` (None: it did not decide)."""

    def __call__(self, version: int, engine: Sequence[float], trainer: Sequence[float]) -> str | None:
        """A sync of `version`: None when the server serves the trainer's weights, else what is wrong."""
        if len(engine) != len(trainer):
            return f"the engine gave {len(engine)} probe log-probabilities, the trainer {len(trainer)}"
        e, t = torch.tensor(engine, dtype=torch.float64), torch.tensor(trainer, dtype=torch.float64)
        self.gap, self.followed = (e - t).abs().mean().item(), None
        rms = _rms(e - t)
        if self.previous is None or self.anchor is None:
            if not self.gap <= self.tolerance:
                return (
                    f"at its first sync (version {version}), the engine's log-probabilities of the probe ({len(e)} "
                    f"tokens) differ from the trainer's by mean |diff| {self.gap:.3g} (max "
                    f"{(e - t).abs().max().item():.3g}) > rl.vllm.probe_tolerance {self.tolerance:g}: the engine does "
                    f"not serve the trainer's weights (another model, or a precision far from the trainer's)"
                )
            self.previous = self.anchor = (version, e, t)
            self.noise = rms
            return None
        for reference, e0, t0 in (self.previous, self.anchor):
            moved = _rms(t - t0)
            if moved > self.FACTOR * max(self.noise, self.FLOOR):
                self.followed = torch.dot(e - e0, t - t0).item() / torch.dot(t - t0, t - t0).item()
                if abs(self.followed - 1) > 0.5:
                    return (
                        f"after reloading the weights of version {version}, the engine's log-probabilities of the "
                        f"probe ({len(e)} tokens) changed by rms {_rms(e - e0):.3g} since version {reference}, the "
                        f"trainer's by rms {moved:.3g}: the engine followed {self.followed:.0%} of the trainer's "
                        f"change (a sync that applies follows 100%, up to the engine's numeric noise, rms "
                        f"{self.noise:.2g} so far): the engine does not serve the trainer's weights (a reload that did "
                        f"not apply)"
                    )
                self.anchor, self.noise = (version, e, t), max(self.noise, rms)
                break
        self.previous = (version, e, t)
        return None


def _rms(x: torch.Tensor) -> float:
    return x.pow(2).mean().sqrt().item()


@dataclass
class _Endpoint:
    """One server as rank 0 reaches it."""

    url: str
    server: VLLMServer | None
    check: SyncCheck
    model_name: str | None = None


class VLLMEngine(RolloutEngine):
    """Rollouts from vLLM servers (see the module docstring). Collective over `group`: every rank calls the
    constructor, `sync_weights`, `generate` and `finish_generate` alike; only group rank 0 talks to the servers.

    `reference(ids)`: the trainer's log-probabilities of ids[1:] (each given the ids before it, temperature 1) under
    its current weights, a collective every rank calls; `probe_ids`: the probe's tokens (a few dozen, text only);
    `log_path`: the first launched server's log (the k-th's adds `_k` to its stem); `renders_prompts`: the model takes
    images: a launched server renders prompts itself (`RolloutRequest.chat`), and a sync also resets the servers'
    encoder caches."""

    name = "vllm"

    def __init__(
        self,
        settings: VLLMSettings,
        model_dir: str,
        group: dist.ProcessGroup | None,
        reference: Callable[[list[int]], list[float]],
        probe_ids: Sequence[int],
        log_path: str | Path = "vllm_server.log",
        config_path: str | Path | None = None,
        renders_prompts: bool = False,
    ) -> None:
        self.settings = settings
        self.renders_prompts = renders_prompts
        self.group = group
        self.reference = reference
        self.probe_ids = list(probe_ids)
        if len(self.probe_ids) < 2:
            raise ValueError(f"VLLMEngine: the probe needs at least 2 tokens, got {len(self.probe_ids)}")
        self.leader = not (dist.is_available() and dist.is_initialized()) or dist.get_rank(group) == 0
        self.config_path = Path(config_path) if config_path else Path(model_dir) / "config.json"
        self.endpoints: list[_Endpoint] = []
        self.sync_path = Path(settings.sync_dir) / f"run-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.last_probe_diff = float("nan")
        """The last sync's largest mean |engine - trainer| over the servers."""
        self._headers = {"Content-Type": "application/json"}
        self._started = time.monotonic()
        self._closed = False
        self._pending: Future[Any] | None = None  # a started generation (rank 0), see start_generate
        problem = None
        if self.leader:
            try:
                key = settings.api_key()
                if key:
                    self._headers["Authorization"] = f"Bearer {key}"
                for url in settings.server_urls:
                    self.endpoints.append(_Endpoint(url, None, SyncCheck(settings.probe_tolerance)))
                log_path = Path(log_path)
                for k in range(settings.launch):
                    log = log_path if k == 0 else log_path.with_name(f"{log_path.stem}_{k}{log_path.suffix}")
                    server = VLLMServer(
                        settings.python, model_dir, log, settings.server_args, renders_prompts=renders_prompts,
                        api_key=key,
                    )  # fmt: skip
                    self.endpoints.append(_Endpoint(server.url, server, SyncCheck(settings.probe_tolerance)))
            except (EngineError, OSError) as exc:
                problem = exc
                self._stop_servers()
        agree(problem, EngineError, group, where=f"{NAME}: start: ")

    @property
    def servers(self) -> list[VLLMServer]:
        """The servers this engine launched (rank 0; [] elsewhere or with `url`/`urls`)."""
        return [endpoint.server for endpoint in self.endpoints if endpoint.server is not None]

    # ------------------------------------------------------------------ HTTP (rank 0)

    def _ready(self) -> None:
        """Rank 0: every server is up (a launched one answered /health) and its model name is known."""
        for endpoint in self.endpoints:
            if endpoint.model_name is not None:
                continue
            if endpoint.server is not None:
                endpoint.server.wait_ready(self.settings.start_timeout_s, self._started)
            models = self._call(endpoint, "GET", "/v1/models", None, "list the served models")
            try:
                endpoint.model_name = str(models["data"][0]["id"])
            except (KeyError, IndexError, TypeError) as exc:
                raise EngineError(f"{NAME} at {endpoint.url}: GET /v1/models answered {str(models)[:300]!r}") from exc

    def _call(self, endpoint: _Endpoint, method: str, route: str, body: Any, what: str) -> Any:
        """One HTTP call to `endpoint` within `request_timeout_s` (the API key in its headers), its JSON answer (None
        when empty); EngineError naming the engine, the server's URL, the request and the cause (with a launched
        server's state)."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(endpoint.url + route, data=data, method=method, headers=self._headers)
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # the job's own nodes: never a proxy
        where = f"{NAME} at {endpoint.url}: {what} ({method} {route})"
        try:
            with opener.open(request, timeout=self.settings.request_timeout_s) as response:
                raw = response.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read()[:600].decode(errors="replace")
            raise EngineError(f"{where} answered HTTP {exc.code}: {detail}") from None
        except (OSError, urllib.error.URLError) as exc:  # refused, reset, or timed out (socket.timeout is an OSError)
            timed_out = isinstance(exc, TimeoutError) or "timed out" in str(exc)
            cause = f"no answer within rl.vllm.request_timeout_s = {self.settings.request_timeout_s:g} s"
            raise EngineError(f"{where} failed: {cause if timed_out else exc}{_state(endpoint)}") from exc
        try:
            return json.loads(raw) if raw.strip() else None
        except ValueError as exc:
            raise EngineError(f"{where}: non-JSON {raw[:200]!r}") from exc

    def _each(self, fn: Callable[[_Endpoint], Any]) -> list[Any]:
        """Rank 0: `fn(endpoint)` for every server at once (threads), in order; the first server's error, in order,
        is raised after all have answered."""
        if len(self.endpoints) == 1:
            return [fn(self.endpoints[0])]
        with ThreadPoolExecutor(len(self.endpoints), "vllm-server") as pool:
            futures = [pool.submit(fn, endpoint) for endpoint in self.endpoints]
            wait(futures)
        return [future.result() for future in futures]

    # ------------------------------------------------------------------ weights

    def sync_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Collective (see the module docstring): write once, then every server reloads and resets its prefix cache;
        then each server's sync check (`SyncCheck`)."""
        where = f"{NAME}, weight sync of version {version}: "

        def reload(endpoint: _Endpoint) -> list[float]:
            body = {"method": "reload_weights", "kwargs": {"weights_path": str(self.sync_path)}}
            self._call(endpoint, "POST", "/collective_rpc", body, f"reload the weights of version {version}")
            self._call(endpoint, "POST", "/reset_prefix_cache", None, "reset the prefix cache")
            if self.renders_prompts:  # images' encoder outputs of the old weights (see the module docstring)
                self._call(endpoint, "POST", "/reset_encoder_cache", None, "reset the encoder cache")
            return self._prompt_logprobs(endpoint, self.probe_ids)

        def sync() -> list[list[float]]:
            if self._pending is not None:  # a generation in flight finishes on the weights it started with
                wait([self._pending])
            self._ready()
            start = time.perf_counter()
            self._write(state_dict)
            written = time.perf_counter()
            probes = self._each(reload)
            self.sync_s = (written - start, time.perf_counter() - written)
            return probes

        engine_logprobs = self._on_leader(sync, where)
        trainer_logprobs = self.reference(self.probe_ids)
        problem = None
        if self.leader:
            for endpoint, values in zip(self.endpoints, engine_logprobs):
                verdict = endpoint.check(version, values, trainer_logprobs)
                if verdict is not None:
                    problem = EngineError(f"{NAME} at {endpoint.url}: {verdict}")
                    break
            self.last_probe_diff = max(endpoint.check.gap for endpoint in self.endpoints)
            if problem is None:
                followed = [e.check.followed for e in self.endpoints if e.check.followed is not None]
                logger.info(
                    "%s: weights of version %d synced to %d server(s) (write %.2f s, reload %.2f s); probe mean |diff| "
                    "%.2e%s", NAME, version, len(self.endpoints), *self.sync_s, self.last_probe_diff,
                    f", followed the trainer's change {min(followed):.0%}" if followed else "",
                )  # fmt: skip
        agree(problem, EngineError, self.group, where=where)
        self._version = version

    def _on_leader(self, fn: Callable[[], Any], where: str) -> Any:
        """Collective: `fn()` run on rank 0 (its value there, None elsewhere) in a thread, while every rank joins a MAX
        all-reduce of "rank 0 is done" each second, so no collective waits long for rank 0 whatever the server takes
        (`parallel.collective_timeout_s` need not cover `start_timeout_s` or a batch's generation). An exception of
        `fn` is an EngineError on every rank (`where` + the cause)."""
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["value"] = fn()
            except BaseException as exc:  # noqa: BLE001 - reported on every rank below
                box["error"] = exc

        if group_size(self.group) == 1:
            run()
        else:
            thread = None
            if self.leader:
                thread = threading.Thread(target=run, name="vllm-engine", daemon=True)
                thread.start()
            while True:
                if thread is not None:
                    thread.join(timeout=1.0)
                done = int(thread is not None and not thread.is_alive())
                if all_reduce([done], op="max", group=self.group)[0]:
                    break
        error = box.get("error")
        if error is not None and not isinstance(error, EngineError):
            error = EngineError(f"{NAME}: {error!r}")
        agree(error, EngineError, self.group, where=where)
        return box.get("value")

    def _write(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Rank 0: `model.safetensors` (+ config.json) in `sync_path`, the file replaced whole."""
        from safetensors.torch import save_file

        self.sync_path.mkdir(parents=True, exist_ok=True)
        seen: set[int] = set()
        tensors = {}
        for key, value in state_dict.items():
            value = value.detach().cpu().contiguous()
            if value.data_ptr() in seen:  # a tied weight: safetensors refuses shared storage, so its own copy
                value = value.clone()
            seen.add(value.data_ptr())
            tensors[key] = value
        tmp = self.sync_path / "model.safetensors.partial"  # not *.safetensors: a reload never reads a half file
        save_file(tensors, str(tmp), metadata={"format": "pt"})
        tmp.replace(self.sync_path / "model.safetensors")
        if self.config_path.is_file():
            shutil.copyfile(self.config_path, self.sync_path / "config.json")

    def _prompt_logprobs(self, endpoint: _Endpoint, ids: list[int]) -> list[float]:
        """Rank 0: the server's log-probabilities of ids[1:], each given the ids before it (raw logits)."""
        body = {
            "model": endpoint.model_name, "prompt": ids, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0,
            "return_tokens_as_token_ids": True,
        }  # fmt: skip
        what = f"prompt log-probabilities of the probe ({len(ids)} tokens)"
        answer = self._call(endpoint, "POST", "/v1/completions", body, what)
        try:
            entries = answer["choices"][0]["prompt_logprobs"]
            return [float(_logprob_of(entries[t], token)) for t, token in enumerate(ids) if t > 0]
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise EngineError(f"{NAME} at {endpoint.url}: {what}: unexpected answer ({exc!r})") from exc

    # ------------------------------------------------------------------ rollouts

    def generate(self, requests: Sequence[RolloutRequest], settings: SamplingSettings) -> list[list[Rollout]]:
        """Collective: every rank's requests answered in one wave on rank 0 (see the module docstring)."""
        problem: Exception | None = None
        for index, request in enumerate(requests):
            if not request.prompt_ids:
                problem = ValueError(f"request {index} has an empty prompt")
            elif request.model_inputs and not request.chat:
                problem = ValueError(f"request {index} has images but no chat fields for the server to render")
        agree(problem, EngineError, self.group, where=f"{NAME}: generate: ")
        everyone = all_gather_objects([_plain(r) for r in requests], self.group)
        return self._collect(self._start(everyone, settings))

    # One-step-async rollouts (`rl.async_steps: 1`): the trainer starts a rollout batch's generation, trains, and
    # collects it later; the HTTP work runs in a thread of rank 0 that makes no collective.
    def start_generate(self, everyone: Sequence[Sequence[RolloutRequest]], settings: SamplingSettings) -> None:
        """Not collective: rank 0 starts generating every rank's requests (`everyone[rank]`) in the background; other
        ranks do nothing. `finish_generate` collects them; a weight sync waits for them first."""
        self._pending = self._start([[_plain(r) for r in requests] for requests in everyone], settings)

    def finish_generate(self) -> list[list[Rollout]]:
        """Collective: this rank's rollouts of the generation `start_generate` began (waiting for it)."""
        pending, self._pending = self._pending, None
        return self._collect(pending)

    def _start(self, everyone: Sequence[Sequence[_Plain]], settings: SamplingSettings) -> Any:
        """Rank 0: a Future of every rank's rollouts, computed in a daemon thread (None on other ranks)."""
        if not self.leader:
            return None
        future: Future[Any] = Future()

        def run() -> None:
            try:
                self._ready()
                future.set_result(self._generate(everyone, settings))
            except BaseException as exc:  # noqa: BLE001 - collected by _collect
                future.set_exception(exc)

        threading.Thread(target=run, name="vllm-generate", daemon=True).start()
        return future

    def _collect(self, future: Any) -> list[list[Rollout]]:
        """Collective: wait for rank 0's `future`, agree on its failure, broadcast; this rank's share."""
        answers = [self._on_leader(lambda: future.result(), f"{NAME}: generate: ")]
        if group_size(self.group) > 1:
            dist.broadcast_object_list(answers, src=dist.get_global_rank(self.group, 0), group=self.group)
        rank = dist.get_rank(self.group) if group_size(self.group) > 1 else 0
        return [[Rollout(*rollout) for rollout in request] for request in answers[0][rank]]

    def _generate(
        self, everyone: Sequence[Sequence[_Plain]], settings: SamplingSettings
    ) -> list[list[list[tuple[list[int], list[float], str]]]]:
        """Rank 0: every rank's requests as one wave, one HTTP request per sample, the samples spread over the servers
        (`spread`), `max_concurrency` in flight per server; the first failure stops the rest. Per rank, per request,
        per seed: (response ids, log-probabilities, finish reason)."""
        rows = [
            (rank, i, j)
            for rank, requests in enumerate(everyone)
            for i, (_, seeds, _) in enumerate(requests)
            for j in range(len(seeds))
        ]
        out: list[list[list[Any]]] = [[[None] * len(seeds) for _, seeds, _ in requests] for requests in everyone]
        failed = threading.Event()

        def one(endpoint: _Endpoint, row: tuple[int, int, int]) -> None:
            if failed.is_set():
                return
            rank, i, j = row
            try:
                prompt, seeds, chat = everyone[rank][i]
                what = f"rank {rank}'s request {i}, sample {j}"
                out[rank][i][j] = self._sample(endpoint, prompt, chat, seeds[j], settings, what)
            except BaseException:
                failed.set()
                raise

        futures = []
        with contextlib.ExitStack() as pools:
            for k, (endpoint, share) in enumerate(zip(self.endpoints, spread(len(rows), len(self.endpoints)))):
                if share:
                    workers = min(len(share), self.settings.max_concurrency)
                    pool = pools.enter_context(ThreadPoolExecutor(workers, f"vllm-request-{k}"))
                    futures += [pool.submit(one, endpoint, rows[r]) for r in share]
            errors = [future.exception() for future in futures]
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first if isinstance(first, EngineError) else EngineError(f"{NAME}: {first!r}")
        return out

    def _sample(
        self,
        endpoint: _Endpoint,
        prompt: list[int],
        chat: Mapping[str, Any],
        seed: int,
        settings: SamplingSettings,
        what: str,
    ) -> tuple[list[int], list[float], str]:
        """Rank 0: one sample from `endpoint`: (response ids, their log-probabilities, finish reason); `chat`: the
        chat route's fields (VL)."""
        body: dict[str, Any] = {
            "model": endpoint.model_name, "n": 1, "max_tokens": settings.max_new_tokens,
            "temperature": 0.0 if settings.greedy else settings.temperature, "return_token_ids": True,
            "skip_special_tokens": False, "stop_token_ids": list(settings.stop_ids), "ignore_eos": True,
        }  # fmt: skip
        if not settings.greedy:
            body |= {"seed": seed % (1 << 63), "top_p": settings.top_p, "top_k": settings.top_k or -1}
        if settings.suppress_ids:
            body["logit_bias"] = {str(t): -100.0 for t in settings.suppress_ids}
        if chat:
            body |= {**chat, "logprobs": True, "top_logprobs": 0}
            route = "/v1/chat/completions"
        else:
            body |= {"prompt": prompt, "logprobs": 0, "return_tokens_as_token_ids": True}
            route = "/v1/completions"
        answer = self._call(endpoint, "POST", route, body, f"{what} (prompt of {len(prompt)} tokens)")
        try:
            choice = answer["choices"][0]
            ids = [int(t) for t in choice["token_ids"]]
            if chat:
                logprobs = [float(entry["logprob"]) for entry in choice["logprobs"]["content"]]
                rendered = [int(t) for t in answer["prompt_token_ids"]]
            else:
                logprobs = [float(x) for x in choice["logprobs"]["token_logprobs"]]
            reason = choice["finish_reason"]
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            detail = str(answer)[:300]
            raise EngineError(f"{NAME} at {endpoint.url}: {what}: unexpected answer ({exc!r}): {detail}") from exc
        if chat and rendered != list(prompt):
            at = next((t for t, (a, b) in enumerate(zip(rendered, prompt)) if a != b), min(len(rendered), len(prompt)))
            raise EngineError(
                f"{NAME} at {endpoint.url}: {what}: the server rendered the prompt as {len(rendered)} tokens, the "
                f"trainer as {len(prompt)}; first difference at position {at} (server {rendered[at : at + 1]}, trainer "
                f"{list(prompt[at : at + 1])}): the server must render with the trainer's chat template and image "
                f"processor (serve model.pretrained_dir)"
            )
        stops = set(settings.stop_ids)
        if reason == "stop" and (not ids or ids[-1] not in stops):
            raise EngineError(
                f"{NAME} at {endpoint.url}: {what} stopped on {ids[-1:]} which is no stop id of {sorted(stops)}"
            )
        if reason not in ("stop", "length") or len(logprobs) != len(ids):
            raise EngineError(
                f"{NAME} at {endpoint.url}: {what}: finish reason {reason!r}, {len(ids)} ids, {len(logprobs)} log-probs"
            )
        return ids, logprobs, reason

    # ------------------------------------------------------------------ end

    def close(self) -> None:
        """Stop the launched servers, each with its whole process group (rank 0), and remove this run's weights
        directory (idempotent, not collective)."""
        if self._closed:
            return
        self._closed = True
        self._stop_servers()
        if self.leader:
            shutil.rmtree(self.sync_path, ignore_errors=True)

    def _stop_servers(self) -> None:
        for server in self.servers:  # all asked at once, then each waited for
            server.terminate()
        for server in self.servers:
            server.stop()


def _state(endpoint: _Endpoint) -> str:
    """A launched server's state, for an error after a failed call: a server killed a moment ago may still be exiting
    when its connections fail, so it gets a few seconds to be seen as exited."""
    server = endpoint.server
    if server is None:
        return ""
    code = server.exited(wait_s=5.0)
    if code is None:
        return f" (launched server pid {server.pid} still running; log {server.log_path})"
    return f" (launched server pid {server.pid} exited with code {code}; log {server.log_path})"


_Plain = tuple[list[int], list[int], dict[str, Any]]  # a request as rank 0 gets it: prompt ids, seeds, chat fields


def _plain(request: RolloutRequest) -> _Plain:
    return list(request.prompt_ids), list(request.seeds), dict(request.chat)


def _logprob_of(entry: Mapping[str, Any], token: int) -> float:
    """A prompt position's log-probability of `token` from vLLM's {key: {logprob, ...}} (key the id, or token_id:ID)."""
    for key, value in entry.items():
        if key in (str(token), f"token_id:{token}"):
            return float(value["logprob"] if isinstance(value, Mapping) else value)
    raise ValueError(f"token {token} not in the prompt log-probabilities {list(entry)[:5]}")
