"""Rank 0's HTTP client of the servers (`Client`), with the standard library only: every call within
`request_timeout_s`, the API key in its headers, never through a proxy, and any failure an `EngineError` naming the
engine, the server's URL, the request and the cause (with a launched server's state); the servers' readiness (/health,
the served model's name), the prompt log-probabilities of the sync check, and a wave of sampling requests spread over
the servers (`spread`: contiguous shares of the samples, so a prompt's samples mostly share a server and its prefix
cache).

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
server should be started with `--logprobs-mode processed_logprobs` (the sync check's probe cannot tell: prompt
log-probabilities are raw in every mode).
"""

from __future__ import annotations

import contextlib
import json
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from veomni_lite.engines.base import RolloutRequest, SamplingSettings
from veomni_lite.engines.vllm.check import SyncCheck
from veomni_lite.engines.vllm.server import VLLMServer
from veomni_lite.engines.vllm.settings import NAME, EngineError, VLLMSettings


def spread(count: int, servers: int) -> list[range]:
    """Samples 0..count-1 in `servers` contiguous shares whose sizes differ by at most one (the first ones larger):
    a prompt's samples, adjacent in a wave, mostly go to one server, which computes their prompt once (prefix cache)."""
    base, extra = divmod(count, servers)
    bounds = [0]
    for share in range(servers):
        bounds.append(bounds[-1] + base + (share < extra))
    return [range(bounds[k], bounds[k + 1]) for k in range(servers)]


class ServerDown(EngineError):
    """A server is gone (its connection refused, reset or closed, or a launched server exited): its requests may go to
    another server (`pool`), unlike an error it answered or a request it did not answer in time while running."""


@dataclass(eq=False)
class Endpoint:
    """One server as rank 0 reaches it: one process, for a launched server (a relaunch is another Endpoint).
    `state` (`pool`): "serving", "joining" (a relaunched server starting, or a user's server that stopped answering,
    both tried again before each wave and sync) or "gone" (a launched server not relaunched)."""

    url: str
    server: VLLMServer | None
    check: SyncCheck
    model_name: str | None = None
    state: str = "serving"


Plain = tuple[list[int], list[int], dict[str, Any]]  # a request as rank 0 gets it: prompt ids, seeds, chat fields


def plain(request: RolloutRequest) -> Plain:
    return list(request.prompt_ids), list(request.seeds), dict(request.chat)


