"""`rl.engine: vllm` (`veomni_lite.engines.vllm`).

Without vLLM (every `make test`): the `rl.vllm` settings are checked by name; a server that refuses connections,
answers with an HTTP error or not within `request_timeout_s` is an EngineError naming the engine and the request on
every rank (a stdlib fake server); with several fake servers, a dead one's samples go to the others with their seeds
(the rollouts unchanged), a launched stand-in is relaunched and rejoins, and no server left is a named error.

With vLLM's CPU build in `.venv-vllm` (`make vllm-env`; `make test-vllm` runs the tests marked `vllm`, skipped
without it): one float32 server for the session on a Qwen2 of head dim 32 (the smallest vLLM's CPU attention takes).
The engine's sampled log-probabilities equal a plain forward's log-softmax(logits / T) (mean |diff| printed and
bounded), a seeded request repeats and stop ids end a response; the same config trains the same steps with the same
metric keys on `vllm` and on `transformers`, with the engine's log-probabilities matching the trainer's
(`rl/logprob_diff`); a sync skipped on purpose is caught by the probe on every rank (negative control); a launched
server that does not start in time is stopped and named; a wave of seeded requests over a CPU server's token budget
completes (vLLM's CPU build dies on chunked prefill of a seeded request: the negative control); a launched server killed
mid-run with no relaunch ends the run with a named error on every rank, and the run resumes from its checkpoint with a
fresh launched server; of two launched servers, one killed mid-wave leaves the run's rollouts unchanged and is
relaunched, synced and serves again. Vision-language (a second server, of a tiny Qwen2-VL; without it, a fake chat route
checks the request and the rendering check): the images reach the server through its chat route with the trainer's
pixels, the prompt it renders is the trainer's, and a sync resets its encoder cache.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from tests.dist_helpers import run_distributed
from tests.rl.fake_vllm_server import answer, fake_logprobs
from tests.trainer.helpers import read_events
from veomni_lite.config import ConfigError, load_config
from veomni_lite.engines.vllm.server import shared_memory
from veomni_lite.rl.config import RLConfig

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
requires_vllm = pytest.mark.skipif(not VLLM_PYTHON.is_file(), reason=".venv-vllm is absent (make vllm-env)")
VLLM_VISION = REPO / ".venv-vllm" / ".torchvision"  # scripts/cpu_torchvision.py ran (vLLM's VL models load)
SERVER_ARGS = ["--dtype", "float32", "--max-model-len", "256"]
TEMPERATURE = 0.8


@pytest.fixture(scope="session")
def math_demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The arithmetic prompts of examples/rl_math.py and its Qwen2 widened to hidden 128 (4 heads of 32, 2 KV)."""
    from examples.rl_math import write_data, write_model

    out = tmp_path_factory.mktemp("vllm_demo")
    texts = write_data(out, sft_rows=100, rl_rows=200, eval_rows=16, seed=0, max_value=20)
    write_model(out / "model", texts, hidden_size=128, head_dim=32)
    return out


