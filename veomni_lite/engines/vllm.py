"""Rollouts on a vLLM server (`rl.engine: vllm`), over HTTP with the standard library only: the trainer never imports
vllm (its CPU build pins a transformers older than ours), so the server runs from another environment.

Reaching it (`VLLMSettings`, the `rl.vllm` section): `url`, a server the user started (OpenAI-compatible, with
`VLLM_SERVER_DEV_MODE=1` for the weight routes), or `launch: true`: rank 0 starts (`VLLMServer`)
`python -m vllm.entrypoints.openai.api_server` with the interpreter `python` from the run's `model.pretrained_dir`, on
127.0.0.1 and a free port, in dev mode, in a process group of its own, and stops that group at `close`, when it does not
answer /health within `start_timeout_s`, at interpreter exit, and (Linux) when the trainer process dies. For a text
model the server never tokenizes (`--skip-tokenizer-init`: ids in, ids out); for a vision-language model it renders
prompts itself (below). It ignores the model directory's generation config.

Only rank 0 talks to the server; `generate` and `sync_weights` are collective over the trainer's control group (every
rank calls them, with its own requests): every rank's requests are gathered on rank 0, sent as one wave of concurrent
HTTP requests that vLLM batches, and the rollouts broadcast back. Why rank 0 alone: a launched server listens on
loopback of rank 0's node, which other nodes cannot reach, and one wave holding the whole rollout batch fills vLLM's
batch better than world-size smaller ones. A failure on rank 0 (no answer within `request_timeout_s`, an HTTP error,
the launched server gone) is the same `EngineError` on every rank, naming the engine and the request (`agree`). While
rank 0 waits on the server, every rank joins a small all-reduce each second, so no collective waits on rank 0 for long
(`parallel.collective_timeout_s` need not cover a server's start or a batch's generation).

Sampling: one `/v1/completions` request per sample: the prompt's ids, `n` 1 and the sample's own `seed` (so a sample
is a function of its prompt, seed, weights and settings, not of its batch), temperature, top_p, top_k, `max_tokens`,
`stop_token_ids` with `ignore_eos` (only the trainer's end-of-turn ids end a response, kept in it), `logprobs` 0 with
`return_token_ids`. Greedy: temperature 0. vLLM's draws differ from the embedded engine's for the same seed.

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
name) as `model.safetensors`, with the model's `config.json`, into `rl.vllm.sync_dir`/<run>/, POSTs `/collective_rpc`
`reload_weights` with that directory, then `/reset_prefix_cache` (a cached prompt would otherwise reuse results of the
old weights) and, for a vision-language model, `/reset_encoder_cache` (the images' vision-encoder outputs are of the
old weights too; without the reset vLLM 0.32's engine dies, "Encoder cache miss", on the next wave of images it has
seen). Then the probe: the server's prompt log-probabilities of a fixed token sequence (`probe_ids`) against the
trainer's (`reference`, a collective forward of the trainer's model on every rank); a mean absolute difference above
`probe_tolerance` is an `EngineError` on every rank (the engine does not hold the trainer's weights).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
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
from veomni_lite.engines.base import Rollout, RolloutEngine, RolloutRequest, SamplingSettings

logger = logging.getLogger(__name__)

__all__ = ["EngineError", "VLLMEngine", "VLLMServer", "VLLMSettings"]

NAME = "vLLM engine"
# Variables torchrun sets for the trainer's ranks, which vLLM's own process setup must not read as its own.
_TORCHRUN_ENV = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
    "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE",
)  # fmt: skip
# Run as `python -c` before vLLM: die with the trainer (prctl PR_SET_PDEATHSIG survives exec), then become vLLM.
_BOOT = (
    "import ctypes, os, signal, sys\n"
    "try:\n    ctypes.CDLL(None).prctl(1, signal.SIGKILL)\nexcept Exception:\n    pass\n"
    "if os.getppid() != int(sys.argv[1]):\n    sys.exit(1)\n"
    "os.execv(sys.executable, [sys.executable, '-m', 'vllm.entrypoints.openai.api_server', *sys.argv[2:]])\n"
)


class EngineError(RuntimeError):
    """The rollout engine failed (did not start, died, answered with an error or not within the timeout, or holds
    other weights than the trainer's); the message names the engine and the request."""


@dataclass
class VLLMSettings:
    """The `rl.vllm` section (a mapping in the config; see `VLLMSettings.parse`)."""

    url: str = ""
    """A running server's base URL (e.g. http://10.0.0.5:8000), started by the user in dev mode."""
    launch: bool = False
    """Rank 0 starts the server itself on 127.0.0.1 (exclusive with `url`)."""
    python: str = ".venv-vllm/bin/python"
    """The interpreter of an environment with vLLM (`make vllm-env`), for `launch`."""
    sync_dir: str = "/dev/shm/veomni_lite_vllm"
    """Where rank 0 writes the weights for the server to reload (a directory per run under it, removed at close); the
    server must read the same path (same node, or a shared file system)."""
    start_timeout_s: float = 300.0
    """`launch`: seconds for the server to answer /health."""
    request_timeout_s: float = 600.0
    """Every HTTP call's limit (a whole rollout batch's generation included)."""
    probe_tolerance: float = 0.02
    """Largest mean |engine - trainer| log-probability of the probe's tokens after a sync. vLLM runs a float32
    checkpoint in bfloat16 unless told `--dtype float32`; float32 on both sides differs by ~1e-6, a bfloat16 engine by
    ~1e-3 on the tiny test models and more on real ones: a skipped sync is caught when the update moved the probe's
    log-probabilities by more than this."""
    server_args: list[str] = field(default_factory=list)
    """`launch`: more arguments for the server (e.g. ["--dtype", "float32", "--max-model-len", "4096"])."""
    max_concurrency: int = 256
    """Requests (samples) in flight at once."""

    @classmethod
    def parse(cls, section: Mapping[str, Any]) -> VLLMSettings:
        """The settings of `rl.vllm`; ValueError naming an unknown key or a bad value."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(section) - known)
        if unknown:
            raise ValueError(f"rl.vllm: unknown key(s) {unknown}; known: {sorted(known)}")
        settings = cls(**dict(section))
        if bool(settings.url) == bool(settings.launch):
            raise ValueError("rl.vllm: give exactly one of url (a running server) and launch: true")
        if settings.url and not settings.url.startswith(("http://", "https://")):
            raise ValueError(f"rl.vllm.url: must start with http:// or https://, got {settings.url!r}")
        for key in ("start_timeout_s", "request_timeout_s", "probe_tolerance", "max_concurrency"):
            if not getattr(settings, key) > 0:
                raise ValueError(f"rl.vllm.{key}: must be > 0, got {getattr(settings, key)}")
        if not isinstance(settings.server_args, list) or not all(isinstance(a, str) for a in settings.server_args):
            raise ValueError("rl.vllm.server_args: must be a list of strings")
        return settings


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


class VLLMServer:
    """A vLLM OpenAI-compatible server this process starts on 127.0.0.1 (see the module docstring) and stops."""

    def __init__(
        self,
        python: str,
        model_dir: str,
        log_path: str | Path,
        server_args: Sequence[str] = (),
        port: int = 0,
        renders_prompts: bool = False,
    ) -> None:
        """`renders_prompts`: the server loads the tokenizer and processor and trusts a request's chat template (VL)."""
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        args = [
            "--model", str(model_dir), "--host", "127.0.0.1", "--port", str(self.port), "--enforce-eager",
            "--trust-request-chat-template" if renders_prompts else "--skip-tokenizer-init", "--generation-config",
            "vllm", "--logprobs-mode", "processed_logprobs", "--seed", "0", *cpu_server_args(server_args), *server_args,
        ]  # fmt: skip
        env = {key: value for key, value in os.environ.items() if key not in _TORCHRUN_ENV}
        env["VLLM_SERVER_DEV_MODE"] = "1"  # /collective_rpc and /reset_prefix_cache; never reachable off loopback
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on a CPU build (ignored on GPU)
        if not Path(python).is_file():
            raise EngineError(f"{NAME}: rl.vllm.python {python!r} does not exist (make vllm-env builds .venv-vllm)")
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [python, "-c", _BOOT, str(os.getpid()), *args], stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, env=env, start_new_session=True,
            )  # fmt: skip
        self.pid = self.process.pid
        atexit.register(self.stop)
        logger.info("%s: started pid %d on %s (log %s)", NAME, self.pid, self.url, self.log_path)

    def exited(self) -> int | None:
        """The server's exit code, or None while it runs."""
        return self.process.poll()

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def wait_ready(self, timeout_s: float, started: float) -> None:
        """Until GET /health answers 200; EngineError (server stopped) when it exits or `timeout_s` after
        `started` (a `time.monotonic()`) passes."""
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
                urllib.request.urlopen(self.url + "/health", timeout=5) as response,
            ):
                if response.status == 200:
                    return
            if time.monotonic() - started > timeout_s:
                self.stop()
                raise EngineError(
                    f"{NAME} (launched, pid {self.pid}) did not answer GET {self.url}/health within "
                    f"rl.vllm.start_timeout_s = {timeout_s:g} s; stopped it. The end of its log {self.log_path}:\n"
                    f"{self.log_tail()}"
                )
            time.sleep(0.5)

    def stop(self) -> None:
        """Kill the server's process group (its engine processes too) and reap it (idempotent)."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)  # the group start_new_session made: this server's alone
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=30)
        atexit.unregister(self.stop)


class VLLMEngine(RolloutEngine):
    """Rollouts from a vLLM server (see the module docstring). Collective over `group`: every rank calls the
    constructor, `sync_weights`, `generate` and `finish_generate` alike; only group rank 0 talks to the server.

    `reference(ids)`: the trainer's log-probabilities of ids[1:] (each given the ids before it, temperature 1) under
    its current weights, a collective every rank calls; `probe_ids`: the probe's tokens (a few dozen, text only);
    `renders_prompts`: the model takes images: a launched server renders prompts itself (`RolloutRequest.chat`), and a
    sync also resets the server's encoder cache."""

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
        self.server: VLLMServer | None = None
        self.model_name: str | None = None
        self.sync_path = Path(settings.sync_dir) / f"run-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.last_probe_diff = float("nan")
        self._started = time.monotonic()
        self._closed = False
        self._pending: Future[Any] | None = None  # a started generation (rank 0), see start_generate
        problem = None
        if self.leader:
            try:
                if settings.launch:
                    self.server = VLLMServer(
                        settings.python, model_dir, log_path, settings.server_args, renders_prompts=renders_prompts
                    )
                    self.url = self.server.url
                else:
                    self.url = settings.url.rstrip("/")
            except (EngineError, OSError) as exc:
                problem = exc
        agree(problem, EngineError, group, where=f"{NAME}: start: ")

    # ------------------------------------------------------------------ HTTP (rank 0)

    def _ready(self) -> None:
        """Rank 0: the server is up (a launched one answered /health) and its model name is known."""
        if self.model_name is not None:
            return
        if self.server is not None:
            self.server.wait_ready(self.settings.start_timeout_s, self._started)
        models = self._call("GET", "/v1/models", None, "list the served models")
        try:
            self.model_name = str(models["data"][0]["id"])
        except (KeyError, IndexError, TypeError) as exc:
            raise EngineError(f"{NAME} at {self.url}: GET /v1/models answered {str(models)[:300]!r}") from exc

    def _call(self, method: str, route: str, body: Any, what: str) -> Any:
        """One HTTP call within `request_timeout_s`, its JSON answer (None when empty); EngineError naming the engine,
        the request and the cause (with a launched server's state)."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.url + route, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # the job's own nodes: never a proxy
        try:
            with opener.open(request, timeout=self.settings.request_timeout_s) as response:
                raw = response.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read()[:600].decode(errors="replace")
            raise EngineError(
                f"{NAME} at {self.url}: {what} ({method} {route}) answered HTTP {exc.code}: {detail}"
            ) from None
        except (OSError, urllib.error.URLError) as exc:  # refused, reset, or timed out (socket.timeout is an OSError)
            cause = f"no answer within rl.vllm.request_timeout_s = {self.settings.request_timeout_s:g} s"
            if not isinstance(exc, TimeoutError) and "timed out" not in str(exc):
                cause = str(exc)
            where = f"{NAME} at {self.url}: {what} ({method} {route})"
            raise EngineError(f"{where} failed: {cause}{self._state()}") from exc
        try:
            return json.loads(raw) if raw.strip() else None
        except ValueError as exc:
            raise EngineError(f"{NAME} at {self.url}: {what} ({method} {route}): non-JSON {raw[:200]!r}") from exc

    def _state(self) -> str:
        if self.server is None:
            return ""
        code = self.server.exited()
        if code is None:
            return f" (launched server pid {self.server.pid} still running)"
        return f" (launched server pid {self.server.pid} exited with code {code}; log {self.server.log_path})"

    # ------------------------------------------------------------------ weights

    def sync_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Collective (see the module docstring): write, reload, reset the prefix cache, then the probe check."""
        where = f"{NAME}, weight sync of version {version}: "

        def reload() -> list[float]:
            if self._pending is not None:  # a generation in flight finishes on the weights it started with
                wait([self._pending])
            self._ready()
            start = time.perf_counter()
            self._write(state_dict)
            written = time.perf_counter()
            body = {"method": "reload_weights", "kwargs": {"weights_path": str(self.sync_path)}}
            self._call("POST", "/collective_rpc", body, f"reload the weights of version {version}")
            self._call("POST", "/reset_prefix_cache", None, "reset the prefix cache")
            if self.renders_prompts:  # images' encoder outputs of the old weights (see the module docstring)
                self._call("POST", "/reset_encoder_cache", None, "reset the encoder cache")
            self.sync_s = (written - start, time.perf_counter() - written)
            return self._prompt_logprobs(self.probe_ids)

        engine_logprobs = self._on_leader(reload, where)
        trainer_logprobs = self.reference(self.probe_ids)
        problem = None
        if self.leader:
            diffs = [abs(a - b) for a, b in zip(engine_logprobs, trainer_logprobs)]
            self.last_probe_diff = sum(diffs) / max(len(diffs), 1)
            tolerance = self.settings.probe_tolerance
            if len(engine_logprobs) != len(trainer_logprobs) or not self.last_probe_diff <= tolerance:
                problem = EngineError(
                    f"after reloading the weights of version {version}, the engine's log-probabilities of the probe "
                    f"({len(self.probe_ids)} tokens) differ from the trainer's by mean |diff| "
                    f"{self.last_probe_diff:.3g} (max {max(diffs, default=float('nan')):.3g}) > "
                    f"rl.vllm.probe_tolerance {tolerance:g}: the engine does not serve the trainer's weights (a reload "
                    f"that did not apply, another model, or a numeric precision far from the trainer's)"
                )
            else:
                logger.info(
                    "%s: weights of version %d synced (write %.2f s, reload %.2f s); probe mean |diff| %.2e", NAME,
                    version, *self.sync_s, self.last_probe_diff,
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

    def _prompt_logprobs(self, ids: list[int]) -> list[float]:
        """Rank 0: the server's log-probabilities of ids[1:], each given the ids before it (raw logits)."""
        body = {
            "model": self.model_name, "prompt": ids, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0,
            "return_tokens_as_token_ids": True,
        }  # fmt: skip
        what = f"prompt log-probabilities of the probe ({len(ids)} tokens)"
        answer = self._call("POST", "/v1/completions", body, what)
        try:
            entries = answer["choices"][0]["prompt_logprobs"]
            return [float(_logprob_of(entries[t], token)) for t, token in enumerate(ids) if t > 0]
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise EngineError(f"{NAME} at {self.url}: {what}: unexpected answer ({exc!r})") from exc

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
                future.set_result([self._generate(r, settings, rank) for rank, r in enumerate(everyone)])
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
        self, requests: Sequence[_Plain], settings: SamplingSettings, rank: int
    ) -> list[list[tuple[list[int], list[float], str]]]:
        """Rank 0: one request per sample, `max_concurrency` in flight; the first failure stops the rest."""
        rows = [(i, j) for i, (_, seeds, _) in enumerate(requests) for j in range(len(seeds))]
        out: list[list[Any]] = [[None] * len(seeds) for _, seeds, _ in requests]
        failed = threading.Event()

        def one(row: tuple[int, int]) -> None:
            if failed.is_set():
                return
            i, j = row
            try:
                what = f"rank {rank}'s request {i}, sample {j}"
                prompt, seeds, chat = requests[i]
                out[i][j] = self._sample(prompt, chat, seeds[j], settings, what)
            except BaseException:
                failed.set()
                raise

        if rows:
            with ThreadPoolExecutor(min(len(rows), self.settings.max_concurrency), "vllm-request") as pool:
                futures = [pool.submit(one, row) for row in rows]
                errors = [f.exception() for f in futures]
            first = next((e for e in errors if e is not None), None)
            if first is not None:
                raise first if isinstance(first, EngineError) else EngineError(f"{NAME} at {self.url}: {first!r}")
        return out

    def _sample(
        self, prompt: list[int], chat: Mapping[str, Any], seed: int, settings: SamplingSettings, what: str
    ) -> tuple[list[int], list[float], str]:
        """Rank 0: one sample: (response ids, their log-probabilities, finish reason); `chat`: the chat route's."""
        body: dict[str, Any] = {
            "model": self.model_name, "n": 1, "max_tokens": settings.max_new_tokens,
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
        answer = self._call("POST", route, body, f"{what} (prompt of {len(prompt)} tokens)")
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
            raise EngineError(f"{NAME} at {self.url}: {what}: unexpected answer ({exc!r}): {detail}") from exc
        if chat and rendered != list(prompt):
            at = next((t for t, (a, b) in enumerate(zip(rendered, prompt)) if a != b), min(len(rendered), len(prompt)))
            raise EngineError(
                f"{NAME}: {what}: the server rendered the prompt as {len(rendered)} tokens, the trainer as "
                f"{len(prompt)}; first difference at position {at} (server {rendered[at : at + 1]}, trainer "
                f"{list(prompt[at : at + 1])}): the server must render with the trainer's chat template and image "
                f"processor (serve model.pretrained_dir)"
            )
        stops = set(settings.stop_ids)
        if reason == "stop" and (not ids or ids[-1] not in stops):
            raise EngineError(f"{NAME}: {what} stopped on {ids[-1:]} which is no stop id of {sorted(stops)}")
        if reason not in ("stop", "length") or len(logprobs) != len(ids):
            raise EngineError(f"{NAME}: {what}: finish reason {reason!r}, {len(ids)} ids, {len(logprobs)} log-probs")
        return ids, logprobs, reason

    # ------------------------------------------------------------------ end

    def close(self) -> None:
        """Stop a launched server (rank 0) and remove this run's weights directory (idempotent, not collective)."""
        if self._closed:
            return
        self._closed = True
        if self.server is not None:
            self.server.stop()
        if self.leader:
            shutil.rmtree(self.sync_path, ignore_errors=True)


_Plain = tuple[list[int], list[int], dict[str, Any]]  # a request as rank 0 gets it: prompt ids, seeds, chat fields


def _plain(request: RolloutRequest) -> _Plain:
    return list(request.prompt_ids), list(request.seeds), dict(request.chat)


def _logprob_of(entry: Mapping[str, Any], token: int) -> float:
    """A prompt position's log-probability of `token` from vLLM's {key: {logprob, ...}} (key the id, or token_id:ID)."""
    for key, value in entry.items():
        if key in (str(token), f"token_id:{token}"):
            return float(value["logprob"] if isinstance(value, Mapping) else value)
    raise ValueError(f"token {token} not in the prompt log-probabilities {list(entry)[:5]}")


if sys.platform != "linux":  # pragma: no cover - prctl is Linux's; elsewhere the atexit and close paths stop it
    _BOOT = _BOOT.replace("ctypes.CDLL(None).prctl(1, signal.SIGKILL)", "pass")
