"""`VLLMEngine`, the `RolloutEngine` of `rl.engine: vllm`: it composes the servers (`server`, or the user's), rank 0's
HTTP client (`client`) and the weight sync (`sync`) into the collective structure the trainer calls.

Only rank 0 talks to the servers; `generate` and `sync_weights` are collective over the trainer's control group (every
rank calls them, with its own requests): every rank's requests are gathered on rank 0, sent as one wave of concurrent
HTTP requests spread over the servers (`spread`: contiguous shares of the samples, so a prompt's samples mostly share a
server and its prefix cache), and the rollouts broadcast back. Why rank 0 alone: a launched server listens on loopback
of rank 0's node, which other nodes cannot reach, and one wave holding the whole rollout batch fills vLLM's batches
better than world-size smaller ones. A server that is gone (its connection refused or reset, or a launched server
exited) is the pool's (`pool`): its samples go to the servers that serve, with their own seeds, a launched one is
relaunched and rejoins on the synced weights; rank 0 alone decides, so no rank's collectives change. Any other failure
on rank 0 (no answer within `request_timeout_s`, an HTTP error, no server left) is the same `EngineError` on every rank,
naming the engine, the server's URL and the request (`agree`). While rank 0 waits on the servers, every rank joins a
small all-reduce each second, so no collective waits on rank 0 for long (`parallel.collective_timeout_s` need not cover
a server's start or a batch's generation).

Async rollouts (`rl.async_steps` >= 1): `start_generate` starts a rollout batch's generation in a thread of rank 0 that
makes no collective, `finish_generate` collects the oldest one started; a weight sync waits for every generation in
flight first.
"""

from __future__ import annotations

