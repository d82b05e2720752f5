"""Environments and tasks from the hubs (`veomni_lite.rl.hubs`), with the real packages: a verifiers environment
written in verifiers' own API (its taskset as the prompts, its turn logic, its `@vf.stop` and `@vf.reward`), an
OpenEnv environment in process and through its client against a server the test starts, reasoning-gym tasks as a
prompt source scored by the task itself. Each episode is token in / token out: its ids are the tokenization of the
chat template's rendering of the conversation, and the environment's tokens are out of the loss (labels
IGNORE_INDEX; tests/rl/test_agent_exact.py proves such masks train exactly). A missing package is a ConfigError; an
environment that raises an EpisodeError naming it, the row and the turn, on every rank when it raises on one."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.rl.test_agent import ScriptedEngine, _settings
from veomni_lite.config import ConfigError
from veomni_lite.rl.environments import EpisodeError, load_environment
from veomni_lite.rl.episodes import Agent, EpisodeStart, run_episodes

pytest.importorskip("verifiers.v1")  # the `envs` extra (`make install` has it)
pytest.importorskip("openenv.core")
pytest.importorskip("reasoning_gym")

VERIFIERS_ENV = '''
"""Guess the task's number: the model answers; a wrong answer gets "Wrong, try again." while tries are left."""
import verifiers.v1 as vf


class GuessData(vf.TaskData):
    answer: str


class GuessTask(vf.Task[GuessData]):
    @vf.reward
    async def correct(self, trace: vf.Trace) -> float:
        return float(trace.last_reply == self.data.answer)

    @vf.reward(weight=-0.25)
    async def retries(self, trace: vf.Trace) -> float:
        return float(len(trace.assistant_messages) - 1)

    @vf.stop
    async def gave_up(self, trace: vf.Trace) -> bool:
        return trace.last_reply == "pass"


class GuessTasksetConfig(vf.TasksetConfig):
    size: int = 4


class GuessTaskset(vf.Taskset[GuessTask, GuessTasksetConfig]):
    def load(self):
        for i in range(self.config.size):
            yield GuessTask(GuessData(prompt=f"Say {i}.", system_prompt="Answer with a number.", answer=str(i)),
                            self.config.task)


class GuessEnvConfig(vf.EnvConfig):
    solver: vf.AgentConfig = vf.AgentConfig()
    tries: int = 3


class GuessEnv(vf.Env[GuessEnvConfig]):
    async def run(self, task, agents):
        if task.data.answer == "{broken}":
            raise RuntimeError("no such number")
        async with agents.solver.interaction(task) as chat:
            segment = await chat.turn()
            for _ in range(self.config.tries - 1):
                if segment.terminated or segment.last_reply == task.data.answer:
                    break
                segment = await chat.turn("Wrong, try again.")


__all__ = ["GuessTaskset", "GuessEnv"]
'''

OPENENV_ENV = '''
"""Guess the number (`reset(target=...)`): -0.25 a wrong guess, 1 the right one, which ends the episode."""
from pydantic import Field

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State


class GuessAction(Action):
    message: str = Field(..., description="the guess")


class GuessObservation(Observation):
    prompt: str = ""


class GuessEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self, hint: str = "Guess my number."):
        super().__init__()
        self.hint, self.target, self._state = hint, 0, State(step_count=0)

    def reset(self, seed=None, episode_id=None, target=0, **kwargs):
        self.target, self._state = int(target), State(step_count=0)
        return GuessObservation(prompt=self.hint)

    def step(self, action: GuessAction, timeout_s=None, **kwargs):
        self._state.step_count += 1
        if action.message.strip() == str(self.target):
            return GuessObservation(done=True, reward=1.0)
        if action.message.strip() == "boom":
            raise RuntimeError("the board exploded")
        return GuessObservation(prompt="Wrong, try again.", reward=-0.25)

    @property
    def state(self):
        return self._state


