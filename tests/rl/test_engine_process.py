"""The embedded engine in a process of its own (`rl.engine_worker: process`, `veomni_lite.engines.process`): the same
tokens and log-probabilities as the in-process engine given the same weights (negative control: other weights
differ); an engine error is raised by the call that made it, with the child's traceback; a killed engine process is a
named error of every later call and leaves no process behind; through the trainer, a k = 2 partial-rollout run with
the engine in its own process trains the samples and losses of the run with the engine on a thread, and a killed
engine process on ONE rank of two ends the run with the same named `GenerationError` on both."""

from __future__ import annotations

import functools
import multiprocessing
import os
import re
import signal
import time
from typing import Any

import pytest
import torch

from tests.dist_helpers import run_ranks
from tests.rl.test_async_rollouts import async_args, build, math_demo, run  # noqa: F401 - math_demo: a fixture
from tests.rl.test_engine import prompts, tiny_lm
from tests.trainer.helpers import train_built
from veomni_lite.engines.base import RolloutRequest, SamplingSettings
from veomni_lite.engines.embedded import TransformersEngine
from veomni_lite.engines.process import ProcessEngine
from veomni_lite.engines.weights import embedded_engine


def _requests() -> list[RolloutRequest]:
    return [RolloutRequest(p, [11 * i, 11 * i + 1]) for i, p in enumerate(prompts(5, 3, 7))]


def _failing_factory() -> Any:
    raise ValueError("no model directory at /nowhere")


def test_a_process_engine_samples_the_in_process_engines_tokens():
    model = tiny_lm(logit_scale=4.0)
    state = {key: value.clone() for key, value in model.state_dict().items()}
    settings = SamplingSettings(max_new_tokens=6, temperature=1.0)
    local = TransformersEngine(tiny_lm(seed=5), torch.device("cpu"))
    local.sync_weights(state, 3)
    remote = ProcessEngine(functools.partial(embedded_engine, model.config, "fp32", torch.device("cpu")))
    try:
        assert remote.name == "transformers" and remote.pid != os.getpid()
        remote.sync_weights(state, 3)
        expected, got = local.generate(_requests(), settings), remote.generate(_requests(), settings)
        assert remote.version == 3
        assert [[r.response_ids for r in g] for g in got] == [[r.response_ids for r in g] for g in expected]
        assert [[r.logprobs for r in g] for g in got] == [[r.logprobs for r in g] for g in expected]
        remote.sync_weights(tiny_lm(seed=9).state_dict(), 4)  # negative control: other weights, other samples
        other = remote.generate(_requests(), settings)
        assert [[r.logprobs for r in g] for g in other] != [[r.logprobs for r in g] for g in expected]
        assert remote.run(functools.partial(torch.get_num_threads)) == torch.get_num_threads()
        with pytest.raises(
            RuntimeError, match=r"engine process: sync_weights failed: ValueError: .*unexpected keys \['bad'\]"
        ):
            remote.sync_weights({"bad": torch.zeros(1)}, 5)
        assert remote.generate(_requests(), settings) == other  # the engine lives on after its error
    finally:
        remote.close()
    assert remote._process.exitcode == 0


def test_a_failing_factory_and_a_killed_engine_process_are_named_errors():
    with pytest.raises(
        RuntimeError, match=r"engine process: start failed: ValueError: no model directory at /nowhere\n"
    ):
        ProcessEngine(_failing_factory)
    model = tiny_lm()
    remote = ProcessEngine(functools.partial(embedded_engine, model.config, "fp32", torch.device("cpu")))
    pid = remote.pid
    os.kill(pid, signal.SIGKILL)
    message = rf"engine process \(pid {pid}\) exited with code -9"
    with pytest.raises(RuntimeError, match=message + " during sync_weights"):
        remote.sync_weights(model.state_dict(), 0)
    with pytest.raises(RuntimeError, match=message + "; generate not run"):
        remote.generate(_requests(), SamplingSettings(max_new_tokens=2))
    remote.close()
    assert not remote._process.is_alive()
    with pytest.raises(ChildProcessError):  # reaped: no zombie left
        os.waitpid(pid, 0)


def _parent(pids: Any) -> None:
    """A trainer's stand-in: starts an engine process, says both pids, then waits to be killed."""
    remote = ProcessEngine(functools.partial(embedded_engine, tiny_lm().config, "fp32", torch.device("cpu")))
    pids.put((os.getpid(), remote.pid))
    signal.pause()


def test_an_engine_process_ends_when_its_parent_is_killed():
    context = multiprocessing.get_context("spawn")
    pids = context.Queue()
    parent = context.Process(target=_parent, args=(pids,))
    parent.start()
    parent_pid, child_pid = pids.get(timeout=120)
    os.kill(child_pid, 0)  # alive
    os.kill(parent_pid, signal.SIGKILL)
    parent.join(30)
    deadline = time.monotonic() + 30
    while _alive(child_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child_pid), "the engine process outlived its parent"


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not yet reaped by init, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow
def test_the_engine_in_its_own_process_trains_the_samples_of_the_engine_on_a_thread(math_demo, tmp_path):  # noqa: F811
    extra = ("--rl.partial_rollouts", "true")
    thread = run(async_args(math_demo, tmp_path / "thread", *extra))
    process = run(async_args(math_demo, tmp_path / "process", *extra, "--rl.engine_worker", "process"))
    assert isinstance(process["trainer"].engine.engine, ProcessEngine)
    process["trainer"].engine.close()
    for key in ("response_ids", "engine_logprobs", "versions", "reward"):
        assert [s[key] for s in process["last"]] == [s[key] for s in thread["last"]], key
    losses = [e["train/policy_loss"] for e in process["events"] if "train/policy_loss" in e]
    assert losses == [e["train/policy_loss"] for e in thread["events"] if "train/policy_loss" in e]


def _killed_on_rank_one(rank: int, world: int, args: list[str]) -> str:
    trainer = build(args, world)
    engine = trainer.engine.engine
    if rank == 1:  # the engine process dies once the first batch is made (blocks 1 and 2 in flight)
        original = trainer.train_step

        def train_step(micro_batches: Any) -> Any:
            if trainer.step == 1:
                os.kill(engine.pid, signal.SIGKILL)
            return original(micro_batches)

        trainer.train_step = train_step
    try:
        train_built(trainer)
    except Exception as exc:  # noqa: BLE001 - the test compares what each rank raised
        return f"{type(exc).__name__}: {exc}"
    finally:
        trainer.engine.close()
        assert not engine._process.is_alive()
    return "trained"


@pytest.mark.slow
def test_an_engine_process_killed_on_one_rank_ends_the_run_with_the_same_named_error(math_demo, tmp_path):  # noqa: F811
    args = async_args(math_demo, tmp_path / "run", "--rl.engine_worker", "process")
    outcomes = run_ranks(_killed_on_rank_one, 2, args, timeout_s=600)
    assert all(status == "ok" for status, _ in outcomes.values()), "\n".join(v for _, v in outcomes.values())
    messages = [value for _, value in outcomes.values()]
    assert messages[0] == messages[1], messages
    assert re.match(r"GenerationError: prompt block [123]: generation: rank 1: engine process \(pid \d+\)", messages[0])
    assert "exited with code -9" in messages[0]
