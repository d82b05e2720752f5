"""A tool failing on its own (`rl.max_tool_error_rate`): named on the console once per tool and kind of error, with its
failure rate over the rollout batch; a tool failing in more than the rate of at least MIN_TOOL_CALLS calls fails the
run with the same error on every rank, naming the tool and its first exception, decided from counts summed over the
ranks (one all-reduce in a batch without news). The model's malformed calls do not count."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from tests.dist_helpers import run_ranks
from tests.rl.test_agent import ScriptedEngine, _settings, demo, tokenizer  # noqa: F401 - fixtures
from veomni_lite.config import ConfigError
from veomni_lite.rl.config import RLConfig
from veomni_lite.rl.tools import MIN_TOOL_CALLS, ToolCall, ToolErrors, ToolFailureError, load_tools, run_tool_calls

TOOLS = '''
def lookup(name: str) -> str:
    """Looks a monster up.

    Args:
        name: The monster.
    """
    if name == "wyvern":
        raise RuntimeError("bestiary offline")
    if name == "hydra":
        raise ValueError("too many heads")
    return "a monster"


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b
'''
OFFLINE = "RuntimeError: bestiary offline"


@pytest.fixture(scope="module")
def tools(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("tools") / "bestiary.py"
    path.write_text(TOOLS)
    return load_tools([f"{path}:lookup", f"{path}:add"])


def test_the_tools_own_failures_are_told_apart_from_the_models_errors(tools):
    calls = [ToolCall("lookup", {"name": "wyvern"}), ToolCall("lookup", {"name": "imp"}),
             ToolCall("lookup", {"nom": "imp"}), ToolCall("nope", {})]  # fmt: skip
    results = run_tool_calls(tools, calls, ["{bad"], timeout_s=20)
    assert [(r.ran, r.failure, r.error) for r in results] == [
        (True, OFFLINE, True), (True, "", False), (False, "", True), (False, "", True), (False, "", True)
    ]  # fmt: skip
    assert results[0].text == f"error: {OFFLINE}" and results[1].text == "a monster"
    assert results[2].text == "error: TypeError: lookup(): missing a required argument: 'name'"


def test_a_tool_failing_above_the_rate_fails_naming_it_and_its_first_exception(tools, caplog):
    errors = ToolErrors(tools, 0.5)
    runs = [("lookup", OFFLINE)] * MIN_TOOL_CALLS + [("add", "")] * 40
    with caplog.at_level(logging.WARNING, "veomni_lite.rl.tools"), pytest.raises(ToolFailureError) as raised:
        errors.check(runs, where="rollout batch 3: ")
    where = tools[0].where
    assert str(raised.value) == (
        f"rollout batch 3: rank 0: tool lookup ({where}) failed in {MIN_TOOL_CALLS} of its {MIN_TOOL_CALLS} calls of "
        f"the rollout batch (all ranks), more than rl.max_tool_error_rate = 0.5; its first error: {OFFLINE}"
    )
    assert [r.getMessage().split(" (the first")[0] for r in caplog.records] == [
        f"tool lookup ({where}) failed: {OFFLINE}"
    ]


def test_below_the_rate_or_the_minimum_of_calls_the_run_goes_on_and_each_kind_is_named_once(tools, caplog):
    errors = ToolErrors(tools, 0.5)
    half = [("lookup", OFFLINE), ("lookup", "")] * MIN_TOOL_CALLS  # exactly the rate: not more
    few = [("lookup", OFFLINE)] * (MIN_TOOL_CALLS - 1)  # every call failed, but too few calls
    with caplog.at_level(logging.WARNING, "veomni_lite.rl.tools"):
        for runs in (half, few, half + [("lookup", "ValueError: too many heads"), ("lookup", "")]):
            errors.check(runs)
    kinds = [r.getMessage().split(" failed: ")[1].split(":")[0] for r in caplog.records]
    assert kinds == ["RuntimeError", "ValueError"], "each (tool, kind of error) once, over the batches"
    assert "16 of its 32 calls in this rollout batch failed" in caplog.records[0].getMessage()
    never = ToolErrors(tools, 1.0)
    never.check([("lookup", OFFLINE)] * 100)  # 1: never
    with pytest.raises(ConfigError, match=r"rl.max_tool_error_rate: must be in \[0, 1\].*got 1.5"):
        RLConfig(max_tool_error_rate=1.5).validate_multi_turn(None)  # checked with the other multi-turn keys
    with pytest.raises(ConfigError, match=r"rl.max_tool_error_rate: must be in \[0, 1\].*got -0.1"):
        RLConfig(max_tool_error_rate=-0.1).validate_multi_turn(None)


def _ranked(rank: int, world: int, path: str, runs_by_rank: dict[int, list[tuple[str, str]]]) -> dict:
    import torch.distributed as dist

    from tests.dist_helpers import counting_calls
    from veomni_lite.rl.tools import ToolErrors, load_tools

    logged: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("veomni_lite.rl.tools").addHandler(handler)
    errors = ToolErrors(load_tools([f"{path}:lookup", f"{path}:add"]), 0.5)
    with counting_calls(dist, "all_reduce") as reduces, counting_calls(dist, "all_gather_object") as gathers:
        try:
            errors.check(runs_by_rank[rank], log=rank == 0, where="rollout batch 0: ")
            outcome = "ok"
        except ToolFailureError as exc:
            outcome = str(exc)
    return {"outcome": outcome, "logged": logged, "reduces": len(reduces), "gathers": len(gathers)}


@pytest.mark.slow
def test_a_tool_failing_on_one_rank_only_is_named_by_rank_0_and_fails_every_rank_alike(tools, tmp_path: Path):
    path = tools[0].where.rsplit(":", 1)[0]
    failing = {0: [("add", "")] * 4, 1: [("lookup", "")] * 4 + [("lookup", OFFLINE)] * MIN_TOOL_CALLS}
    outcomes = run_ranks(_ranked, 2, path, failing, timeout_s=300)
    assert all(status == "ok" for status, _ in outcomes.values()), outcomes
    zero, one = (outcomes[r][1] for r in (0, 1))
    assert zero["outcome"] == one["outcome"]
    assert zero["outcome"].startswith(f"rollout batch 0: rank 1: tool lookup ({tools[0].where}) failed in 16 of its 20")
    assert zero["outcome"].endswith(f"its first error: {OFFLINE}")
    assert zero["logged"] == [
        f"tool lookup ({tools[0].where}) failed: {OFFLINE} (the first RuntimeError of this tool; 16 of its 20 calls "
        "in this rollout batch failed, all ranks; the run stops above rl.max_tool_error_rate = 0.5 once it ran 16 "
        "times in one)"
    ]  # docs/agents.md quotes it
    assert one["logged"] == [], "rank 0 alone names it"
    # a tool failing in more than half of its calls over the ranks, though on neither rank alone MIN_TOOL_CALLS times
    split = {r: [("lookup", OFFLINE)] * 6 + [("lookup", "")] * 4 for r in (0, 1)}
    outcomes = run_ranks(_ranked, 2, path, split, timeout_s=300)
    assert all("failed in 12 of its 20 calls" in value["outcome"] for _, value in outcomes.values()), outcomes
    # negative control: at the rate (10 of 20), and without news, the check is one all-reduce and no gather
    quiet = {r: [("lookup", ""), ("add", "")] * 10 for r in (0, 1)}
    outcomes = run_ranks(_ranked, 2, path, quiet, timeout_s=300)
    assert [value for _, value in outcomes.values()] == [
        {"outcome": "ok", "logged": [], "reduces": 1, "gathers": 0}
    ] * 2


@pytest.mark.parametrize("monster", ["wyvern", "imp"])
def test_a_rollout_batch_of_episodes_whose_tool_keeps_failing_stops_the_run(tools, demo, tokenizer, monster):  # noqa: F811
    """Through `generate_episodes`: 16 episodes each calling `lookup` once; it raises every time for a wyvern (the
    run stops, naming it), never for an imp (the control: the batch's samples come back, the rate logged as 0)."""
    from types import SimpleNamespace

    from veomni_lite.rl.episodes import Agent, episode_metrics, generate_episodes
    from veomni_lite.rl.rollout_batch import sample_seed

    prompts = [
        SimpleNamespace(messages=[{"role": "user", "content": "Who?"}], columns={}, answer="x", where=f"row {i}",
                        model_inputs={})
        for i in range(4)
    ]  # fmt: skip
    call = '<tool_call>{"name": "lookup", "arguments": {"name": "' + monster + '"}}</tool_call>'
    scripts = {sample_seed(0, 0, i, j): [call, "done"] for i in range(4) for j in range(4)}
    agent = Agent(tokenizer, tools, max_turns=2, max_episode_tokens=400, tool_timeout_s=20)
    context = SimpleNamespace(seed=0, agent=agent, control_group=None, engine=ScriptedEngine(tokenizer, scripts),
                              parallel=SimpleNamespace(rank=0, world_size=1))  # fmt: skip
    no_rewards = lambda context, k, samples, prompts, step: None  # noqa: E731
    generate = lambda: generate_episodes(  # noqa: E731
        context, 0, prompts, [0, 1, 2, 3], 4, _settings(tokenizer), 0, sample_seed, no_rewards
    )
    if monster == "imp":
        samples = generate()
        assert len(samples) == 16 and float(episode_metrics(samples)["rl/tool_error_rate/lookup"][0]) == 0
        return
    with pytest.raises(
        ToolFailureError, match=f"rollout batch 0: rank 0: tool lookup .* failed in 16 of its 16 calls .*{OFFLINE}"
    ):
        generate()