import functools
import os
import shutil
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, wait
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from veomni_lite.distributed.collectives import agree, all_gather_objects, all_reduce, group_size
from veomni_lite.engines.base import Rollout, RolloutEngine, RolloutRequest, SamplingSettings
from veomni_lite.engines.vllm.check import SyncCheck
from veomni_lite.engines.vllm.client import Client, Endpoint, Plain, ServerDown, each, plain
from veomni_lite.engines.vllm.pool import Pool
from veomni_lite.engines.vllm.server import VLLMServer
from veomni_lite.engines.vllm.settings import NAME, EngineError, VLLMSettings
from veomni_lite.engines.vllm.sync import judge, reload, write_weights


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
        self.sync_path = Path(settings.sync_dir) / f"run-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.last_probe_diff = float("nan")
        """The last sync's largest mean |engine - trainer| over the servers."""
        self.client = Client(settings)  # rank 0's, with the API key below
        self._started = time.monotonic()
        self._closed = False
        self._pending: deque[Any] = deque()  # started generations, oldest first (rank 0's Futures), see start_generate
        self._up = False  # rank 0: every server answered once (`_ready`)
        self._synced: tuple[int, list[float]] | None = None  # rank 0: the version on the servers, the trainer's probe
        self.model_dir = model_dir
        self.pool = Pool(settings, [], self._launch)
        self._key = ""
        problem = None
        if self.leader:
            try:
                self._key = settings.api_key()
                self.client = Client(settings, self._key)
                for url in settings.server_urls:
                    self.pool.slots.append(Endpoint(url, None, SyncCheck(settings.probe_tolerance)))
                log_path = Path(log_path)
                for k in range(settings.launch):
                    log = log_path if k == 0 else log_path.with_name(f"{log_path.stem}_{k}{log_path.suffix}")
                    server = self._launch(log)
                    self.pool.slots.append(Endpoint(server.url, server, SyncCheck(settings.probe_tolerance)))
            except (EngineError, OSError) as exc:
                problem = exc
                self._stop_servers()
        agree(problem, EngineError, group, where=f"{NAME}: start: ")

    def _launch(self, log_path: Path) -> VLLMServer:
        """Rank 0: a server of `model_dir` started, logging to `log_path`."""
        return VLLMServer(
            self.settings.python, self.model_dir, log_path, self.settings.server_args,
            renders_prompts=self.renders_prompts, api_key=self._key,
        )  # fmt: skip

    @property
    def endpoints(self) -> list[Endpoint]:
        """Every server as rank 0 reaches it, serving or not (`pool`; [] on other ranks)."""
        return self.pool.slots

    @property
    def servers(self) -> list[VLLMServer]:
        """The servers this engine launched, relaunched ones in place of those they replace (rank 0; [] elsewhere or
        with `url`/`urls`)."""
        return [endpoint.server for endpoint in self.endpoints if endpoint.server is not None]

    def _ready(self) -> None:
        """Rank 0: every server is up (a launched one answered /health) and its model name is known, once: a server
        that never answered is an EngineError (a configuration to fix), while one that served and went is the
        pool's to replace."""
        if not self._up:
            self.client.ready(self.endpoints, self._started)
            self._up = True

    def _serving(self) -> list[Endpoint]:
        """Rank 0: the servers that serve (at least one), once those that can join have joined, each brought to the
        weights on the servers (reloaded, and its sync check passed against the trainer's probe of them; a server
        joining before the first sync, or within a sync, gets the sync's weights with the others)."""
        self._ready()
        while True:
            for endpoint in self.pool.joiners(self.client, wait=True):
                if self._synced is not None:
                    version, trainer = self._synced
                    probe = self._attempt(endpoint, functools.partial(self._reload, endpoint, version))
                    if probe is None:
                        continue
                    verdict = endpoint.check(version, probe, trainer)
                    if verdict is not None:
                        raise EngineError(f"{NAME} at {endpoint.url}: {verdict}")
                self.pool.admit(endpoint)
            serving = self.pool.serving()
            if serving:
                return serving

    def _attempt(self, endpoint: Endpoint, fn: Callable[[], Any]) -> Any:
        """`fn()`, or None when `endpoint` went down meanwhile (reported to the pool)."""
        try:
            return fn()
        except ServerDown as exc:
            self.pool.down(endpoint, exc)
            return None

    def _reload(self, endpoint: Endpoint, version: int) -> list[float]:
        return reload(self.client, endpoint, self.sync_path, version, self.probe_ids, self.renders_prompts)

    # ------------------------------------------------------------------ weights

    def sync_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Collective (the `sync` module): rank 0 writes once, then every server that serves reloads and resets its
        prefix cache (one that is down meanwhile is left to the pool; at least one must take the weights); then each
        synced server's sync check (`SyncCheck`)."""
        where = f"{NAME}, weight sync of version {version}: "

        def sync() -> list[tuple[Endpoint, list[float]]]:
            if self._pending:  # the generations in flight finish on the weights they started with
                wait([f for f in self._pending if f is not None])
            self._serving()  # joiners first, on the weights they will replace
            start = time.perf_counter()
            self._write(state_dict)
            self._synced = None  # the servers' weights are this version's, whose trainer's probe comes below
            written = time.perf_counter()
            synced: list[tuple[Endpoint, list[float]]] = []
            while not synced:
                serving = self._serving()
                probes = each(serving, lambda e: self._attempt(e, lambda: self._reload(e, version)))
                synced = [(e, probe) for e, probe in zip(serving, probes) if probe is not None]
            self.sync_s = (written - start, time.perf_counter() - written)
            return synced

        synced = self._on_leader(sync, where)
        trainer_logprobs = self.reference(self.probe_ids)
        problem = None
        if self.leader:
            endpoints, engine_logprobs = [e for e, _ in synced], [probe for _, probe in synced]
            problem, self.last_probe_diff = judge(endpoints, version, engine_logprobs, trainer_logprobs, self.sync_s)
            self._synced = (version, list(trainer_logprobs))
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
        """Rank 0: `model.safetensors` (+ config.json) in `sync_path`, the file replaced whole (`sync.write_weights`;
        tests replace this method to skip a sync's write)."""
        write_weights(state_dict, self.sync_path, self.config_path)

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
        everyone = all_gather_objects([plain(r) for r in requests], self.group)
        return self._collect(self._start(everyone, settings))

    # Async rollouts (`rl.async_steps`): the trainer starts a rollout batch's generation, trains, and collects it
    # later; the HTTP work runs in a thread of rank 0 that makes no collective.
    def start_generate(self, everyone: Sequence[Sequence[RolloutRequest]], settings: SamplingSettings) -> None:
        """Not collective: rank 0 starts generating every rank's requests (`everyone[rank]`) in the background; other
        ranks do nothing. `finish_generate` collects them; a weight sync waits for them first."""
        self._pending.append(self._start([[plain(r) for r in requests] for requests in everyone], settings))

    def finish_generate(self) -> list[list[Rollout]]:
        """Collective: this rank's rollouts of the oldest generation `start_generate` began (waiting for it)."""
        return self._collect(self._pending.popleft())

    def _start(self, everyone: Sequence[Sequence[Plain]], settings: SamplingSettings) -> Any:
        """Rank 0: a Future of every rank's rollouts, computed in a daemon thread (None on other ranks)."""
        if not self.leader:
            return None
        future: Future[Any] = Future()

        def run() -> None:
            try:
                future.set_result(self._wave(everyone, settings))
            except BaseException as exc:  # noqa: BLE001 - collected by _collect
                future.set_exception(exc)

        threading.Thread(target=run, name="vllm-generate", daemon=True).start()
        return future

    def _wave(self, everyone: Sequence[Sequence[Plain]], settings: SamplingSettings) -> Any:
        """Rank 0: every rank's rollouts, from the servers that serve; the samples of a server that went down meanwhile
        go to the others in another wave, with their own seeds (so the same tokens as from the server that went)."""
        out = None
        while True:
            out = self.client.wave(self._serving(), everyone, settings, out, self.pool.down)
            if all(sample is not None for requests in out for seeds in requests for sample in seeds):
                return out

    def _collect(self, future: Any) -> list[list[Rollout]]:
        """Collective: wait for rank 0's `future`, agree on its failure, broadcast; this rank's share."""
        answers = [self._on_leader(lambda: future.result(), f"{NAME}: generate: ")]
        if group_size(self.group) > 1:
            dist.broadcast_object_list(answers, src=dist.get_global_rank(self.group, 0), group=self.group)
        rank = dist.get_rank(self.group) if group_size(self.group) > 1 else 0
        return [[Rollout(*rollout) for rollout in request] for request in answers[0][rank]]

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
        self.pool.close()  # no relaunch from here on
        for server in self.servers:  # all asked at once, then each waited for
            server.terminate()
        for server in self.servers:
            server.stop()