class Client:
    """Rank 0's HTTP calls to the servers (see the module docstring); `api_key`: sent with every request ("": none)."""

    def __init__(self, settings: VLLMSettings, api_key: str = "") -> None:
        self.settings = settings
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"

    def ready(self, endpoints: Sequence[Endpoint], started: float) -> None:
        """Every server is up (a launched one answered /health within `start_timeout_s` of `started`, a
        `time.monotonic()`) and its model name is known."""
        for endpoint in endpoints:
            if endpoint.model_name is not None:
                continue
            if endpoint.server is not None:
                endpoint.server.wait_ready(self.settings.start_timeout_s, started)
            self.model_name(endpoint)

    def model_name(self, endpoint: Endpoint, timeout_s: float | None = None) -> None:
        """`endpoint.model_name` from GET /v1/models (within `timeout_s`, default `request_timeout_s`)."""
        models = self.call(endpoint, "GET", "/v1/models", None, "list the served models", timeout_s)
        try:
            endpoint.model_name = str(models["data"][0]["id"])
        except (KeyError, IndexError, TypeError) as exc:
            raise EngineError(f"{NAME} at {endpoint.url}: GET /v1/models answered {str(models)[:300]!r}") from exc

    def call(
        self, endpoint: Endpoint, method: str, route: str, body: Any, what: str, timeout_s: float | None = None
    ) -> Any:
        """One HTTP call to `endpoint` within `timeout_s` (default `request_timeout_s`; the API key in its headers),
        its JSON answer (None when empty); EngineError naming the engine, the server's URL, the request and the cause
        (with a launched server's state): `ServerDown` when the server is gone (the connection refused, reset or
        closed, or a launched server exited), not when it answered an error or did not answer in time while running."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(endpoint.url + route, data=data, method=method, headers=self.headers)
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # the job's own nodes: never a proxy
        where = f"{NAME} at {endpoint.url}: {what} ({method} {route})"
        limit = "rl.vllm.request_timeout_s = " if timeout_s is None else ""
        timeout_s = self.settings.request_timeout_s if timeout_s is None else timeout_s
        try:
            with opener.open(request, timeout=timeout_s) as response:
                raw = response.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read()[:600].decode(errors="replace")
            state, exited = _state(endpoint)
            error = ServerDown if exited else EngineError
            raise error(f"{where} answered HTTP {exc.code}: {detail}{state}") from None
        except (OSError, urllib.error.URLError) as exc:  # refused, reset, or timed out (socket.timeout is an OSError)
            timed_out = isinstance(exc, TimeoutError) or "timed out" in str(exc)
            cause = f"no answer within {limit}{timeout_s:g} s"
            state, exited = _state(endpoint)
            error = ServerDown if exited or not timed_out else EngineError
            raise error(f"{where} failed: {cause if timed_out else exc}{state}") from exc
        try:
            return json.loads(raw) if raw.strip() else None
        except ValueError as exc:
            raise EngineError(f"{where}: non-JSON {raw[:200]!r}") from exc

    def prompt_logprobs(self, endpoint: Endpoint, ids: list[int]) -> list[float]:
        """The server's log-probabilities of ids[1:], each given the ids before it (raw logits)."""
        body = {
            "model": endpoint.model_name, "prompt": ids, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0,
            "return_tokens_as_token_ids": True,
        }  # fmt: skip
        what = f"prompt log-probabilities of the probe ({len(ids)} tokens)"
        answer = self.call(endpoint, "POST", "/v1/completions", body, what)
        try:
            entries = answer["choices"][0]["prompt_logprobs"]
            return [float(_logprob_of(entries[t], token)) for t, token in enumerate(ids) if t > 0]
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise EngineError(f"{NAME} at {endpoint.url}: {what}: unexpected answer ({exc!r})") from exc

    def wave(
        self,
        endpoints: Sequence[Endpoint],
        everyone: Sequence[Sequence[Plain]],
        settings: SamplingSettings,
        out: list[list[list[Any]]] | None = None,
        on_down: Callable[[Endpoint, ServerDown], None] | None = None,
    ) -> list[list[list[Any]]]:
        """Every rank's requests as one wave, one HTTP request per sample, the samples not answered yet in `out` (all
        when None) spread over the servers (`spread`), `max_concurrency` in flight per server; the first failure stops
        the rest, except a `ServerDown` when `on_down` is given: it gets the server and the error, and that server's
        other samples stay unanswered (None) for another wave. Per rank, per request, per seed: (response ids,
        log-probabilities, finish reason), or None."""
        if out is None:
            out = [[[None] * len(seeds) for _, seeds, _ in requests] for requests in everyone]
        rows = [
            (rank, i, j)
            for rank, requests in enumerate(everyone)
            for i, (_, seeds, _) in enumerate(requests)
            for j in range(len(seeds))
            if out[rank][i][j] is None
        ]
        failed = threading.Event()
        down: set[int] = set()

        def one(k: int, endpoint: Endpoint, row: tuple[int, int, int]) -> None:
            if failed.is_set() or k in down:
                return
            rank, i, j = row
            try:
                prompt, seeds, chat = everyone[rank][i]
                what = f"rank {rank}'s request {i}, sample {j}"
                out[rank][i][j] = self.sample(endpoint, prompt, chat, seeds[j], settings, what)
            except ServerDown as exc:
                if on_down is None:
                    failed.set()
                    raise
                down.add(k)
                on_down(endpoint, exc)
            except BaseException:
                failed.set()
                raise

        futures = []
        with contextlib.ExitStack() as pools:
            for k, (endpoint, share) in enumerate(zip(endpoints, spread(len(rows), len(endpoints)))):
                if share:
                    workers = min(len(share), self.settings.max_concurrency)
                    pool = pools.enter_context(ThreadPoolExecutor(workers, f"vllm-request-{k}"))
                    futures += [pool.submit(one, k, endpoint, rows[r]) for r in share]
            errors = [future.exception() for future in futures]
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first if isinstance(first, EngineError) else EngineError(f"{NAME}: {first!r}")
        return out

    def sample(
        self,
        endpoint: Endpoint,
        prompt: list[int],
        chat: Mapping[str, Any],
        seed: int,
        settings: SamplingSettings,
        what: str,
    ) -> tuple[list[int], list[float], str]:
        """One sample from `endpoint`: (response ids, their log-probabilities, finish reason); `chat`: the
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
        answer = self.call(endpoint, "POST", route, body, f"{what} (prompt of {len(prompt)} tokens)")
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


def each(endpoints: Sequence[Endpoint], fn: Callable[[Endpoint], Any]) -> list[Any]:
    """`fn(endpoint)` for every server at once (threads), in order; the first server's error, in order, is raised after
    all have answered."""
    if len(endpoints) == 1:
        return [fn(endpoints[0])]
    with ThreadPoolExecutor(len(endpoints), "vllm-server") as pool:
        futures = [pool.submit(fn, endpoint) for endpoint in endpoints]
        wait(futures)
    return [future.result() for future in futures]


def _state(endpoint: Endpoint) -> tuple[str, bool]:
    """A launched server's state, for an error after a failed call, and whether it has exited: a server killed a moment
    ago may still be exiting when its connections fail, so it gets a few seconds to be seen as exited."""
    server = endpoint.server
    if server is None:
        return "", False
    code = server.exited(wait_s=5.0)
    if code is None:
        return f" (launched server pid {server.pid} still running; log {server.log_path})", False
    return f" (launched server pid {server.pid} exited with code {code}; log {server.log_path})", True


def _logprob_of(entry: Mapping[str, Any], token: int) -> float:
    """A prompt position's log-probability of `token` from vLLM's {key: {logprob, ...}} (key the id, or token_id:ID)."""
    for key, value in entry.items():
        if key in (str(token), f"token_id:{token}"):
            return float(value["logprob"] if isinstance(value, Mapping) else value)
    raise ValueError(f"token {token} not in the prompt log-probabilities {list(entry)[:5]}")