@pytest.fixture(scope="session")
def vllm_server(math_demo: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One float32 vLLM server on loopback for the session (stopped at its end, or by the last test)."""
    if not VLLM_PYTHON.is_file():
        pytest.skip(".venv-vllm is absent (make vllm-env)")
    yield from _serve(math_demo / "model", tmp_path_factory.mktemp("vllm_server"))


_SERVED: list[Any] = []  # the session's servers, which a test that starts servers of its own stops first


def _serve(model: Path, log_dir: Path, renders_prompts: bool = False, args: list[str] = SERVER_ARGS) -> Any:
    """A server of `model` (float32 unless `args` say otherwise) on loopback, yielded once ready and stopped after (a
    fixture's body)."""
    from veomni_lite.engines.vllm import VLLMServer

    server = VLLMServer(str(VLLM_PYTHON), str(model), log_dir / "server.log", args, renders_prompts=renders_prompts)
    _SERVED.append(server)
    try:
        server.wait_ready(600, time.monotonic())
        yield server
    finally:
        server.stop()


def write_config(demo: Path, out: Path, engine: str, vllm: dict[str, Any] | None = None, **train: Any) -> Path:
    config = {
        "model": {"arch": "auto", "pretrained_dir": str(demo / "model")},
        "data": {"train_path": str(demo / "rl_train.jsonl"), "eval_path": str(demo / "rl_eval.jsonl"),
                 "format": "messages", "max_seq_len": 64},
        "rl": {"engine": engine, "prompts_per_step": 4, "num_generations": 4, "max_new_tokens": 8,
               "temperature": TEMPERATURE, "rewards": [{"name": "correct", "function": "math"}],
               "importance_sampling": "token", **({"vllm": vllm} if vllm else {})},
        "train": {"micro_batch_size": 4, "global_batch_size": 8, "max_steps": 4, "eval_interval": 2,
                  "output_dir": str(out), "seed": 0, **train},
        "optim": {"lr": 1e-3, "schedule": "constant", "warmup_steps": 0, "weight_decay": 0.0},
        "checkpoint": {"save_interval": 0},
        "logging": {"log_interval": 1, "progress_bar": False, "tensorboard": False, "plot": False},
    }  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    path = out.parent / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _ended(pgid: int, within_s: float) -> bool:
    """Whether no process of group `pgid` is left (zombies aside) within `within_s` seconds."""
    from veomni_lite.engines.vllm.boot import members

    deadline = time.monotonic() + within_s
    while members(pgid) and time.monotonic() < deadline:
        time.sleep(0.2)
    return not members(pgid)


def train(rank: int, world: int, path: str, extra: list[str], hook: str = "") -> str | None:
    """One rank's run of the config at `path`: None when it finishes, the EngineError's message when it fails with one.
    `hook`: "skip_sync" (rank 0 writes the weights only at the first sync), "kill" (rank 0 kills the launched server
    process alone after step 2, then checks, before the run closes anything, that its whole process group ends and
    leaves no shared memory behind), "failover" (`launch: 2`, `max_restarts: 1`, rollout batches of 2 steps: rank 0
    kills the first server's process alone at its 4th sample of the second batch, mid-wave; after step 3 checks that its
    group ended and waits for the relaunched server's /health; checks that it served samples of the third batch; after
    step 6 kills both servers, and checks at the error that no process of any server's group is left)."""
    from veomni_lite.engines.vllm import EngineError, VLLMEngine
    from veomni_lite.engines.vllm.boot import members
    from veomni_lite.rl.trainer import RLTrainer

    if hook == "skip_sync":
        original, calls = VLLMEngine._write, []

        def write_once(self: VLLMEngine, state: Any) -> None:
            calls.append(1)
            if len(calls) == 1:
                original(self, state)

        VLLMEngine._write = write_once  # the negative control: later syncs reload the first weights
    trainer = RLTrainer(load_config(path, extra, world_size=world, sections={"rl": RLConfig}))
    killed: dict[str, Any] = {}
    if hook == "kill":
        step = trainer.train_step

        def kill_after_step_2(micro_batches: list) -> None:
            step(micro_batches)
            if trainer.step == 2 and trainer.engine.servers:
                pgid = trainer.engine.servers[0].pid
                killed.update(pgid=pgid, group=members(pgid), shm=shared_memory(members(pgid)))
                os.kill(pgid, signal.SIGKILL)  # the server process alone: its engine core and the rest live on

        trainer.train_step = kill_after_step_2
    if hook == "failover":
        from veomni_lite.engines.vllm.client import Client

        step, sample = trainer.train_step, Client.sample
        answered: list[tuple[int, str]] = []  # (rollout batch, server URL) of every answered sample

        def failing_sample(self: Client, endpoint: Any, *args: Any) -> Any:
            batch = trainer.step // 2 + 1
            if batch == 2 and "pgid" not in killed and endpoint.server is trainer.engine.servers[0]:
                calls = killed.setdefault("calls", [])
                calls.append(1)
                if len(calls) == 4:  # mid-wave: the server's other samples in flight or queued
                    pgid = endpoint.server.pid
                    killed.update(pgid=pgid, group=members(pgid), shm=shared_memory(members(pgid)))
                    os.kill(pgid, signal.SIGKILL)
            out = sample(self, endpoint, *args)
            answered.append((batch, endpoint.url))
            return out

        def steps_with_faults(micro_batches: list) -> None:
            step(micro_batches)
            if trainer.step == 3 and trainer.engine.servers:
                assert "pgid" in killed and _ended(killed["pgid"], 30), killed
                assert killed["shm"] and not [f for f in killed["shm"] if Path(f).exists()], killed["shm"]
                assert trainer.engine.pool.restarts == 1
                fresh = trainer.engine.servers[0]
                assert fresh.pid != killed["pgid"]
                fresh.wait_ready(900, time.monotonic())  # so that it rejoins at the next sync (the test's timing)
                killed["fresh"] = fresh.url
            if trainer.step == 6 and trainer.engine.servers:
                assert killed["fresh"] in {url for batch, url in answered if batch == 3}, answered
                killed["all"] = [server.pid for server in trainer.engine.servers] + [killed["pgid"]]
                killed["all_shm"] = shared_memory([pid for pgid in killed["all"] for pid in members(pgid)])
                for server in trainer.engine.servers:
                    os.kill(server.pid, signal.SIGKILL)

        Client.sample = failing_sample
        trainer.train_step = steps_with_faults
    try:
        trainer.train()
        return None
    except EngineError as exc:
        for pgid in killed.get("all", []):  # before close()
            assert _ended(pgid, 30), f"a killed server's group lives on: {members(pgid)}"
        if "all" in killed:
            assert killed["all_shm"] and not [f for f in killed["all_shm"] if Path(f).exists()], killed["all_shm"]
        if killed and hook == "kill":  # before close(): the group ends by itself (boot.py's watchdog)
            assert len(killed["group"]) >= 3, killed  # the server, its engine core, the watchdog: a group to end
            assert _ended(killed["pgid"], 30), f"the killed server's group lives on: {members(killed['pgid'])}"
            assert killed["shm"] and not [f for f in killed["shm"] if Path(f).exists()], killed["shm"]
        return str(exc)
    finally:
        trainer.metrics.close()
        if trainer.engine is not None:
            trainer.engine.close()
            for server in getattr(trainer.engine, "servers", []):
                assert server.exited() is not None and not members(server.pid), "a launched server outlived close()"


def keys_by_step(out: Path) -> dict[int, set[str]]:
    steps: dict[int, set[str]] = {}
    for event in read_events(out):
        steps.setdefault(event["step"], set()).update(event)
    return steps


def by_step(out: Path, key: str) -> dict[int, float]:
    return {e["step"]: e[key] for e in read_events(out) if key in e}


# ---------------------------------------------------------------------- without vLLM


def test_rl_vllm_settings_are_checked_by_name(math_demo, tmp_path):
    def config(engine: str, vllm: dict[str, Any]) -> Any:
        path = write_config(math_demo, tmp_path / "out", engine, vllm)
        return load_config(path, [], world_size=1, sections={"rl": RLConfig})

    assert config("vllm", {"url": "http://127.0.0.1:8000"}).rl.vllm.url == "http://127.0.0.1:8000"
    with pytest.raises(ConfigError, match=r"'rl.vllm.request_timeout' \(did you mean `rl.vllm.request_timeout_s`\?\)"):
        config("vllm", {"url": "http://127.0.0.1:8000", "request_timeout": 5})
    with pytest.raises(ConfigError, match="exactly one of url"):
        config("vllm", {"url": "http://127.0.0.1:8000", "launch": True})
    with pytest.raises(ConfigError, match="exactly one of url"):
        config("vllm", {})
    with pytest.raises(ConfigError, match="rl.vllm.request_timeout_s: must be > 0"):
        config("vllm", {"launch": True, "request_timeout_s": 0})
    with pytest.raises(ConfigError, match="rl.vllm: set, but rl.engine is 'transformers'"):
        config("transformers", {"launch": True})
    # several servers: urls (url stays for one), launch as a count, the API key's variable
    from veomni_lite.engines.vllm import VLLMSettings

    urls = ["http://10.0.0.5:8000/", "http://10.0.0.6:8000"]
    assert VLLMSettings.parse({"urls": urls}).server_urls == ["http://10.0.0.5:8000", "http://10.0.0.6:8000"]
    assert VLLMSettings.parse({"url": "http://a:1/"}).server_urls == ["http://a:1"]
    assert [VLLMSettings.parse({"launch": n}).launch for n in (True, 1, 3)] == [1, 1, 3]
    assert VLLMSettings.parse({"launch": 2}).server_urls == []
    assert (
        VLLMSettings.parse({"launch": 2}).max_restarts == 3
        and VLLMSettings.parse({"url": "http://a:1"}).max_restarts == 3
    )
    assert config("vllm", {"urls": urls, "api_key_env": "VLLM_KEY"}).rl.vllm.api_key_env == "VLLM_KEY"
    for bad, message in (
        ({"url": "http://a:1", "urls": urls}, "exactly one of url"),
        ({"launch": 2, "urls": urls}, "exactly one of url"),
        ({"launch": False}, "exactly one of url"),
        ({"launch": -1}, r"rl.vllm.launch: true or a count of servers to start \(>= 1\), got -1"),
        ({"launch": "many"}, "rl.vllm.launch: expected bool or int, got 'many'"),
        ({"urls": [3]}, "rl.vllm.urls: expected a string or a list of strings, got"),
        ({"urls": ["http://a:1", "ftp://b:2"]}, "rl.vllm.urls: must start with http:// or https://, got 'ftp://b:2'"),
        ({"urls": ["http://a:1", "http://a:1/"]}, "rl.vllm.urls: a server is listed twice"),
        ({"launch": True, "api_key_env": "MY-KEY"}, "rl.vllm.api_key_env: the name of an environment variable"),
        ({"launch": 2, "max_restarts": -1}, r"rl.vllm.max_restarts: must be an integer >= 0, got -1"),
        ({"launch": 2, "max_restarts": "many"}, "rl.vllm.max_restarts: expected int, got 'many'"),
    ):
        with pytest.raises(ConfigError, match=message):
            config("vllm", bad)


def test_requests_are_spread_in_contiguous_shares():
    from veomni_lite.engines.vllm import spread

    assert spread(12, 2) == [range(0, 6), range(6, 12)]
    assert spread(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]
    assert spread(1, 3) == [range(0, 1), range(1, 1), range(1, 1)]
    assert spread(5, 1) == [range(0, 5)]
    for count in range(20):
        for servers in range(1, 5):
            shares = spread(count, servers)
            assert [r for share in shares for r in share] == list(range(count))
            assert max(map(len, shares)) - min(map(len, shares)) <= 1


def test_the_sync_check_refuses_a_skipped_sync_and_never_a_noisy_one():
    """`SyncCheck` on synthetic probes of 40 tokens. An engine that takes every update but sits ever further from the
    trainer (its mean gap grows to 0.15, seven times the old fixed tolerance of 0.02, and its noise changes at every
    sync), with trainer moves both far below and far above that noise, passes 300 syncs. Controls: the same engine
    frozen from sync 150 on (a reload that did not apply) is refused, with 0% followed, at the first sync whose
    trainer has moved 4 noise widths from the last deciding one; an engine that moves elsewhere is refused; a first
    sync beyond the tolerance (another model) is refused."""
    from veomni_lite.engines.vllm import SyncCheck

    generator = torch.Generator().manual_seed(0)

    def randn() -> torch.Tensor:
        return torch.randn(40, generator=generator, dtype=torch.float64)

    pattern, trainer = randn(), -3 + randn()
    runs = {"applied": SyncCheck(0.1), "frozen": SyncCheck(0.1)}
    frozen, refused, decided = None, {}, 0
    for version in range(300):
        trainer = trainer + randn() * (0.002 if version % 3 else 0.3)  # two moves in three far below the noise
        gap = 0.01 + 0.19 * version / 299
        engine = trainer + gap * (pattern + 0.2 * randn())
        frozen = engine if version < 150 or frozen is None else frozen
        for name, values in (("applied", engine), ("frozen", frozen)):
            if name not in refused:
                problem = runs[name](version, values.tolist(), trainer.tolist())
                if problem is not None:
                    refused[name] = (version, problem)
        decided += runs["applied"].followed is not None
    assert "applied" not in refused, refused["applied"]
    print(f"\nsynthetic: {decided} of 300 syncs decided; the last mean gap {runs['applied'].gap:.3f}")
    assert runs["applied"].gap > 0.1 and decided > 20  # far beyond any fixed tolerance, and decided often
    version, problem = refused["frozen"]
    print(f"\nsynthetic: the frozen engine was refused at sync {version}: {problem}")
    assert 150 < version < 300 and "the engine followed 0% of the trainer's change" in problem
    assert "does not serve the trainer's weights (a reload that did not apply)" in problem
    check = SyncCheck(0.1)
    assert check(0, trainer.tolist(), trainer.tolist()) is None
    elsewhere = trainer + 0.5 * randn()  # the trainer moves one way, the engine another
    assert "followed" in check(1, (trainer + 0.5 * randn()).tolist(), elsewhere.tolist())
    problem = SyncCheck(0.1)(0, (trainer + 1.0).tolist(), trainer.tolist())
    assert "at its first sync (version 0)" in problem and "mean |diff| 1 " in problem, problem


class _FailingServer(BaseHTTPRequestHandler):
    """A fake vLLM: serves its model list and the weight routes, answers every completion with HTTP 500 (after
    `hang_s` seconds)."""

    hang_s = 0.0

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self._answer(200, {"data": [{"id": "fake"}]})

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path == "/v1/completions":
            time.sleep(self.hang_s)
            self._answer(500, {"error": "boom: the fake engine fails every completion"})
        else:
            self._answer(200, {"results": [None]})

    def _answer(self, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # a client that timed out has gone
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


def _train_against(handler: type, demo: Path, out: Path, **vllm: Any) -> list[str | None]:
    """Each of 2 ranks' `train` outcome against a fake server answering with `handler`, at `rl.vllm` + `vllm`."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        return run_distributed(train, 2, str(write_config(demo, out, "vllm", {"url": url, **vllm})), [], timeout_s=600)
    finally:
        server.shutdown()


@pytest.mark.slow
def test_an_engine_that_refuses_or_answers_an_error_is_a_named_error_on_every_rank(math_demo, tmp_path):
    from veomni_lite.engines.vllm import free_port

    refused = write_config(math_demo, tmp_path / "refused", "vllm", {"url": f"http://127.0.0.1:{free_port()}"})
    errors = run_distributed(train, 2, str(refused), [], timeout_s=600)
    for message in errors:
        assert message is not None and "vLLM engine" in message and "weight sync of version 0" in message, message
        assert "GET /v1/models" in message and "Connection refused" in message, message
    errors = _train_against(_FailingServer, math_demo, tmp_path / "failing", request_timeout_s=30)
    for message in errors:
        assert message is not None and "rank 0: vLLM engine at http://127.0.0.1" in message, message
        assert "prompt log-probabilities of the probe" in message and "answered HTTP 500" in message, message
        assert "boom" in message, message


@pytest.mark.slow
def test_an_engine_that_does_not_answer_in_time_is_a_named_error_on_every_rank(math_demo, tmp_path):
    hanging = type("Hanging", (_FailingServer,), {"hang_s": 10.0})
    errors = _train_against(hanging, math_demo, tmp_path / "hanging", request_timeout_s=2)
    for message in errors:
        assert message is not None and "rank 0: vLLM engine at http://127.0.0.1" in message, message
        assert "(POST /v1/completions) failed: no answer within rl.vllm.request_timeout_s = 2 s" in message, message


class _ChatServer(_FailingServer):
    """A fake vLLM's chat route: records each request's body and answers with `rendered` as the prompt's ids and two
    response tokens."""

    rendered: list[int] = []
    bodies: list[dict[str, Any]] = []

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
        type(self).bodies.append({"route": self.path, **body})
        choice = {"token_ids": [5, 6], "finish_reason": "length",
                  "logprobs": {"content": [{"logprob": -1.5}, {"logprob": -0.5}]}}  # fmt: skip
        self._answer(200, {"choices": [choice], "prompt_token_ids": self.rendered})


def test_vision_language_prompts_go_to_the_chat_route_with_their_pixels_and_are_checked(families_demo, tmp_path):
    """Without vLLM: a VL prompt's chat fields carry the trainer's decoded pixels losslessly; the engine sends them to
    /v1/chat/completions and refuses a rendering other than the trainer's, naming where it differs."""
    import base64
    import io

    import numpy as np
    from PIL import Image

    from veomni_lite.data.checks import DataError
    from veomni_lite.data.sft import ChatEncoder, image_reference, open_image
    from veomni_lite.data.sft_dataset import ImageProcessing
    from veomni_lite.engines.base import RolloutRequest, SamplingSettings
    from veomni_lite.engines.vllm import EngineError, VLLMEngine, VLLMSettings
    from veomni_lite.models.pretrained import load_image_processor, load_tokenizer
    from veomni_lite.rl.prompts import chat_fields, encode_row
    from veomni_lite.rl.trainer import RLTrainer

    model, digits = families_demo / "models" / "qwen2_vl", families_demo / "digits"
    encoder = ChatEncoder(load_tokenizer(model), "", False, "<|image_pad|>", model)
    row = json.loads((digits / "train.jsonl").read_text().splitlines()[0])
    images = ImageProcessing(load_image_processor(model))
    assert encode_row(row, "row 0", encoder, images, "messages", {}, digits).images == []  # kept only when asked
    prompt = encode_row(row, "row 0", encoder, images, "messages", {}, digits, keep_images=True)
    fields = chat_fields(prompt)
    assert sorted(fields) == ["add_generation_prompt", "messages"] and len(fields["messages"]) == 1  # no answer turn
    image_part, text_part = fields["messages"][0]["content"]
    assert text_part == row["messages"][0]["content"][1]
    url = image_part["image_url"]["url"]
    sent = Image.open(io.BytesIO(base64.b64decode(url.removeprefix("data:image/png;base64,"))))
    decoded = open_image(image_reference(row["images"][0], digits, "row 0"), "row 0")  # the trainer's pixels (RGB)
    assert np.array_equal(np.asarray(sent), np.asarray(decoded))
    assert chat_fields(prompt, "{{ messages }}", "<|image_pad|>")["chat_template_kwargs"] == {
        "image_token": "<|image_pad|>"
    }
    with pytest.raises(ValueError, match="row 1: no chat messages kept"):
        chat_fields(encode_row({"text": "plain"}, "row 1", encoder, None, "text", {}, digits, keep_images=True))
    args = ["--model.pretrained_dir", str(model), "--data.train_path", str(digits / "train.jsonl"), "--data.format",
            "text", "--rl.rewards", "[{name: c, function: exact_match}]", "--rl.engine", "vllm", "--rl.vllm",
            "{url: 'http://127.0.0.1:1'}", "--train.output_dir", str(tmp_path)]  # fmt: skip
    with pytest.raises(DataError, match="data.format: text has no chat messages, which rl.engine: vllm sends"):
        RLTrainer(load_config(None, args, world_size=1, sections={"rl": RLConfig}))

    server = ThreadingHTTPServer(("127.0.0.1", 0), _ChatServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        engine = VLLMEngine(VLLMSettings.parse({"url": url}), str(model), None, None, [1, 2], renders_prompts=True)
        settings = SamplingSettings(max_new_tokens=2, suppress_ids=(7,))
        request = RolloutRequest(prompt.ids, [3, 4], prompt.model_inputs, fields)
        _ChatServer.rendered = list(prompt.ids)
        rollouts = engine.generate([request], settings)[0]
        assert [(r.response_ids, r.logprobs, r.finish_reason) for r in rollouts] == [
            ([5, 6], [-1.5, -0.5], "length")
        ] * 2
        body = _ChatServer.bodies[-1]
        assert body["route"] == "/v1/chat/completions" and body["messages"] == fields["messages"]
        assert body["logprobs"] is True and body["return_token_ids"] and body["logit_bias"] == {"7": -100.0}
        assert sorted(b["seed"] for b in _ChatServer.bodies) == [3, 4] and "prompt" not in body
        _ChatServer.rendered = [*prompt.ids[:5], 0, *prompt.ids[6:]]
        with pytest.raises(EngineError, match=rf"rendered the prompt as {len(prompt.ids)} tokens, the trainer as "
                           rf"{len(prompt.ids)}; first difference at position 5 \(server \[0\]"):  # fmt: skip
            engine.generate([request], settings)
        with pytest.raises(EngineError, match="request 0 has images but no chat fields"):
            engine.generate([RolloutRequest(prompt.ids, [1], prompt.model_inputs)], settings)
        engine.close()
    finally:
        server.shutdown()


_ARRIVAL = threading.Lock()


class _Completions(BaseHTTPRequestHandler):
    """A fake vLLM that answers like one: /v1/models, the weight routes, a sample as a function of its prompt and seed
    alone, and a probe's prompt log-probabilities as a function of the prompt (`fake_logprobs`). It records each
    request's route, Authorization header and body in `seen` (a list per subclass: one per server); with `failing`,
    every sample is an HTTP 500; with `dies_after` N, the server dies at its sample N + 1: it closes that connection
    unanswered and stops listening."""

    seen: list[tuple[str, str, dict[str, Any]]] = []
    failing = False
    dies_after: int | None = None

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        type(self).seen.append((self.path, self.headers.get("Authorization", ""), {}))
        self._answer(200, {"data": [{"id": "fake"}]})

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        with _ARRIVAL:  # `seen` in the order the samples are counted
            type(self).seen.append((self.path, self.headers.get("Authorization", ""), body))
            samples = sum("seed" in seen for _, _, seen in self.seen)
        if self.dies_after is not None and samples > self.dies_after:
            self.close_connection = True
            threading.Thread(target=lambda: (self.server.shutdown(), self.server.server_close())).start()
            return None
        if self.failing and self.path == "/v1/completions" and body.get("prompt_logprobs") is None:
            return self._answer(500, {"error": "boom"})
        self._answer(200, answer(self.path, body))

    _answer = _FailingServer._answer
    log_message = _FailingServer.log_message


@contextlib.contextmanager
def _fakes(count: int, failing: tuple[int, ...] = ()) -> Any:
    """`count` fake servers (`_Completions`, each its own `seen`) on loopback: yields their handler classes and URLs."""
    handlers = [type(f"Fake{k}", (_Completions,), {"seen": [], "failing": k in failing}) for k in range(count)]
    servers = [ThreadingHTTPServer(("127.0.0.1", 0), handler) for handler in handlers]
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield handlers, [f"http://127.0.0.1:{server.server_address[1]}" for server in servers]
    finally:
        for server in servers:
            server.shutdown()


def test_a_wave_is_spread_over_several_servers_each_synced_with_the_key(tmp_path, monkeypatch):
    """Without vLLM: `rl.vllm.urls` of two fake servers. A sync reloads, resets and probes each; a wave's 12 samples
    go 6 and 6, a prompt's samples together where the shares allow, and come back in order, equal to one server's;
    every request carries the API key `api_key_env` names. A server that fails or refuses is an EngineError naming its
    URL; an unset key variable is an EngineError naming it."""
    from veomni_lite.engines.base import RolloutRequest, SamplingSettings
    from veomni_lite.engines.vllm import EngineError, VLLMEngine, VLLMSettings

    monkeypatch.setenv("TEST_VLLM_KEY", "s3cret")
    requests = [RolloutRequest([5, 6, 7], [1, 2, 3, 4]), RolloutRequest([8, 9], [5, 6, 7, 8]),
                RolloutRequest([1, 2, 3, 4], [9, 10, 11, 12])]  # fmt: skip
    sampling = SamplingSettings(max_new_tokens=3)

    def engine(urls: list[str]) -> VLLMEngine:
        settings = VLLMSettings.parse({"urls": urls, "api_key_env": "TEST_VLLM_KEY", "sync_dir": str(tmp_path)})
        return VLLMEngine(settings, str(tmp_path), None, fake_logprobs, [11, 12, 13, 14])

    with _fakes(2) as (handlers, urls):
        two = engine(urls)
        two.sync_weights({"w": torch.ones(2)}, 0)
        for handler in handlers:
            routes = [route for route, _, _ in handler.seen]
            assert routes == ["/v1/models", "/collective_rpc", "/reset_prefix_cache", "/v1/completions"], routes
        spread_rollouts = two.generate(requests, sampling)
        one = engine(urls[:1])
        one.sync_weights({"w": torch.ones(2)}, 0)
        alone = one.generate(requests, sampling)
        assert [[(r.response_ids, r.logprobs) for r in g] for g in spread_rollouts] == [
            [(r.response_ids, r.logprobs) for r in g] for g in alone
        ]
        assert [len(g) for g in spread_rollouts] == [4, 4, 4]
        served = [sorted(body["seed"] for route, _, body in h.seen if "seed" in body) for h in handlers]
        assert served[1] == [7, 8, 9, 10, 11, 12]  # the second half of the wave's samples
        assert sorted(served[0]) == [1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 8, 9, 10, 11, 12]  # its half, then all
        keys = {key for handler in handlers for _, key, _ in handler.seen}
        assert keys == {"Bearer s3cret"}  # on every request, the weight routes included
        two.close()
        one.close()
    with _fakes(2, failing=(1,)) as (_, urls):
        failing = engine(urls)
        failing.sync_weights({"w": torch.ones(2)}, 0)
        with pytest.raises(EngineError, match=rf"vLLM engine at {urls[1]}: rank 0's request 1, sample [0-3] "
                           r"\(prompt of 2 tokens\) \(POST /v1/completions\) answered HTTP 500"):  # fmt: skip
            failing.generate(requests, sampling)
        failing.close()
    from veomni_lite.engines.vllm import free_port

    with _fakes(1) as (_, urls):
        refused = engine([urls[0], f"http://127.0.0.1:{free_port()}"])
        with pytest.raises(EngineError, match=r"vLLM engine at http://127.0.0.1:\d+: list the served models \(GET "
                           r"/v1/models\) failed: .*Connection refused") as caught:  # fmt: skip
            refused.sync_weights({"w": torch.ones(2)}, 0)
        assert urls[0] not in str(caught.value)
        refused.close()
    monkeypatch.delenv("TEST_VLLM_KEY")
    with pytest.raises(EngineError, match="rl.vllm.api_key_env names the environment variable TEST_VLLM_KEY, which "
                       "is unset or empty on rank 0"):  # fmt: skip
        engine(["http://127.0.0.1:1"])


def _rollouts(results: list[list[Any]]) -> list[list[tuple[list[int], list[float], str]]]:
    return [[(r.response_ids, r.logprobs, r.finish_reason) for r in group] for group in results]


def test_a_dead_servers_samples_go_to_the_others_with_their_seeds_and_it_rejoins(tmp_path):
    """Without vLLM: three fake servers as `urls`; the second dies at its third sample, mid-wave (that connection closed
    unanswered, then nothing listening). The wave's rollouts equal those of the three alive (and of one server alone):
    the dead server's samples went to the others with their own seeds. Control: other seeds give other rollouts, so a
    failover that lost a sample's seed would fail. The server, listening again on its port, rejoins before the next
    wave: it reloads the synced weights, passes its probe check, and serves its share again. Every server dead: an
    EngineError saying no server is left, naming the last failure."""
    from veomni_lite.engines.base import RolloutRequest, SamplingSettings
    from veomni_lite.engines.vllm import EngineError, VLLMEngine, VLLMSettings

    requests = [RolloutRequest([5 + i, 6, 7], [4 * i + j for j in range(4)]) for i in range(4)]  # 16 samples
    sampling = SamplingSettings(max_new_tokens=3)

    def engine(urls: list[str]) -> VLLMEngine:
        made = VLLMEngine(VLLMSettings.parse({"urls": urls, "sync_dir": str(tmp_path)}), str(tmp_path), None,
                          fake_logprobs, [11, 12, 13, 14])  # fmt: skip
        made.sync_weights({"w": torch.ones(2)}, 0)
        return made

    with _fakes(3) as (_, urls):
        healthy = engine(urls)
        expected = _rollouts(healthy.generate(requests, sampling))
        reseeded = [RolloutRequest(r.prompt_ids, [seed + 100 for seed in r.seeds]) for r in requests]
        assert _rollouts(healthy.generate(reseeded, sampling)) != expected  # the control
        healthy.close()
        alone = engine(urls[:1])
        assert _rollouts(alone.generate(requests, sampling)) == expected
        alone.close()
    with _fakes(3) as (handlers, urls):
        handlers[1].dies_after = 2
        failing = engine(urls)
        assert _rollouts(failing.generate(requests, sampling)) == expected
        samples = [[body["seed"] for _, _, body in h.seen if "seed" in body] for h in handlers]  # in arrival order
        answered = samples[1][:2]  # the dead server's first two; it dropped the third and any after
        assert len(samples[1]) >= 3 and sorted(samples[0] + samples[2]) == sorted(set(range(16)) - set(answered))
        assert [e.state for e in failing.endpoints] == ["serving", "joining", "serving"]
        # back on its port: it rejoins before the next wave, on the synced weights
        handlers[1].seen, handlers[1].dies_after = [], None
        port = int(urls[1].rsplit(":", 1)[1])
        back = ThreadingHTTPServer(("127.0.0.1", port), handlers[1])
        threading.Thread(target=back.serve_forever, daemon=True).start()
        try:
            assert _rollouts(failing.generate(requests, sampling)) == expected
            routes = [route for route, _, body in handlers[1].seen if "seed" not in body]
            assert routes == ["/v1/models", "/collective_rpc", "/reset_prefix_cache", "/v1/completions"], routes
            assert len([body for _, _, body in handlers[1].seen if "seed" in body]) == 5  # its share of 16 on 3
            assert [e.state for e in failing.endpoints] == ["serving"] * 3
        finally:
            back.shutdown()
            back.server_close()
        for handler in handlers:
            handler.dies_after = 0
        with pytest.raises(EngineError, match=r"vLLM engine: no server left of 3; the last failure: vLLM engine at "
                           r"http://127.0.0.1:\d+: rank 0's request \d, sample \d \(prompt of 3 tokens\)"):  # fmt: skip
            failing.generate(requests, sampling)
        failing.close()


@pytest.mark.slow
def test_a_server_dying_mid_run_changes_no_rollout_on_any_rank(math_demo, tmp_path):
    """Without vLLM, 2 ranks, `urls` of two fake servers (a sample a function of its prompt and seed): the second dies
    at its 13th sample, mid-wave in the second rollout batch (16 samples a batch, 8 a server). The run's rollouts
    (rollouts.jsonl: both ranks' samples) and losses equal the run's with both alive. Both servers dying in the second
    batch: the same named error on both ranks, "no server left"."""
    vllm = {"probe_tolerance": 100.0, "request_timeout_s": 60}  # the fake's probe is not the model's: no check
    samples = {}

    def run(name: str, dies_after: tuple[int | None, int | None]) -> list[str | None]:
        with _fakes(2) as (handlers, urls):
            for handler, after in zip(handlers, dies_after):
                handler.dies_after = after
            config = write_config(math_demo, tmp_path / name, "vllm", {"urls": urls, **vllm}, eval_interval=0)
            errors = run_distributed(train, 2, str(config), ["--rl.rollouts_sample", "16"], timeout_s=600)
            samples[name] = [sum("seed" in body for _, _, body in handler.seen) for handler in handlers]
            return errors

    assert run("healthy", (None, None)) == [None, None]
    assert run("failing", (None, 12)) == [None, None]
    assert samples["healthy"] == [16, 16] and samples["failing"][0] == 20  # the other took the 4 left unanswered
    assert samples["failing"][1] >= 13  # its 13th and any arriving after were dropped
    losses = [by_step(tmp_path / name, "train/policy_loss") for name in ("healthy", "failing")]
    assert sorted(losses[0]) == [1, 2, 3, 4] and losses[1] == losses[0]
    rows = [(tmp_path / name / "rollouts.jsonl").read_text().splitlines() for name in ("healthy", "failing")]
    assert len(rows[0]) == 4 * 16 and rows[1] == rows[0]
    errors = run("dead", (10, 10))
    assert errors[0] == errors[1] and "vLLM engine: generate: rank 0: vLLM engine: no server left of 2; the last " \
        "failure: vLLM engine at http://127.0.0.1:" in errors[0], errors  # fmt: skip
    assert sorted(by_step(tmp_path / "dead", "train/policy_loss")) == [1, 2]


@pytest.fixture
def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> Any:
    """`VLLMServer` runs tests/rl/fake_vllm_server.py in place of vLLM (an "engine core" child that outlives it)."""
    from veomni_lite.engines.vllm import VLLMServer

    monkeypatch.setattr(VLLMServer, "MODULE", "tests.rl.fake_vllm_server")
    return VLLMServer


def _started(server_class: Any, tmp_path: Path, name: str) -> Any:
    import sys

    from veomni_lite.engines.vllm.boot import members

    server = server_class(sys.executable, str(tmp_path), tmp_path / f"{name}.log")
    server.wait_ready(120, time.monotonic())
    deadline = time.monotonic() + 30
    while len(members(server.pid)) < 3 and time.monotonic() < deadline:  # the server, its core, the watchdog
        time.sleep(0.1)
    assert len(members(server.pid)) >= 3, members(server.pid)
    return server


def test_a_launched_servers_process_group_ends_however_the_server_ends(fake_vllm, tmp_path):
    """Without vLLM (a stand-in server with an "engine core" child): the server killed alone, the server given
    SIGTERM, the server's trainer killed, and `stop()` of a running server: each time no process of its group is left
    (by itself, before any stop() in the first three). Control: the same stand-in started in a session of its own but
    without boot.py's watchdog leaves its engine core behind when killed."""
    import subprocess
    import sys

    from veomni_lite.engines.vllm.boot import end_group, members

    killed = _started(fake_vllm, tmp_path, "killed")
    os.kill(killed.pid, signal.SIGKILL)
    assert killed.exited(wait_s=10) == -signal.SIGKILL and _ended(killed.pid, 30), members(killed.pid)
    killed.stop()
    assert killed.exited() == -signal.SIGKILL
    terminated = _started(fake_vllm, tmp_path, "terminated")
    os.kill(terminated.pid, signal.SIGTERM)
    assert terminated.exited(wait_s=10) == 0 and _ended(terminated.pid, 30), members(terminated.pid)
    terminated.stop()
    stopped = _started(fake_vllm, tmp_path, "stopped")
    stopped.stop()
    assert not members(stopped.pid) and stopped.exited() == 0
    # the trainer killed: a process that launched a server and waits
    script = (
        "import sys, time\nfrom veomni_lite.engines.vllm import VLLMServer\n"
        "VLLMServer.MODULE = 'tests.rl.fake_vllm_server'\n"
        f"server = VLLMServer(sys.executable, '.', {str(tmp_path / 'orphan.log')!r})\n"
        "server.wait_ready(120, time.monotonic())\nprint(server.pid, flush=True)\ntime.sleep(600)\n"
    )
    trainer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pgid = int(trainer.stdout.readline())
        deadline = time.monotonic() + 30
        while len(members(pgid)) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(members(pgid)) >= 3
        trainer.kill()
        assert _ended(pgid, 30), members(pgid)
    finally:
        trainer.kill()
        trainer.wait()
        for line in (tmp_path / "orphan.log").read_text().splitlines():  # killed with its trainer: nobody unlinks it
            if ", shared memory " in line:
                Path(line.split(", shared memory ")[1]).unlink(missing_ok=True)
    # control: without the watchdog, the engine core outlives its killed server
    from veomni_lite.engines.vllm import free_port

    plain = subprocess.Popen([sys.executable, "-m", "tests.rl.fake_vllm_server", "--port", str(free_port())],
                             start_new_session=True, stdout=subprocess.DEVNULL)  # fmt: skip
    segments: set[str] = set()
    try:
        deadline = time.monotonic() + 30
        while len(members(plain.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        deadline = time.monotonic() + 30
        while not segments and time.monotonic() < deadline:
            segments = shared_memory([plain.pid])
            time.sleep(0.1)
        plain.kill()
        plain.wait()
        assert not _ended(plain.pid, 3) and len(members(plain.pid)) == 1  # the orphaned engine core
    finally:
        end_group(plain.pid, grace_s=1)
    assert _ended(plain.pid, 10)
    assert segments and all(Path(f).exists() for f in segments)  # killed: its shared memory left behind
    for f in segments:
        os.unlink(f)


def test_end_group_kills_what_ignores_sigterm(tmp_path):
    import subprocess
    import sys

    from veomni_lite.engines.vllm.boot import end_group, members

    stubborn = (
        "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint(1, flush=True)\ntime.sleep(600)"
    )
    process = subprocess.Popen([sys.executable, "-c", stubborn], start_new_session=True, stdout=subprocess.PIPE)
    process.stdout.readline()  # SIGTERM is ignored from here on
    end_group(process.pid, grace_s=1.0)
    assert process.wait(timeout=10) == -signal.SIGKILL
    assert not members(process.pid)


def test_a_dead_launched_server_is_named_dead_not_running(fake_vllm, tmp_path):
    """A launched server killed a moment before a request, with no relaunch (`max_restarts: 0`) and no other server:
    the EngineError says no server is left and names the server and its exit code."""
    import sys

    from veomni_lite.engines.base import RolloutRequest, SamplingSettings
    from veomni_lite.engines.vllm import EngineError, VLLMEngine, VLLMSettings
    from veomni_lite.engines.vllm.boot import members

    settings = VLLMSettings.parse({"launch": 1, "python": sys.executable, "sync_dir": str(tmp_path), "max_restarts": 0})
    engine = VLLMEngine(settings, str(tmp_path), None, fake_logprobs, [1, 2], tmp_path / "vllm_server.log")
    try:
        engine._ready()
        (server,) = engine.servers
        os.kill(server.pid, signal.SIGKILL)
        with pytest.raises(EngineError) as caught:
            engine.generate([RolloutRequest([1, 2, 3], [1])], SamplingSettings(max_new_tokens=2))
        message = str(caught.value)
        assert "no server left of 1; relaunches used: 0 of rl.vllm.max_restarts = 0; the last failure:" in message
        assert f"vLLM engine at {server.url}: rank 0's request 0, sample 0" in message, message
        assert f"(launched server pid {server.pid} exited with code -9; log {tmp_path / 'vllm_server.log'})" in message
        assert "still running" not in message
    finally:
        engine.close()
    assert not members(server.pid)


def test_a_killed_launched_server_is_relaunched_synced_and_rejoins(fake_vllm, tmp_path):
    """Without vLLM (`launch: 2` of the stand-in, `max_restarts: 1`): the first server killed (SIGKILL) before a wave:
    the wave's rollouts equal those before (its samples went to the other server with their seeds), nothing of its
    process group is left, and a new server is started in its place, which once up reloads the synced weights and
    serves its share of the next wave (its log: its pid, each route and seed). Both killed, the relaunch used: an
    EngineError saying no server is left, and no process of any server's group left."""
    import sys

    from veomni_lite.engines.base import RolloutRequest, SamplingSettings
    from veomni_lite.engines.vllm import EngineError, VLLMEngine, VLLMSettings
    from veomni_lite.engines.vllm.boot import members

    settings = VLLMSettings.parse(
        {"launch": 2, "python": sys.executable, "sync_dir": str(tmp_path), "max_restarts": 1, "start_timeout_s": 120}
    )
    engine = VLLMEngine(settings, str(tmp_path), None, fake_logprobs, [1, 2, 3], tmp_path / "vllm_server.log")
    requests = [RolloutRequest([5 + i, 6, 7], [4 * i + j for j in range(4)]) for i in range(3)]  # 12 samples
    sampling = SamplingSettings(max_new_tokens=3)
    groups = []
    try:
        engine.sync_weights({"w": torch.ones(2)}, 0)
        expected = _rollouts(engine.generate(requests, sampling))
        killed, other = engine.servers
        groups += [killed.pid, other.pid]
        (segment,) = shared_memory(members(killed.pid))
        os.kill(killed.pid, signal.SIGKILL)
        assert _rollouts(engine.generate(requests, sampling)) == expected
        assert engine.pool.restarts == 1 and _ended(killed.pid, 30), members(killed.pid)
        assert not Path(segment).exists()  # killed before it unlinked it (the control below): stop() did
        fresh = engine.servers[0]
        groups.append(fresh.pid)
        assert fresh.pid != killed.pid and engine.servers[1] is other and fresh.log_path == killed.log_path
        fresh.wait_ready(120, time.monotonic())
        assert _rollouts(engine.generate(requests, sampling)) == expected
        served = [
            line.split()[1:] for line in fresh.log_path.read_text().splitlines() if line.startswith(f"{fresh.pid} ")
        ]
        assert served[:3] == [["/collective_rpc"], ["/reset_prefix_cache"], ["/v1/completions"]], served
        assert sorted(int(seed) for _, seed in served[3:]) == list(range(6))  # the first half of the 12 samples
        assert [e.state for e in engine.endpoints] == ["serving", "serving"]
        for server in engine.servers:
            os.kill(server.pid, signal.SIGKILL)
        with pytest.raises(EngineError, match=r"no server left of 2; relaunches used: 1 of rl.vllm.max_restarts = 1; "
                           r"the last failure: vLLM engine at .* exited with code -9"):  # fmt: skip
            engine.generate(requests, sampling)
        assert all(_ended(pgid, 30) for pgid in groups), [members(pgid) for pgid in groups]
    finally:
        engine.close()
    assert not [members(pgid) for pgid in groups if members(pgid)]


# ---------------------------------------------------------------------- with vLLM


def _plain_model(demo: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(demo / "model"), dtype=torch.float32).eval()


@pytest.mark.vllm
@pytest.mark.slow
@requires_vllm
def test_the_engine_samples_with_the_trainers_log_probabilities(math_demo, vllm_server):
    from veomni_lite.engines.base import RolloutRequest, SamplingSettings
    from veomni_lite.engines.vllm import VLLMEngine, VLLMSettings

    model = _plain_model(math_demo)

    def reference(ids: list[int]) -> list[float]:
        with torch.no_grad():
            logp = model(torch.tensor([ids])).logits[0].double().log_softmax(-1)
        return [logp[t - 1, ids[t]].item() for t in range(1, len(ids))]

    settings = VLLMSettings.parse({"url": vllm_server.url, "probe_tolerance": 1e-4})
    engine = VLLMEngine(settings, str(math_demo / "model"), None, reference, list(range(3, 40)))
    engine.sync_weights(model.state_dict(), 0)
    print(f"\nprobe mean |engine - trainer| log-prob after sync (float32): {engine.last_probe_diff:.2e}")
    assert engine.last_probe_diff < 1e-5
    stops = (10, 20, 30, 40, 50, 60, 70, 80, 90, 100)
    sampling = SamplingSettings(max_new_tokens=24, temperature=TEMPERATURE, stop_ids=stops)
    requests = [RolloutRequest([1, 5, 9, 33, 40, 12], [1, 2, 3, 4]), RolloutRequest([7, 8, 9], [5, 6])]
    rollouts = engine.generate(requests, sampling)
    assert [len(group) for group in rollouts] == [4, 2]
    diffs, reasons = [], set()
    for request, group in zip(requests, rollouts):
        for rollout in group:
            full = request.prompt_ids + rollout.response_ids
            with torch.no_grad():
                logp = (model(torch.tensor([full])).logits[0].double() / TEMPERATURE).log_softmax(-1)
            start = len(request.prompt_ids)
            diffs += [abs(logp[t - 1, full[t]].item() - rollout.logprobs[t - start]) for t in range(start, len(full))]
            reasons.add(rollout.finish_reason)
            if rollout.finish_reason == "stop":
                assert rollout.response_ids[-1] in stops and not set(rollout.response_ids[:-1]) & set(stops)
            else:
                assert len(rollout.response_ids) == 24 and not set(rollout.response_ids) & set(stops)
    mean = sum(diffs) / len(diffs)
    print(f"sampled tokens' mean |engine - plain forward| log-prob (T={TEMPERATURE}, float32): {mean:.2e}")
    assert mean < 1e-5 and max(diffs) < 1e-4
    assert reasons == {"stop", "length"}  # both endings seen (the stop ids are a tenth of the vocabulary)
    again = engine.generate(requests, sampling)
    assert [[r.response_ids for r in g] for g in again] == [[r.response_ids for r in g] for g in rollouts]
    # With top-k, vLLM's processed log-probabilities are of the filtered distribution, renormalized (docs/vllm.md)
    filtered = SamplingSettings(max_new_tokens=8, temperature=TEMPERATURE, top_k=5)
    for request, group in zip(requests, engine.generate(requests, filtered)):
        for rollout in group:
            full = request.prompt_ids + rollout.response_ids
            with torch.no_grad():
                logits = model(torch.tensor([full])).logits[0].double() / TEMPERATURE
            kept = logits.masked_fill(logits < logits.topk(5, dim=-1).values[:, -1:], float("-inf")).log_softmax(-1)
            start = len(request.prompt_ids)
            for t in range(start, len(full)):
                assert kept[t - 1, full[t]].item() == pytest.approx(rollout.logprobs[t - start], abs=1e-4)
                assert logits.log_softmax(-1)[t - 1, full[t]].item() < rollout.logprobs[t - start] - 1e-3
    engine.close()


@pytest.mark.vllm
@pytest.mark.slow
@requires_vllm
def test_vllm_and_embedded_engines_train_the_same_steps_with_the_same_metrics(math_demo, vllm_server, tmp_path):
    vllm = {"url": vllm_server.url, "probe_tolerance": 1e-4}
    runs = {
        "vllm": write_config(math_demo, tmp_path / "vllm", "vllm", vllm),
        "transformers": write_config(math_demo, tmp_path / "transformers", "transformers"),
    }
    for path in runs.values():
        assert run_distributed(train, 2, str(path), [], timeout_s=900) == [None, None]
    keys = {name: keys_by_step(tmp_path / name) for name in runs}
    assert sorted(keys["vllm"]) == sorted(keys["transformers"]) == [1, 2, 3, 4]
    assert keys["vllm"] == keys["transformers"]
    assert {"rl/logprob_diff", "rl/importance_ratio/mean", "rl/reward/mean", "eval/reward"} <= keys["vllm"][1]
    diff = by_step(tmp_path / "vllm", "rl/logprob_diff")
    print(f"\nrl/logprob_diff (mean |trainer - engine| of the sampled tokens) per step: {diff}")
    assert sorted(diff) == [1, 3] and all(value < 1e-5 for value in diff.values())  # one value per rollout batch
    ratio = by_step(tmp_path / "vllm", "rl/importance_ratio/mean")
    assert all(abs(value - 1) < 1e-4 for value in ratio.values())


TALKER = """
class Talker:
    def reset(self, row):
        self.turns = 0
        return ""

    def step(self, text):
        self.turns += 1
        return "go on", 0.5 * self.turns, self.turns == 2
"""


def _ending_model(source: Path, out: Path) -> Path:
    """`source`'s model made to end its turns: the final norm keeps one dimension, where the end-of-turn row of the LM
    head reads +20 and every other row -20, so about every other position samples `<|im_end|>` (a random model
    seldom ends a turn, and an episode needs ended turns to go on)."""
    import shutil

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(source))
    end = AutoTokenizer.from_pretrained(str(source)).convert_tokens_to_ids("<|im_end|>")
    with torch.no_grad():
        model.model.norm.weight.zero_()
        model.model.norm.weight[0] = 1.0
        model.lm_head.weight[:, 0] = -20.0
        model.lm_head.weight[end, 0] = 20.0
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (source / name).is_file():
            shutil.copy(source / name, out / name)
    return out


@pytest.mark.vllm
@pytest.mark.slow
@requires_vllm
def test_episodes_run_on_vllm_token_in_token_out_as_on_the_embedded_engine(math_demo, vllm_server, tmp_path):
    """Multi-turn episodes (an environment's observations between the model's turns) on the vLLM engine at DP=2:
    every episode's model turns are the ids the engine sampled (token in, token out: each turn's request is the
    episode's ids so far), with the engine's log-probabilities matching the trainer's on them, and the environment's
    tokens in the sequence but in no loss; the embedded engine logs the same metric keys."""
    model = _ending_model(math_demo / "model", tmp_path / "ending_model")
    env = tmp_path / "talker.py"
    env.write_text(TALKER)
    extra = ["--model.pretrained_dir", str(model), "--rl.environment", f"{env}:Talker", "--rl.max_turns", "3",
             "--data.max_seq_len", "96", "--train.max_steps", "2", "--train.eval_interval", "0"]  # fmt: skip
    vllm = {"url": vllm_server.url, "probe_tolerance": 1e-4}
    runs = {
        "vllm": write_config(math_demo, tmp_path / "vllm", "vllm", vllm),
        "transformers": write_config(math_demo, tmp_path / "transformers", "transformers"),
    }
    for path in runs.values():
        assert run_distributed(train, 2, str(path), extra, timeout_s=900) == [None, None]
    keys = {name: keys_by_step(tmp_path / name) for name in runs}
    assert keys["vllm"] == keys["transformers"]
    assert {"rl/turns/mean", "rl/episode/env_tokens", "rl/logprob_diff"} <= keys["vllm"][1]
    diff = by_step(tmp_path / "vllm", "rl/logprob_diff")
    assert diff and all(value < 1e-5 for value in diff.values()), diff
    assert max(by_step(tmp_path / "vllm", "rl/turns/max").values()) >= 2  # episodes went on past their first turn
    rows = [json.loads(line) for line in (tmp_path / "vllm" / "rollouts.jsonl").read_text().splitlines()]
    turns = [turn for row in rows for turn in row["turns"]]
    assert {"assistant", "user"} <= {turn["role"] for turn in turns}, turns[:4]


@pytest.mark.vllm
@pytest.mark.slow
@requires_vllm
def test_a_skipped_sync_is_caught_by_the_probe_on_every_rank(math_demo, vllm_server, tmp_path):
    """The default settings (no tolerance to tune): the reload of version 2 reads version 0's file again."""
    path = write_config(math_demo, tmp_path / "skip", "vllm", {"url": vllm_server.url})
    errors = run_distributed(train, 2, str(path), ["--train.eval_interval", "0"], "skip_sync", timeout_s=900)
    for message in errors:
        assert message is not None and "weight sync of version 2" in message, message
        assert "changed by rms 0 since version 0" in message and "followed 0% of the trainer's change" in message
        assert "does not serve the trainer's weights (a reload that did not apply)" in message, message
    assert sorted(by_step(tmp_path / "skip", "train/policy_loss")) == [1, 2]  # the first batch trained, then stopped


@pytest.fixture
def bf16_server(math_demo: Path, tmp_path: Path) -> Any:
    """A server of the test model in vLLM's default precision for a float32 checkpoint, bfloat16 (this test's own)."""
    if not VLLM_PYTHON.is_file():
        pytest.skip(".venv-vllm is absent (make vllm-env)")
    yield from _serve(math_demo / "model", tmp_path, args=["--max-model-len", "256"])


@pytest.mark.vllm
@pytest.mark.slow
@requires_vllm
def test_the_sync_check_holds_over_120_bfloat16_syncs_and_catches_skipped_ones(math_demo, bf16_server, tmp_path):
    """A bfloat16 engine against a float32 trainer, as `rl.vllm.launch` runs by default: 120 syncs, each after an
    AdamW step (lr 1e-2, 32 examples) of supervised training on the arithmetic answers (prompt tokens masked, as in
    the RL demo's warm start), which sharpens the model and moves the engine's gap to the trainer past the old fixed
    tolerance (measured: 0.0012 at the first sync, 0.026 at most, above 0.02 at 4 syncs, the first at sync 98). Every
    sync passes with the default settings. Negative control: from sync 121 on the weights are no longer written (each
    reload reads sync 120's file again), and a sync is refused within a few, on a followed share of 0%."""
    from transformers import AutoTokenizer

    from veomni_lite.engines.vllm import EngineError, VLLMEngine, VLLMSettings

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(str(math_demo / "model"))
    model = _plain_model(math_demo).train()

    def ids(messages: list[dict[str, str]], **kwargs: Any) -> list[int]:
        rendered = tokenizer.apply_chat_template(messages, tokenize=True, **kwargs)
        return list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)

    rows = [json.loads(line)["messages"] for line in (math_demo / "train.jsonl").read_text().splitlines()]
    probe = ids(json.loads((math_demo / "rl_train.jsonl").read_text().splitlines()[0])["messages"],
                add_generation_prompt=True)  # fmt: skip
    examples = [(ids(m), len(ids(m[:1], add_generation_prompt=True))) for m in rows]

    def reference(tokens: list[int]) -> list[float]:
        with torch.no_grad():
            logp = model(torch.tensor([tokens])).logits[0].double().log_softmax(-1)
        return [logp[t - 1, tokens[t]].item() for t in range(1, len(tokens))]

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)

    def step(version: int) -> None:
        batch = [examples[(version * 32 + k) % len(examples)] for k in range(32)]
        width = max(len(tokens) for tokens, _ in batch)
        inputs, labels = torch.zeros(32, width, dtype=torch.long), torch.full((32, width), -100)
        for row, (tokens, prompt) in enumerate(batch):
            inputs[row, : len(tokens)] = torch.tensor(tokens)
            labels[row, prompt : len(tokens)] = torch.tensor(tokens[prompt:])
        model(input_ids=inputs, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    settings = VLLMSettings.parse({"url": bf16_server.url, "sync_dir": str(tmp_path / "sync")})
    engine = VLLMEngine(settings, str(math_demo / "model"), None, reference, probe)
    check = engine.endpoints[0].check
    gaps, followed = [], []
    try:
        for version in range(121):
            if version:
                step(version)
            engine.sync_weights(model.state_dict(), version)
            gaps.append(check.gap)
            followed += [check.followed] if check.followed is not None else []
        engine._write = lambda state: None  # the negative control: the reloads read sync 120's file
        with pytest.raises(EngineError) as caught:
            for version in range(121, 141):
                step(version)
                engine.sync_weights(model.state_dict(), version)
    finally:
        engine.close()
    over = [v for v, gap in enumerate(gaps) if gap > 0.02]
    print(f"\nbfloat16 engine, 121 syncs: probe mean |engine - trainer| {gaps[0]:.4f} at the first, max "
          f"{max(gaps):.4f}; {len(over)} above the old fixed tolerance 0.02 (first at sync {over[:1]}); "
          f"{len(followed)} syncs decided, followed {min(followed):.3f} to {max(followed):.3f}; skipped reloads "
          f"refused at version {version}: {caught.value}")  # fmt: skip
    assert max(gaps) > 10 * gaps[0]  # the trained model moved the engine's gap, as in the run
    assert len(followed) > 60 and all(0.5 <= f <= 1.5 for f in followed)
    assert 121 <= version <= 130 and "followed 0% of the trainer's change" in str(caught.value)


@pytest.mark.vllm
@pytest.mark.slow
@requires_vllm
def test_one_step_async_samples_with_the_weights_one_batch_old(math_demo, vllm_server, tmp_path):
    vllm = {"url": vllm_server.url, "probe_tolerance": 1e-4}
    path = write_config(math_demo, tmp_path / "async", "vllm", vllm, max_steps=6)
    extra = ["--rl.async_steps", "1", "--rl.entropy_coef", "0.01"]  # the entropy bonus moves the weights every step
    assert run_distributed(train, 2, str(path), extra, timeout_s=900) == [None, None]
    assert sorted(by_step(tmp_path / "async", "train/policy_loss")) == [1, 2, 3, 4, 5, 6]
    # batch 0 sampled by the weights it trains (step 0); batches 1 and 2 during the previous batch's 2 steps
    assert by_step(tmp_path / "async", "rl/staleness/mean") == {1: 0.0, 3: 2.0, 5: 2.0}
    assert by_step(tmp_path / "async", "rl/staleness/max") == {1: 0.0, 3: 2.0, 5: 2.0}
    diff = by_step(tmp_path / "async", "rl/logprob_diff")
    ratio = by_step(tmp_path / "async", "rl/importance_ratio/mean")
    print(f"\nasync rl/logprob_diff {diff}, rl/importance_ratio/mean {ratio}")
    assert diff[1] < 1e-5 and diff[3] > 1e-4 and diff[5] > 1e-4  # the engine's log-probs are of the older weights
    assert abs(ratio[1] - 1) < 1e-5 and abs(ratio[3] - 1) > 1e-5
    assert sorted(by_step(tmp_path / "async", "eval/reward")) == [1, 2, 4, 6]  # evaluation between, while generating


@pytest.mark.vllm
@pytest.mark.slow
@requires_vllm
def test_a_launched_server_that_does_not_start_in_time_is_stopped_and_named(math_demo, tmp_path):
    vllm = {"launch": True, "python": str(VLLM_PYTHON), "start_timeout_s": 2, "server_args": SERVER_ARGS}
    path = write_config(math_demo, tmp_path / "slow", "vllm", vllm)
    errors = run_distributed(train, 2, str(path), [], timeout_s=600)
    for message in errors:
        assert message is not None and "vLLM engine (launched, pid" in message, message
        assert "within rl.vllm.start_timeout_s = 2 s; stopped it" in message, message
    pid = int(errors[0].split("pid ")[1].split(")")[0])
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # stopped and reaped


def _wave(engine: Any) -> list:
    """A wave of 48 seeded requests of 100-token prompts: 4800 prompt tokens, over a CPU server's 2048-token budget."""
    from veomni_lite.engines.base import RolloutRequest, SamplingSettings

    requests = [RolloutRequest([3 + (7 * i + t) % 90 for t in range(100)], [i]) for i in range(48)]
    return engine.generate(requests, SamplingSettings(max_new_tokens=4, temperature=1.0))


@pytest.mark.vllm
@pytest.mark.slow
@requires_vllm
def test_a_wave_over_the_token_budget_completes_on_a_cpu_server(math_demo, vllm_server, tmp_path):
    """vLLM 0.32's CPU build kills its engine when a seeded request's prompt is prefilled in chunks; a launched server
    here runs without chunked prefill (`cpu_server_args`). Negative control: the same wave on a server with chunked
    prefill on is a named EngineError."""
    from veomni_lite.engines.vllm import EngineError, VLLMEngine, VLLMServer, VLLMSettings

    assert not torch.cuda.is_available()
    engine = VLLMEngine(VLLMSettings.parse({"url": vllm_server.url}), str(math_demo / "model"), None, None, [1, 2])
    assert [len(group[0].response_ids) for group in _wave(engine)] == [4] * 48
    engine.close()
    chunked = VLLMServer(str(VLLM_PYTHON), str(math_demo / "model"), tmp_path / "chunked.log",
                         [*SERVER_ARGS, "--enable-chunked-prefill"])  # fmt: skip
    try:
        chunked.wait_ready(600, time.monotonic())
        engine = VLLMEngine(VLLMSettings.parse({"url": chunked.url}), str(math_demo / "model"), None, None, [1, 2])
        with pytest.raises(EngineError, match="HTTP 500"):
            _wave(engine)
        engine.close()
    finally:
        chunked.stop()
    assert "CPU Generator does not use offset" in (tmp_path / "chunked.log").read_text()


@pytest.fixture(scope="session")
def vl_demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The digits as RL prompts (64 to train, 8 to evaluate), examples/sft_demo.py's tiny Qwen2-VL in vLLM's shape."""
    from examples.sft_demo import write_digits, write_jsonl, write_vl_model

    out = tmp_path_factory.mktemp("vllm_vl")
    texts = write_digits(out)
    for split, name, rows in (("train", "rl_train", 64), ("eval", "rl_eval", 8)):
        lines = (out / f"{split}.jsonl").read_text().splitlines()[:rows]
        write_jsonl(out / f"{name}.jsonl", [json.loads(line) for line in lines])
    write_vl_model(out / "model", texts, vllm=True)
    return out


@pytest.fixture(scope="session")
def vl_server(vl_demo: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A float32 vLLM server of the tiny Qwen2-VL, started as a launched one is (it renders prompts itself)."""
    if not VLLM_VISION.is_file():
        pytest.skip(".venv-vllm has no torchvision (make vllm-env)")
    yield from _serve(vl_demo / "model", tmp_path_factory.mktemp("vllm_vl_server"), renders_prompts=True)


VL_REWARD = ["--rl.rewards", "[{name: correct, function: exact_match}]"]


def _vl_diffs(model: Any, request: Any, rollout: Any) -> list[float]:
    """|engine - plain forward| log-probability of each sampled token, the forward given the trainer's pixels; the
    suppressed image placeholder left out of the softmax, as vLLM leaves it out (docs/vllm.md)."""
    ids = torch.tensor([request.prompt_ids + rollout.response_ids])
    inputs = {"mm_token_type_ids": (ids == model.config.image_token_id).long(), **request.model_inputs}
    with torch.no_grad():
        logits = model(input_ids=ids, **inputs).logits[0].double() / TEMPERATURE
    logits[:, model.config.image_token_id] = float("-inf")
    logp, start = logits.log_softmax(-1), len(request.prompt_ids)
    response = rollout.response_ids
    return [abs(logp[start - 1 + t, token].item() - rollout.logprobs[t]) for t, token in enumerate(response)]


@pytest.mark.vllm
@pytest.mark.slow
@requires_vllm
def test_vision_language_rollouts_carry_the_trainers_images_and_prompt(vl_demo, vl_server, tmp_path):
    """Through vLLM's chat route: the sampled tokens' log-probabilities are a plain forward's with the trainer's
    pixels, and after a sync that changes only the vision tower, the new tower's (the encoder cache is reset).
    Controls: another image under the same prompt moves them; a prompt the server renders otherwise is a named
    EngineError; an image request without chat fields is refused. A run's own chat template travels with the request
    and is the one the server renders with."""
    from transformers import Qwen2VLForConditionalGeneration

    from veomni_lite.engines.base import RolloutRequest
    from veomni_lite.engines.vllm import EngineError
    from veomni_lite.rl.prompts import chat_fields
    from veomni_lite.rl.rollout_batch import request, sampling, sync_engine
    from veomni_lite.rl.trainer import RLTrainer

    vllm = {"url": vl_server.url, "probe_tolerance": 1e-4}
    path = write_config(vl_demo, tmp_path / "engine", "vllm", vllm)
    trainer = RLTrainer(load_config(path, VL_REWARD, world_size=1, sections={"rl": RLConfig}))
    try:
        sync_engine(trainer.rollouts.context, trainer.step)
        engine, settings = trainer.engine, sampling(trainer.rollouts.context, greedy=False)
        assert engine.last_probe_diff < 1e-5
        model = Qwen2VLForConditionalGeneration.from_pretrained(str(vl_demo / "model"), dtype=torch.float32).eval()
        prompts = trainer.train_dataset.prompts[:3]
        requests = [request(trainer.rollouts.context, 0, i, prompt, 2) for i, prompt in enumerate(prompts[:2])]
        urls = [request.chat["messages"][0]["content"][0]["image_url"]["url"] for request in requests]
        assert all(url.startswith("data:image/png;base64,") for url in urls)

        def generated(requests: list) -> list[float]:
            groups = engine.generate(requests, settings)
            return [d for r, group in zip(requests, groups) for rollout in group for d in _vl_diffs(model, r, rollout)]

        seen = generated(requests)
        print(f"\nVL sampled tokens' mean |engine - plain forward| log-prob (float32): {sum(seen) / len(seen):.2e}")
        assert sum(seen) / len(seen) < 1e-5 and max(seen) < 1e-4
        other = request(trainer.rollouts.context, 0, 2, prompts[2], 1)  # another digit's image: 8x8 pixels, same tokens
        assert other.prompt_ids == requests[0].prompt_ids
        swapped = RolloutRequest(requests[0].prompt_ids, [7], requests[0].model_inputs, other.chat)
        assert max(generated([swapped])) > 1e-3
        edited = list(requests[0].prompt_ids)
        edited[-3] = edited[-4]
        with pytest.raises(EngineError, match=r"rendered the prompt as \d+ tokens, the trainer as \d+; first diff"):
            engine.generate([RolloutRequest(edited, [1], requests[0].model_inputs, requests[0].chat)], settings)
        with pytest.raises(EngineError, match="request 0 has images but no chat fields"):
            engine.generate([RolloutRequest(edited, [1], requests[0].model_inputs)], settings)
        # data.chat_template: the request carries the run's template, which the server renders with (not its own)
        from examples.sft_demo import TEMPLATE

        for template, renders_alike in ((TEMPLATE, True), (TEMPLATE.replace("assistant\n", "assistant:\n"), False)):
            chat = chat_fields(prompts[0], template, "<|image_pad|>")
            with contextlib.nullcontext() if renders_alike else pytest.raises(EngineError, match="first difference"):
                engine.generate([RolloutRequest(requests[0].prompt_ids, [1], requests[0].model_inputs, chat)], settings)
        with torch.no_grad():  # a new vision tower: the same images, other encoder outputs
            for parameter in model.model.visual.parameters():
                parameter.add_(torch.randn_like(parameter) * 0.05)
        engine.sync_weights(model.state_dict(), 1)
        seen = generated(requests)
        assert sum(seen) / len(seen) < 1e-5 and max(seen) < 1e-4
    finally:
        trainer.close()


@pytest.mark.vllm
@pytest.mark.slow
@requires_vllm
def test_vision_language_runs_on_vllm_train_as_on_the_embedded_engine(vl_demo, vl_server, tmp_path):
    """Synchronous and one-step async; then the negative control of the encoder-cache reset (the VL server's last
    test: it kills the server's engine)."""
    from veomni_lite.engines.vllm import EngineError
    from veomni_lite.engines.weights import full_hf_state
    from veomni_lite.rl.rollout_batch import request, sampling, sync_engine
    from veomni_lite.rl.trainer import RLTrainer

    runs = {
        "vllm": write_config(vl_demo, tmp_path / "vllm", "vllm", {"url": vl_server.url, "probe_tolerance": 1e-4}),
        "transformers": write_config(vl_demo, tmp_path / "transformers", "transformers"),
    }
    moving = [*VL_REWARD, "--rl.entropy_coef", "0.01"]  # the entropy bonus moves the weights, vision tower too
    for path in runs.values():
        assert run_distributed(train, 2, str(path), moving, timeout_s=900) == [None, None]
    keys = {name: keys_by_step(tmp_path / name) for name in runs}
    assert sorted(keys["vllm"]) == [1, 2, 3, 4] and keys["vllm"] == keys["transformers"]
    diff = by_step(tmp_path / "vllm", "rl/logprob_diff")
    print(f"\nVL rl/logprob_diff per step: {diff}")
    # vLLM leaves the suppressed image placeholder out of its normalizer: -log(1 - p) ~ 1/vocabulary here
    assert sorted(diff) == [1, 3] and all(value < 1e-2 for value in diff.values())
    asynchronous = write_config(vl_demo, tmp_path / "async", "vllm", {"url": vl_server.url, "probe_tolerance": 1e-4})
    assert run_distributed(train, 2, str(asynchronous), [*moving, "--rl.async_steps", "1"], timeout_s=900) == [None] * 2
    assert by_step(tmp_path / "async", "rl/staleness/mean") == {1: 0.0, 3: 2.0}  # batch 1 sampled while batch 0 trained
    # Control: a sync without the encoder-cache reset, then images the server has seen: its engine dies
    trainer = RLTrainer(load_config(runs["vllm"], VL_REWARD, world_size=1, sections={"rl": RLConfig}))
    try:
        sync_engine(trainer.rollouts.context, trainer.step)
        prompts = trainer.train_dataset.prompts[:2]
        requests = [request(trainer.rollouts.context, 0, i, prompt, 2) for i, prompt in enumerate(prompts)]
        trainer.engine.generate(requests, sampling(trainer.rollouts.context, greedy=False))
        trainer.engine.renders_prompts = False  # the sync below skips /reset_encoder_cache
        trainer.engine.sync_weights(full_hf_state(trainer.model, trainer.lora), 1)
        with pytest.raises(EngineError, match="answered HTTP 500"):
            trainer.engine.generate(requests, sampling(trainer.rollouts.context, greedy=False))
    finally:
        trainer.close()
    assert "Encoder cache miss" in vl_server.log_path.read_text()


@pytest.mark.vllm
@pytest.mark.slow
@requires_vllm
def test_a_killed_engine_is_a_named_error_on_every_rank_and_the_run_resumes(math_demo, vllm_server, tmp_path):
    vllm_server.stop()  # one server at a time on this machine: the run launches its own (the session's last test)
    vllm = {"launch": True, "python": str(VLLM_PYTHON), "start_timeout_s": 600, "request_timeout_s": 60,
            "server_args": SERVER_ARGS, "probe_tolerance": 1e-4, "max_restarts": 0}  # fmt: skip
    path = write_config(math_demo, tmp_path / "run", "vllm", vllm, max_steps=6, eval_interval=0)
    save = ["--checkpoint.save_interval", "1"]
    errors = run_distributed(train, 2, str(path), save, "kill", timeout_s=900)
    for message in errors:
        assert message is not None and "vLLM engine, weight sync of version 2: rank 0" in message, message
        assert "reload the weights of version 2" in message and "exited with code -9" in message, message
    assert sorted(by_step(tmp_path / "run", "train/policy_loss")) == [1, 2]
    resume = [*save, "--checkpoint.resume", "true"]
    assert run_distributed(train, 2, str(path), resume, timeout_s=900) == [None, None]
    assert sorted(by_step(tmp_path / "run", "train/policy_loss")) == [1, 2, 3, 4, 5, 6]
    diff = by_step(tmp_path / "run", "rl/logprob_diff")
    assert sorted(diff) == [1, 3, 5] and all(value < 1e-5 for value in diff.values())


@pytest.mark.vllm
@pytest.mark.slow
@requires_vllm
def test_a_server_killed_mid_run_leaves_the_rollouts_unchanged_and_is_relaunched(math_demo, tmp_path):
    """`launch: 2`, `max_restarts: 1`, 2 ranks, rollout batches of 4 prompts x 4 samples over 2 steps. The first
    server's process killed alone (SIGKILL) mid-wave in the second batch: its samples go to the other server, its group
    ends by itself and unlinks its shared memory, a new server is launched in its place, and (once up) is synced and
    serves samples of the third batch. Every rollout of the 6 steps (rollouts.jsonl: both ranks' 16 a batch) equals the
    run's without the failure, and so do the losses. Both servers then killed, the relaunch used: the next sync is a
    named error on every rank ("no server left"), and no process of any server's group is left. The session's servers
    are stopped first (two servers at a time on this machine)."""
    for server in _SERVED:
        server.stop()
    vllm = {"launch": 2, "python": str(VLLM_PYTHON), "start_timeout_s": 900, "request_timeout_s": 120,
            "server_args": SERVER_ARGS, "probe_tolerance": 1e-4, "max_restarts": 1}  # fmt: skip
    extra = ["--rl.rollouts_sample", "16", "--parallel.collective_timeout_s", "1200"]
    healthy = write_config(math_demo, tmp_path / "healthy", "vllm", vllm, max_steps=6, eval_interval=0)
    assert run_distributed(train, 2, str(healthy), extra, timeout_s=1200) == [None, None]
    failing = write_config(math_demo, tmp_path / "failing", "vllm", vllm, max_steps=8, eval_interval=0)
    errors = run_distributed(train, 2, str(failing), extra, "failover", timeout_s=1800)
    named = (
        "vLLM engine, weight sync of version 6: rank 0: vLLM engine: no server left of 2; relaunches used: 1 of "
        "rl.vllm.max_restarts = 1; the last failure: vLLM engine at"
    )
    for message in errors:
        assert message is not None and named in message, message
    losses = [by_step(tmp_path / run, "train/policy_loss") for run in ("healthy", "failing")]
    assert sorted(losses[1]) == [1, 2, 3, 4, 5, 6] and all(abs(losses[1][s] - losses[0][s]) < 1e-6 for s in losses[0])
    rows = [(tmp_path / run / "rollouts.jsonl").read_text().splitlines() for run in ("healthy", "failing")]
    print(f"\nfailover: the {len(rows[0])} rollouts of 6 steps equal with and without the killed server")
    assert len(rows[0]) == 6 * 16 and rows[1] == rows[0]  # the 16 samples of the batch each step trains


@pytest.mark.vllm
@pytest.mark.slow
@requires_vllm
def test_two_launched_servers_give_one_servers_rollouts_and_the_key_guards_only_v1(math_demo, tmp_path, monkeypatch):
    """`rl.vllm.launch: 2` with `api_key_env`: both servers synced and checked; a wave of 8 prompts x 4 seeded samples
    spread over the two equals the same wave on one of them (tokens, and log-probabilities to 1e-6). vLLM's --api-key
    (given as VLLM_API_KEY): /v1 answers 401 without the key, while the dev-mode weight routes run without it
    (docs/vllm.md, Security). Both servers' process groups are gone after close. The session's servers are stopped
    first (two servers at a time on this machine): the file's last test."""
    import urllib.error
    import urllib.request

    from veomni_lite.engines.base import RolloutRequest, SamplingSettings
    from veomni_lite.engines.vllm import VLLMEngine, VLLMSettings
    from veomni_lite.engines.vllm.boot import members

    for server in _SERVED:
        server.stop()
    monkeypatch.setenv("TEST_VLLM_KEY", "k3y-for-the-test")
    model = _plain_model(math_demo)

    def reference(ids: list[int]) -> list[float]:
        with torch.no_grad():
            logp = model(torch.tensor([ids])).logits[0].double().log_softmax(-1)
        return [logp[t - 1, ids[t]].item() for t in range(1, len(ids))]

    def engine(**vllm: Any) -> VLLMEngine:
        settings = VLLMSettings.parse({"api_key_env": "TEST_VLLM_KEY", "sync_dir": str(tmp_path / "sync"), **vllm})
        made = VLLMEngine(settings, str(math_demo / "model"), None, reference, list(range(3, 40)), tmp_path / "s.log")
        made.sync_weights(model.state_dict(), 0)
        return made

    requests = [RolloutRequest([1, 5 + i, 9, 33, 40 - i, 12], [10 * i + j for j in range(4)]) for i in range(8)]
    sampling = SamplingSettings(max_new_tokens=12, temperature=TEMPERATURE)
    two = engine(launch=2, python=str(VLLM_PYTHON), server_args=SERVER_ARGS, start_timeout_s=900)
    servers = two.servers
    try:
        assert len(servers) == 2 and (tmp_path / "s_1.log").is_file()
        assert all(e.check.gap < 1e-5 for e in two.endpoints), [e.check.gap for e in two.endpoints]
        spread_over_two = two.generate(requests, sampling)
        one = engine(url=servers[1].url)
        alone = one.generate(requests, sampling)
        one.close()
        assert [[r.response_ids for r in g] for g in spread_over_two] == [[r.response_ids for r in g] for g in alone]
        diffs = [
            abs(a - b)
            for g, h in zip(spread_over_two, alone)
            for r, s in zip(g, h)
            for a, b in zip(r.logprobs, s.logprobs)
        ]
        print(f"\ntwo servers against one: {sum(len(r.response_ids) for g in alone for r in g)} tokens equal, "
              f"log-probabilities max |diff| {max(diffs):.1e}")  # fmt: skip
        assert max(diffs) < 1e-6

        def status(route: str, key: str = "", body: Any = None) -> int:
            data = None if body is None else json.dumps(body).encode()
            headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
            request = urllib.request.Request(servers[0].url + route, data=data, headers=headers)
            try:
                with urllib.request.urlopen(request, timeout=60) as answer:
                    return answer.status
            except urllib.error.HTTPError as error:
                return error.code

        assert status("/v1/models") == 401 and status("/v1/models", "wrong") == 401
        assert status("/v1/models", "k3y-for-the-test") == 200
        reload = {"method": "reload_weights", "kwargs": {"weights_path": str(two.sync_path)}}
        assert status("/collective_rpc", body=reload) == 200  # not guarded: the weights reloaded without the key
        assert status("/reset_prefix_cache", body={}) == 200
    finally:
        two.close()
    assert all(server.exited() is not None and not members(server.pid) for server in servers)
