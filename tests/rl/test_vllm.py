"""`rl.engine: vllm` (`veomni_lite.engines.vllm`).

Without vLLM (every `make test`): the `rl.vllm` settings are checked by name; a server that refuses connections,
answers with an HTTP error or not within `request_timeout_s` is an EngineError naming the engine and the request on
every rank (a stdlib fake server).

With vLLM's CPU build in `.venv-vllm` (`make vllm-env`; `make test-vllm` runs the tests marked `vllm`, skipped
without it): one float32 server for the session on a Qwen2 of head dim 32 (the smallest vLLM's CPU attention takes).
The engine's sampled log-probabilities equal a plain forward's log-softmax(logits / T) (mean |diff| printed and
bounded), a seeded request repeats and stop ids end a response; the same config trains the same steps with the same
metric keys on `vllm` and on `transformers`, with the engine's log-probabilities matching the trainer's
(`rl/logprob_diff`); a sync skipped on purpose is caught by the probe on every rank (negative control); a launched
server that does not start in time is stopped and named; a wave of seeded requests over a CPU server's token budget
completes (vLLM's CPU build dies on chunked prefill of a seeded request: the negative control); a launched server
killed mid-run ends the run with a named
error on every rank, and the run resumes from its checkpoint with a fresh launched server. Vision-language (a second
server, of a tiny Qwen2-VL; without it, a fake chat route checks the request and the rendering check): the images
reach the server through its chat route with the trainer's pixels, the prompt it renders is the trainer's, and a sync
resets its encoder cache.
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
from tests.trainer.helpers import read_events
from veomni_lite.config import ConfigError, load_config
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


def _serve(model: Path, log_dir: Path, renders_prompts: bool = False) -> Any:
    """A float32 server of `model` on loopback, yielded once ready and stopped after (a session fixture's body)."""
    from veomni_lite.engines.vllm import VLLMServer

    server = VLLMServer(
        str(VLLM_PYTHON), str(model), log_dir / "server.log", SERVER_ARGS, renders_prompts=renders_prompts
    )
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


def train(rank: int, world: int, path: str, extra: list[str], hook: str = "") -> str | None:
    """One rank's run of the config at `path`: None when it finishes, the EngineError's message when it fails with one.
    `hook`: "skip_sync" (rank 0 writes the weights only at the first sync), "kill" (rank 0 kills the launched server
    after step 2)."""
    from veomni_lite.engines.vllm import EngineError, VLLMEngine
    from veomni_lite.rl.trainer import RLTrainer

    if hook == "skip_sync":
        original, calls = VLLMEngine._write, []

        def write_once(self: VLLMEngine, state: Any) -> None:
            calls.append(1)
            if len(calls) == 1:
                original(self, state)

        VLLMEngine._write = write_once  # the negative control: later syncs reload the first weights
    trainer = RLTrainer(load_config(path, extra, world_size=world, sections={"rl": RLConfig}))
    if hook == "kill":
        step = trainer.train_step

        def kill_after_step_2(micro_batches: list) -> None:
            step(micro_batches)
            if trainer.step == 2 and trainer.engine.server is not None:
                os.killpg(trainer.engine.server.pid, signal.SIGKILL)

        trainer.train_step = kill_after_step_2
    try:
        trainer.train()
        return None
    except EngineError as exc:
        return str(exc)
    finally:
        trainer.metrics.close()
        if trainer.engine is not None:
            trainer.engine.close()
            server = getattr(trainer.engine, "server", None)
            assert server is None or server.exited() is not None, "a launched server outlived close()"


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

    assert config("vllm", {"url": "http://127.0.0.1:8000"}).rl.vllm["url"] == "http://127.0.0.1:8000"
    with pytest.raises(ConfigError, match=r"rl.vllm: unknown key\(s\) \['request_timeout'\]"):
        config("vllm", {"url": "http://127.0.0.1:8000", "request_timeout": 5})
    with pytest.raises(ConfigError, match="exactly one of url"):
        config("vllm", {"url": "http://127.0.0.1:8000", "launch": True})
    with pytest.raises(ConfigError, match="exactly one of url"):
        config("vllm", {})
    with pytest.raises(ConfigError, match="rl.vllm.request_timeout_s: must be > 0"):
        config("vllm", {"launch": True, "request_timeout_s": 0})
    with pytest.raises(ConfigError, match="rl.vllm: set, but rl.engine is 'transformers'"):
        config("transformers", {"launch": True})


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


@pytest.mark.vllm
@pytest.mark.slow
@requires_vllm
def test_a_skipped_sync_is_caught_by_the_probe_on_every_rank(math_demo, vllm_server, tmp_path):
    path = write_config(math_demo, tmp_path / "skip", "vllm", {"url": vllm_server.url, "probe_tolerance": 1e-4})
    errors = run_distributed(train, 2, str(path), ["--train.eval_interval", "0"], "skip_sync", timeout_s=900)
    for message in errors:
        assert message is not None and "weight sync of version 2" in message, message
        assert "does not serve the trainer's weights" in message and "> rl.vllm.probe_tolerance 0.0001" in message
    assert sorted(by_step(tmp_path / "skip", "train/policy_loss")) == [1, 2]  # the first batch trained, then stopped


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
    assert by_step(tmp_path / "async", "rl/staleness") == {1: 0.0, 3: 2.0, 5: 2.0}
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
    from veomni_lite.rl.trainer import RLTrainer

    vllm = {"url": vl_server.url, "probe_tolerance": 1e-4}
    path = write_config(vl_demo, tmp_path / "engine", "vllm", vllm)
    trainer = RLTrainer(load_config(path, VL_REWARD, world_size=1, sections={"rl": RLConfig}))
    try:
        trainer.rollouts.sync_engine()
        engine, settings = trainer.engine, trainer.rollouts.sampling(greedy=False)
        assert engine.last_probe_diff < 1e-5
        model = Qwen2VLForConditionalGeneration.from_pretrained(str(vl_demo / "model"), dtype=torch.float32).eval()
        prompts = trainer.train_dataset.prompts[:3]
        requests = [trainer.rollouts.request(0, i, prompt, 2) for i, prompt in enumerate(prompts[:2])]
        urls = [request.chat["messages"][0]["content"][0]["image_url"]["url"] for request in requests]
        assert all(url.startswith("data:image/png;base64,") for url in urls)

        def generated(requests: list) -> list[float]:
            groups = engine.generate(requests, settings)
            return [d for r, group in zip(requests, groups) for rollout in group for d in _vl_diffs(model, r, rollout)]

        seen = generated(requests)
        print(f"\nVL sampled tokens' mean |engine - plain forward| log-prob (float32): {sum(seen) / len(seen):.2e}")
        assert sum(seen) / len(seen) < 1e-5 and max(seen) < 1e-4
        other = trainer.rollouts.request(0, 2, prompts[2], 1)  # another digit's image: 8x8 pixels, the same tokens
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
    assert by_step(tmp_path / "async", "rl/staleness") == {1: 0.0, 3: 2.0}  # batch 1 sampled while batch 0 trained
    # Control: a sync without the encoder-cache reset, then images the server has seen: its engine dies
    trainer = RLTrainer(load_config(runs["vllm"], VL_REWARD, world_size=1, sections={"rl": RLConfig}))
    try:
        trainer.rollouts.sync_engine()
        prompts = trainer.train_dataset.prompts[:2]
        requests = [trainer.rollouts.request(0, i, prompt, 2) for i, prompt in enumerate(prompts)]
        trainer.engine.generate(requests, trainer.rollouts.sampling(greedy=False))
        trainer.engine.renders_prompts = False  # the sync below skips /reset_encoder_cache
        trainer.engine.sync_weights(full_hf_state(trainer.model, trainer.lora), 1)
        with pytest.raises(EngineError, match="answered HTTP 500"):
            trainer.engine.generate(requests, trainer.rollouts.sampling(greedy=False))
    finally:
        trainer.close()
    assert "Encoder cache miss" in vl_server.log_path.read_text()


@pytest.mark.vllm
@pytest.mark.slow
@requires_vllm
def test_a_killed_engine_is_a_named_error_on_every_rank_and_the_run_resumes(math_demo, vllm_server, tmp_path):
    vllm_server.stop()  # one server at a time on this machine: the run launches its own (the session's last test)
    vllm = {"launch": True, "python": str(VLLM_PYTHON), "start_timeout_s": 600, "request_timeout_s": 60,
            "server_args": SERVER_ARGS, "probe_tolerance": 1e-4}  # fmt: skip
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