app = create_app(GuessEnvironment, GuessAction, GuessObservation, env_name="guess", max_concurrent_envs=8)
'''


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("hubs")
    (directory / "guess_vf.py").write_text(VERIFIERS_ENV.replace("{broken}", "-1"))
    (directory / "broken_vf.py").write_text(VERIFIERS_ENV.replace("{broken}", "2"))
    (directory / "guess_openenv.py").write_text(OPENENV_ENV)
    return directory


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    from transformers import AutoTokenizer

    from examples.agent_calc import write_demo

    demo = write_demo(tmp_path_factory.mktemp("hubs_demo"), sft_rows=16, rl_rows=16, eval_rows=4)
    return AutoTokenizer.from_pretrained(str(demo / "models/qwen2_agent"))


def _check_tokens(tokenizer, episode) -> None:
    """The episode's ids are the tokenization of its rendered conversation (up to the model's last end-of-turn), the
    sampled ids kept; the environment's turns, and nothing else, are out of the loss."""
    full = tokenizer.apply_chat_template(episode.messages, tokenize=False)
    full = full[: full.rindex("<|im_end|>") + len("<|im_end|>")]
    assert episode.prompt_ids + episode.response_ids == tokenizer(full, add_special_tokens=False)["input_ids"]
    sample = episode.sample()
    labels = sample.tensors()["policy_labels"][len(sample.prompt_ids) :]
    assert [int(x != -100) for x in labels] == sample.response_mask
    at = 0
    for turn in episode.turns:  # each turn's tokens: the model's in the loss, the environment's not
        assert set(sample.response_mask[at : at + turn["tokens"]]) == {int(turn["role"] == "assistant")}, turn
        at += turn["tokens"]
    assert at == len(sample.response_ids)


def _verifiers_starts(files: Path, name: str = "guess_vf.py") -> list[EpisodeStart]:
    from veomni_lite.rl.hubs import hub_sources

    spec = f"verifiers:{files / name}"
    (source,) = hub_sources(f"{spec}?skip=1&take=3", "data.train_path", spec, {"taskset": {"size": 4}})
    rows = list(source.read(0, source.num_rows))
    return [EpisodeStart(row["messages"], dict(row), f"{source.path} row {i}", i, i) for i, row in rows]


def test_a_verifiers_environment_plays_its_turn_logic_and_scores_with_its_own_rubric(files: Path, tokenizer):
    starts = _verifiers_starts(files)
    assert [s.columns["answer"] for s in starts] == ["1", "2", "3"]  # the taskset's view: skip 1, take 3
    assert starts[0].messages == [{"role": "system", "content": "Answer with a number."},
                                  {"role": "user", "content": "Say 1."}]  # fmt: skip
    environment = load_environment({"class": f"verifiers:{files / 'guess_vf.py'}", "kwargs": {"tries": 3}})
    agent = Agent(tokenizer, [], environment, max_turns=2, max_episode_tokens=400)
    scripts = {0: ["5", "1"], 1: ["pass"], 2: ["7", "8 9..."]}  # right at the 2nd try; gives up; wrong, then cut
    engine = ScriptedEngine(tokenizer, scripts)
    (right, gave_up, cut), problem = run_episodes(engine, starts, _settings(tokenizer, 8), agent)
    assert problem is None
    # the task's rewards, weighted as verifiers weighs them: correct 1 x 1, retries -0.25 x (replies - 1)
    assert right.env_reward == 1.0 - 0.25 and not right.truncated and right.model_turns == 2
    assert right.turns[1]["role"] == "user" and "Wrong, try again." in right.turns[1]["text"]
    assert [m.content for m in right.env.trace.messages] == [m["content"] for m in right.messages]
    assert gave_up.env_reward == 0.0 and gave_up.model_turns == 1 and not gave_up.truncated  # the @vf.stop ended it
    assert gave_up.env.trace.stop_condition == "gave_up"
    # rl.max_turns cut the last turn: the environment's pending turn came back terminated and the cut text, which it
    # had not seen, is the trace's last reply (scored: wrong)
    assert cut.truncated and cut.env_reward == -0.25 and cut.env.trace.last_reply == "8 9"
    for episode in (right, gave_up):
        _check_tokens(tokenizer, episode)


def test_a_plain_verifiers_taskset_is_one_turn_scored_by_its_rewards(files: Path, tokenizer):
    plain = files / "plain_vf.py"
    plain.write_text(VERIFIERS_ENV.split("class GuessEnvConfig")[0] + '__all__ = ["GuessTaskset"]\n')
    environment = load_environment(f"verifiers:{plain}")
    starts = _verifiers_starts(files, "plain_vf.py")
    engine = ScriptedEngine(tokenizer, {0: ["1"], 1: ["5"], 2: ["3"]})
    episodes, problem = run_episodes(engine, starts, _settings(tokenizer), Agent(tokenizer, [], environment))
    assert problem is None and [e.env_reward for e in episodes] == [1.0, 0.0, 1.0]
    assert [e.model_turns for e in episodes] == [1, 1, 1]


def test_a_verifiers_environment_that_raises_is_an_episode_error_naming_it(files: Path, tokenizer):
    environment = load_environment(f"verifiers:{files / 'broken_vf.py'}")
    starts = _verifiers_starts(files, "broken_vf.py")
    engine = ScriptedEngine(tokenizer, {0: ["1"], 1: ["2"], 2: ["3"]})
    _, problem = run_episodes(engine, starts, _settings(tokenizer), Agent(tokenizer, [], environment))
    assert isinstance(problem, EpisodeError)
    assert str(problem).startswith(f"environment verifiers:{files / 'broken_vf.py'} (VerifiersEpisode), ")
    assert str(problem).endswith("row 1, turn 0: reset raised RuntimeError: no such number")


@pytest.fixture(scope="module")
def openenv_server(files: Path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "guess_openenv:app", "--port", str(port), "--log-level", "warning"],
        cwd=files, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        import urllib.request

        for _ in range(600):
            try:
                urllib.request.urlopen(f"{url}/health", timeout=1).read()
                break
            except OSError:
                if server.poll() is not None:
                    pytest.fail(f"the OpenEnv server exited: {server.stderr.read().decode()[-2000:]}")
                time.sleep(0.2)
        yield url
    finally:
        server.terminate()
        server.wait(30)


@pytest.mark.slow
@pytest.mark.parametrize("where", ["in process", "server"])
def test_an_openenv_environment_in_process_and_through_its_client(files: Path, tokenizer, openenv_server, where):
    target = f"{files}/guess_openenv.py:GuessEnvironment" if where == "in process" else openenv_server
    environment = load_environment({"class": f"openenv:{target}", "kwargs": {"observation_field": "prompt"}})
    agent = Agent(tokenizer, [], environment, max_turns=3, max_episode_tokens=400)
    starts = [EpisodeStart([{"role": "system", "content": "Play."}], {"reset": {"target": i}}, f"row {i}", i, i)
              for i in range(3)]  # fmt: skip
    engine = ScriptedEngine(tokenizer, {0: ["0"], 1: ["5", "1"], 2: ["7", "8", "9"]})
    (first, second, never), problem = run_episodes(engine, starts, _settings(tokenizer), agent)
    assert problem is None
    assert first.messages[1] == {"role": "user", "content": "Guess my number."}  # reset's observation
    assert first.env_reward == 1.0 and second.env_reward == 0.75 and never.env_reward == -0.75 and never.truncated
    for episode in (first, second, never):
        _check_tokens(tokenizer, episode)
    engine = ScriptedEngine(tokenizer, {0: ["boom"]})
    _, problem = run_episodes(engine, starts[:1], _settings(tokenizer), agent)
    assert isinstance(problem, EpisodeError) and "row 0, turn 1: step raised" in str(problem)
    assert "the board exploded" in str(problem) or where == "server"  # the server answers with its own error text


def test_bad_openenv_entries_are_config_errors(files: Path):
    with pytest.raises(ConfigError, match=r"rl.environment_kwargs.action_feld: unknown key \(did you mean `action_f"):
        load_environment({"class": "openenv:http://127.0.0.1:1", "kwargs": {"action_feld": "x"}})
    with pytest.raises(ConfigError, match="is not an OpenEnv Environment subclass"):
        load_environment(f"openenv:{files}/guess_openenv.py:GuessAction")


def test_reasoning_gym_tasks_are_a_prompt_source_scored_by_the_task_itself():
    import reasoning_gym

    from veomni_lite.rl.hubs import hub_sources
    from veomni_lite.rl.rewards import RewardError, load_rewards, score

    spec = "reasoning_gym:basic_arithmetic?size=6&seed=3&max_terms=2&max_digits=1&operators=[+,-]"
    (source,) = hub_sources(spec, "data.train_path")
    rows = [row for _, row in source.read(0, source.num_rows)]
    options = {"max_terms": 2, "max_digits": 1, "operators": ["+", "-"]}
    expected = list(reasoning_gym.create_dataset("basic_arithmetic", size=6, seed=3, **options))
    assert [r["messages"] for r in rows] == [[{"role": "user", "content": e["question"]}] for e in expected]
    assert [r["answer"] for r in rows] == [e["answer"] for e in expected]
    (reward,) = load_rewards([{"name": "correct", "function": "reasoning_gym"}])
    completions = [e["answer"] if i % 2 else "nope" for i, e in enumerate(expected)]
    columns = [{k: v for k, v in r.items() if k != "answer"} for r in rows]
    total, _ = score([reward], [""] * 6, completions, [r["answer"] for r in rows], columns, [f"r{i}" for i in range(6)])
    own = [reasoning_gym.get_score_answer_fn("basic_arithmetic")(c, e) for c, e in zip(completions, expected)]
    assert total.tolist() == own == [0.0, 1.0] * 3
    with pytest.raises(RewardError, match="row x: the row has no reasoning-gym `metadata`"):
        reward(["p"], ["1"], ["1"], [{"question": "q"}], ["row x"])
    with pytest.raises(ConfigError, match=r"reasoning-gym has no task 'basic_arithmetc' \(did you mean `basic_arith"):
        hub_sources("reasoning_gym:basic_arithmetc?size=4", "data.train_path")


def test_a_missing_hub_package_is_a_config_error_saying_how_to_install_it(monkeypatch, files: Path):
    from veomni_lite.rl.hubs import hub_sources
    from veomni_lite.rl.rewards import load_rewards

    for module in ("verifiers.v1", "openenv.core", "reasoning_gym"):
        monkeypatch.setitem(sys.modules, module, None)  # import raises ImportError
    install = r"pip install -e '\.\[envs\]'"
    with pytest.raises(ConfigError, match=rf"rl.environment: verifiers needs the verifiers package .*{install}"):
        load_environment(f"verifiers:{files / 'guess_vf.py'}")
    with pytest.raises(ConfigError, match=rf"rl.environment: openenv needs the openenv-core package .*{install}"):
        load_environment("openenv:http://127.0.0.1:1")
    with pytest.raises(ConfigError, match=r"data.train_path: reasoning_gym needs the reasoning-gym package"):
        hub_sources("reasoning_gym:basic_arithmetic", "data.train_path")
    with pytest.raises(ConfigError, match=r"rl.rewards\[0\].function: the built-in 'reasoning_gym' needs reason"):
        load_rewards([{"name": "r", "function": "reasoning_gym"}])


# ---- through the trainer: DP=2, the environment failing on one rank's row


def _ranked(rank: int, world: int, args: list[str]) -> None:
    from tests.rl.test_agent_train import run

    run(args, world)


@pytest.mark.slow
def test_a_verifiers_environment_failing_on_one_ranks_row_is_the_same_named_error_on_every_rank(files, tmp_path):
    from examples.agent_calc import write_demo
    from tests.dist_helpers import run_ranks
    from veomni_lite.config import load_config
    from veomni_lite.rl.config import RLConfig
    from veomni_lite.rl.trainer import RLTrainer

    demo = write_demo(tmp_path / "demo", sft_rows=16, rl_rows=16, eval_rows=4)

    def args(env: Path, out: Path) -> list[str]:
        return [
            "--model.arch", "auto", "--model.pretrained_dir", str(demo / "models/qwen2_agent"),
            "--data.train_path", f"verifiers:{env}?take=4", "--data.format", "messages", "--data.max_seq_len", "96",
            "--rl.environment", f"verifiers:{env}", "--rl.environment_kwargs", "{taskset: {size: 4}}",
            "--rl.prompts_per_step", "2", "--rl.num_generations", "2", "--rl.max_new_tokens", "4",
            "--rl.max_turns", "2",
            "--train.micro_batch_size", "2", "--train.global_batch_size", "4", "--train.max_steps", "1",
            "--train.output_dir", str(out), "--logging.progress_bar", "false", "--logging.tensorboard", "false",
            "--logging.plot", "false",
        ]  # fmt: skip

    probe = RLTrainer(load_config(None, args(files / "guess_vf.py", tmp_path / "probe"), world_size=1,
                                  sections={"rl": RLConfig}))  # fmt: skip
    answer = probe.train_dataset.batch(0, 2, probe.config.train.seed)[1].answer  # prompt 1: rank 1's
    probe.metrics.close()
    probe.close()
    env = tmp_path / "one_rank_vf.py"
    env.write_text(VERIFIERS_ENV.replace("{broken}", str(answer)))
    outcomes = run_ranks(_ranked, 2, args(env, tmp_path / "run"), timeout_s=600)
    messages = [value.strip().splitlines()[-1] for status, value in outcomes.values()]
    assert all(status == "error" for status, _ in outcomes.values()), outcomes
    assert messages[0] == messages[1], messages
    assert messages[0].startswith("veomni_lite.rl.environments.EpisodeError: rollout batch 0: rank 1: environment "
                                  f"verifiers:{env} (VerifiersEpisode)")  # fmt: skip
    assert messages[0].endswith("turn 0: reset raised RuntimeError: no such number")
