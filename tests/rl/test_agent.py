"""Multi-turn episodes: tools parsed and run (errors and hung tools become results the model reads), the episode's
tokens are the model's sampled ids plus the chat template's rendering of each environment turn (the whole sequence
equals the rendering of the conversation), limits truncate, environments reward and fail by name, the embedded engine
batches a turn's episodes, and bad entries are ConfigErrors with a did-you-mean."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from veomni_lite.config import ConfigError
from veomni_lite.engines.base import Rollout, RolloutEngine, SamplingSettings
from veomni_lite.rl.environments import EpisodeError, load_environment
from veomni_lite.rl.episodes import Agent, EpisodeStart, TemplateError, episode_metrics, run_episodes, turn_seed
from veomni_lite.rl.tools import ToolCall, load_tools, parse_tool_calls, run_tool_calls

TOOLS = '''
import time


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


def fail(x: str) -> str:
    """Always raises.

    Args:
        x: Anything.
    """
    raise RuntimeError("broken tool")


def sleep(seconds: float) -> str:
    """Sleeps.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "woke"


def undocumented(x):
    return x
'''

ENV = """
class Guess:
    def __init__(self, target: int = 7):
        self.target = target

    def reset(self, row):
        self.answer = int(row["answer"])
        return "Guess the number."

    def step(self, text):
        if text.strip() == str(self.answer):
            return "", 1.0, True
        return "Wrong, try again.", -0.25, False


class Broken(Guess):
    def step(self, text):
        if self.answer == 3:
            raise ValueError("no threes")
        return super().step(text)
"""


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("agent_files")
    (directory / "tools.py").write_text(TOOLS)
    (directory / "env.py").write_text(ENV)
    return directory


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from examples.agent_calc import write_demo

    return write_demo(tmp_path_factory.mktemp("agent_calc"), sft_rows=16, rl_rows=16, eval_rows=4)


@pytest.fixture(scope="module")
def tokenizer(demo: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(demo / "models/qwen2_agent"))


def test_tool_calls_parse_in_qwen_and_llama3_formats():
    text = 'ok <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call><tool_call>\n{"name": "f", ' \
           '"arguments": "{\\"x\\": 1}"}\n</tool_call>'  # fmt: skip
    assert parse_tool_calls(text) == ([ToolCall("add", {"a": 1, "b": 2}), ToolCall("f", {"x": 1})], [])
    llama = '<|python_tag|>{"name": "add", "parameters": {"a": 1}}'
    assert parse_tool_calls(llama) == ([ToolCall("add", {"a": 1})], [])
    assert parse_tool_calls("<tool_call>{not json</tool_call>") == ([], ["{not json"])
    assert parse_tool_calls('<tool_call>{"arguments": {}}') == ([], ['{"arguments": {}}'])  # no name, unclosed
    assert parse_tool_calls("The answer is 42.") == ([], [])
    assert parse_tool_calls('{"answer": 42}') == ([], [])  # JSON without a name is an answer, not a call


def test_tools_run_and_every_failure_is_a_result_the_model_reads(files: Path):
    tools = load_tools([f"{files}/tools.py:{name}" for name in ("add", "fail", "sleep")])
    assert [t.name for t in tools] == ["add", "fail", "sleep"]
    assert tools[0].schema["function"]["parameters"]["required"] == ["a", "b"]
    calls = [ToolCall("add", {"a": 2, "b": 3}), ToolCall("fail", {"x": "y"}), ToolCall("nope", {}),
             ToolCall("add", {"c": 1})]  # fmt: skip
    results = run_tool_calls(tools, calls, ["{bad"], timeout_s=20)
    assert results[0][:2] == ("add", "5")
    assert results[1][:2] == ("fail", "error: RuntimeError: broken tool")
    assert results[2].text.startswith("error: no tool named 'nope'")
    assert results[3].text == "error: TypeError: add(): missing a required argument: 'a'"
    assert results[4].name == "error" and "is not JSON" in results[4].text
    assert [r.error for r in results] == [False, True, True, True, True]
    start = time.perf_counter()
    (result,) = run_tool_calls(tools, [ToolCall("sleep", {"seconds": 60})], [], timeout_s=0.5)
    assert time.perf_counter() - start < 10, "a hung tool held the run"
    assert result.error and "ran over rl.tool_timeout_s = 0.5 s" in result.text and result.failure.startswith("Timeout")


def test_bad_tool_and_environment_entries_are_config_errors(files: Path):
    with pytest.raises(ConfigError, match=r"rl.tools\[0\].function: .*undocumented cannot be described as a tool"):
        load_tools([f"{files}/tools.py:undocumented"])
    with pytest.raises(ConfigError, match=r"rl.tools\[0\].fuction: unknown key \(did you mean `function`\?\)"):
        load_tools([{"fuction": f"{files}/tools.py:add"}])
    with pytest.raises(ConfigError, match=r"rl.tools\[1\]: a second tool named 'add'"):
        load_tools([f"{files}/tools.py:add", f"{files}/tools.py:add"])
    with pytest.raises(ConfigError, match=r"rl.tools\[0\].function: .*missing.py does not exist"):
        load_tools([f"{files}/missing.py:add"])
    with pytest.raises(ConfigError, match=r"rl.environment.kwarg: unknown key \(did you mean `kwargs`\?\)"):
        load_environment({"class": f"{files}/env.py:Guess", "kwarg": {}})
    with pytest.raises(ConfigError, match="is not a class with reset"):
        load_environment(f"{files}/tools.py:add")
    assert load_environment(f"{files}/env.py:Guess").cls.__name__ == "Guess"


class ScriptedEngine(RolloutEngine):
    """Plays each episode's scripted model turns (texts; keyed by episode seed) as the tokenizer encodes them, with
    the end-of-turn token after each unless the text ends with "..." (then cut: finish "length"); logs each call."""

    name = "scripted"

    def __init__(self, tokenizer, scripts: dict[int, list[str]]) -> None:
        self.tokenizer = tokenizer
        self.by_seed = {turn_seed(e, t): (e, t) for e, turns in scripts.items() for t in range(len(turns))}
        self.scripts = scripts
        self.calls: list[list[int]] = []
        self.prompts: dict[tuple[int, int], list[int]] = {}

    def sync_weights(self, state_dict, version):  # pragma: no cover - not used
        self._version = version

    def generate(self, requests, settings):
        out = []
        self.calls.append([self.by_seed[r.seeds[0]][0] for r in requests])
        for request in requests:
            episode, turn = self.by_seed[request.seeds[0]]
            self.prompts[episode, turn] = list(request.prompt_ids)
            text = self.scripts[episode][turn]
            ids = self.tokenizer(text.removesuffix("..."), add_special_tokens=False)["input_ids"]
            cut = text.endswith("...")
            ids = ids if cut else ids + [self.tokenizer.convert_tokens_to_ids("<|im_end|>")]
            ids = ids[: settings.max_new_tokens]
            out.append([Rollout(ids, [-0.5] * len(ids), "length" if cut else "stop")])
        return out


def _settings(tokenizer, max_new_tokens: int = 64) -> SamplingSettings:
    return SamplingSettings(max_new_tokens, stop_ids=(tokenizer.convert_tokens_to_ids("<|im_end|>"),))


def _start(seed: int, answer: str = "12") -> EpisodeStart:
    return EpisodeStart([{"role": "user", "content": "What is 3 * 4?"}], {"answer": answer}, f"row {seed}", seed, seed)


def test_an_episode_is_the_sampled_ids_plus_the_templates_environment_turns(demo: Path, tokenizer):
    tools = load_tools([f"{demo}/calculator.py:calculate"])
    call = '<tool_call>{"name": "calculate", "arguments": {"expression": "3 * 4"}}</tool_call>'
    scripts = {
        0: [call, "12"],  # a call, then the answer
        1: ["12"],  # answers at once
        2: ["<tool_call>{oops</tool_call>", call, "12"],  # a call that does not parse, then a good one
        3: [call, call, call, call],  # calls until rl.max_turns
        4: ["1 2 3 4 5 6 7 8..."],  # cut at max_new_tokens
    }
    engine = ScriptedEngine(tokenizer, scripts)
    agent = Agent(tokenizer, tools, max_turns=3, max_episode_tokens=400, tool_timeout_s=20)
    episodes, problem = run_episodes(engine, [_start(e) for e in scripts], _settings(tokenizer), agent)
    assert problem is None
    assert engine.calls == [[0, 1, 2, 3, 4], [0, 2, 3], [2, 3]]  # each turn: every unfinished episode, together
    schemas = [t.schema for t in tools]
    for episode in episodes:
        # the whole sequence is the template's rendering of the conversation, tokenized: no token re-made
        # (up to the model's last <|im_end|>: the template's "\n" after it is not sampled; a turn cut at
        # max_new_tokens is not in the messages)
        cut = episode.start.seed == 4
        full = tokenizer.apply_chat_template(episode.messages, tools=schemas, tokenize=False, add_generation_prompt=cut)
        full = full if cut else full[: full.rindex("<|im_end|>") + len("<|im_end|>")]
        ids = episode.prompt_ids if cut else episode.prompt_ids + episode.response_ids
        assert ids == tokenizer(full, add_special_tokens=False)["input_ids"], episode.start.seed
        model = [t for t, m in zip(episode.response_ids, episode.response_mask) if m]
        assert [lp for lp, m in zip(episode.logprobs, episode.response_mask) if m] == [-0.5] * len(model)
        assert all(lp == 0.0 for lp, m in zip(episode.logprobs, episode.response_mask) if not m)
        for (seed, _), prompt in engine.prompts.items():  # each turn's prompt: the episode so far, token for token
            if seed == episode.start.seed:
                assert prompt == (episode.prompt_ids + episode.response_ids)[: len(prompt)]
    one, two, three, four, five = episodes
    assert [t["role"] for t in one.turns] == ["assistant", "tool", "assistant"]
    assert "<tool_response>\n12\n</tool_response>" in one.turns[1]["text"]
    assert one.turns[1]["text"].startswith("\n<|im_start|>user\n")  # after the sampled <|im_end|>: its "\n"
    assert one.last_text == "12" and not one.truncated and one.tool_calls == {"calculate": 1}
    assert two.turns == [{"role": "assistant", "text": "12", "tokens": len(two.response_ids)}]
    assert three.tool_errors == 1 and "is not JSON" in three.turns[1]["text"] and three.last_text == "12"
    assert four.truncated and four.model_turns == 3 and four.turns[-1]["role"] == "assistant"  # no trailing tool turn
    assert five.truncated and five.model_turns == 1
    samples = [e.sample() for e in episodes]
    metrics = episode_metrics(samples)
    assert float(metrics["rl/turns/mean"][0]) == 2 + 1 + 3 + 3 + 1 and metrics["rl/turns/mean"][1] == 5
    assert float(metrics["rl/turns/max"]) == 3
    assert float(metrics["rl/tool_calls/mean"][0]) == 1 + 0 + 1 + 3 + 0
    assert float(metrics["rl/tool_calls/calculate"][0]) == 5
    assert float(metrics["rl/tool_errors"][0]) == 1 and float(metrics["rl/episode_truncated"][0]) == 2
    labels = samples[0].tensors()["policy_labels"][len(samples[0].prompt_ids) :]
    assert [int(x != -100) for x in labels] == samples[0].response_mask and 0 in samples[0].response_mask


def test_an_episode_under_qwen25s_tool_template_from_a_standard_tool_calling_row(files: Path, tmp_path: Path):
    """A prompt row with a tool-calling history (assistant `tool_calls`, a `tool` turn), as the SFT data path hands
    it to the agent; the model calls two tools at once: the results are the template's one user turn of two
    `<tool_response>` blocks, and the episode's ids are still the whole rendering's tokens."""
    from tests.data.test_sft_tools import QWEN25, tool_tokenizer
    from veomni_lite.data.sft import ChatEncoder, to_conversation

    tokenizer = tool_tokenizer(tmp_path, QWEN25)
    call = {"type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
    row = {"messages": [
        {"role": "system", "content": "You add."}, {"role": "user", "content": "1 + 2?"},
        {"role": "assistant", "content": None, "tool_calls": [call]}, {"role": "tool", "content": "3"},
        {"role": "assistant", "content": "3"}, {"role": "user", "content": "30 + 4 and 5 + 6?"},
    ]}  # fmt: skip
    messages = ChatEncoder.prompt_messages(to_conversation(row, "messages", {}, "row 0"))
    block = '<tool_call>\n{{"name": "add", "arguments": {{"a": {}, "b": {}}}}}\n</tool_call>'
    scripts = {0: [block.format(30, 4) + "\n" + block.format(5, 6), "34 and 11"]}
    tools = load_tools([f"{files}/tools.py:add"])
    agent = Agent(tokenizer, tools, max_turns=3, max_episode_tokens=1000, tool_timeout_s=20)
    start = EpisodeStart(messages, {"answer": "x"}, "row 0", 0)
    settings = _settings(tokenizer, max_new_tokens=300)
    (episode,), problem = run_episodes(ScriptedEngine(tokenizer, scripts), [start], settings, agent)
    assert problem is None and episode.tool_calls == {"add": 2} and episode.tool_runs == [("add", "")] * 2
    assert block.format(1, 2) in episode.prompt_text and "# Tools" in episode.prompt_text  # the history, the schemas
    full = tokenizer.apply_chat_template(episode.messages, tools=[t.schema for t in tools], tokenize=False)
    full = full[: full.rindex("<|im_end|>") + len("<|im_end|>")]
    assert episode.prompt_ids + episode.response_ids == tokenizer(full, add_special_tokens=False)["input_ids"]
    assert [t["role"] for t in episode.turns] == ["assistant", "tool", "assistant"]
    assert episode.turns[1]["text"] == (
        "\n<|im_start|>user\n<tool_response>\n34\n</tool_response>\n<tool_response>\n11\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_max_episode_tokens_ends_an_episode_truncated(demo: Path, tokenizer):
    tools = load_tools([f"{demo}/calculator.py:calculate"])
    call = '<tool_call>{"name": "calculate", "arguments": {"expression": "3 * 4"}}</tool_call>'
    start = _start(0)
    agent = Agent(tokenizer, tools, max_turns=8, max_episode_tokens=10**6)
    prompt = len(agent.begin(start).prompt_ids)
    agent.max_episode_tokens = prompt + 40
    engine = ScriptedEngine(tokenizer, {0: [call] * 8})
    (episode,), _ = run_episodes(engine, [start], _settings(tokenizer), agent)
    assert episode.truncated and len(episode) <= prompt + 40 and episode.model_turns >= 1


def test_environments_reward_each_turn_and_fail_by_name(files: Path, tokenizer):
    env = load_environment(f"{files}/env.py:Guess")
    agent = Agent(tokenizer, [], env, max_turns=4, max_episode_tokens=400)
    engine = ScriptedEngine(tokenizer, {0: ["5", "12"], 1: ["1", "2", "3", "4"]})
    (right, wrong), problem = run_episodes(engine, [_start(0), _start(1)], _settings(tokenizer), agent)
    assert problem is None
    assert right.env_reward == -0.25 + 1.0 and not right.truncated and right.model_turns == 2
    assert right.messages[1] == {"role": "user", "content": "Guess the number."}  # reset's observation
    assert right.turns[1]["role"] == "user" and "Wrong, try again." in right.turns[1]["text"]
    assert wrong.env_reward == -0.25 * 4 and wrong.truncated
    broken = Agent(tokenizer, [], load_environment(f"{files}/env.py:Broken"), max_turns=4, max_episode_tokens=400)
    engine = ScriptedEngine(tokenizer, {0: ["5"], 1: ["5"]})
    _, problem = run_episodes(engine, [_start(0), _start(1, answer="3")], _settings(tokenizer), broken)
    assert isinstance(problem, EpisodeError)
    where = f"environment {files / 'env.py'}:Broken (Broken), row 1, turn 1"
    assert str(problem) == f"{where}: step raised ValueError: no threes"


def test_a_template_that_rewrites_earlier_turns_is_a_named_error(demo: Path, tokenizer):
    from examples.agent_calc import TEMPLATE

    # a template that drops every assistant turn but the last: the prefix property fails once a turn follows
    template = TEMPLATE.replace("{% else %}", "{% elif message['role'] == 'assistant' and not loop.last %}{% else %}")
    tools = load_tools([f"{demo}/calculator.py:calculate"])
    agent = Agent(tokenizer, tools, max_turns=3, max_episode_tokens=400, chat_template=template)
    call = '<tool_call>{"name": "calculate", "arguments": {"expression": "3 * 4"}}</tool_call>'
    _, problem = run_episodes(ScriptedEngine(tokenizer, {0: [call, "12"]}), [_start(0)], _settings(tokenizer), agent)
    assert isinstance(problem, TemplateError)
    assert "row 0, turn 1: the chat template renders the episode's earlier turns differently" in str(problem)


def test_the_embedded_engine_runs_a_turns_episodes_together_and_its_log_probabilities_are_the_models(demo, tokenizer):
    from transformers import AutoModelForCausalLM

    from veomni_lite.engines.embedded import TransformersEngine

    model = AutoModelForCausalLM.from_pretrained(str(demo / "models/qwen2_agent"), dtype=torch.float32)
    engine = TransformersEngine(model, torch.device("cpu"))
    tools = load_tools([f"{demo}/calculator.py:calculate"])
    agent = Agent(tokenizer, tools, max_turns=2, max_episode_tokens=200)
    episodes, problem = run_episodes(engine, [_start(s) for s in range(4)], _settings(tokenizer, 12), agent)
    assert problem is None and len(episodes) == 4
    for episode in episodes:  # an untrained model: cut at max_new_tokens, log-probs the model's own
        ids = torch.tensor([episode.prompt_ids + episode.response_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0].double(), -1)
        first = len(episode.prompt_ids) - 1
        expected = logp[first : first + len(episode.response_ids)].gather(-1, ids[0, first + 1 :, None])[:, 0]
        model_tokens = torch.tensor(episode.response_mask, dtype=torch.bool)
        got = torch.tensor(episode.logprobs, dtype=torch.float64)
        torch.testing.assert_close(got[model_tokens], expected[model_tokens], rtol=0, atol=1e-4)


def test_given_episodes_train_their_assistant_turns_only(tmp_path: Path):
    import json

    from veomni_lite.data.checks import DataError
    from veomni_lite.rl.rollouts import read_rollouts

    rows = [
        {"group": 0, "prompt_ids": [5, 6], "reward": 1.0, "turns": [
            {"role": "assistant", "ids": [7, 8]}, {"role": "tool", "text": "ab"}, {"role": "assistant", "ids": [9]}]},
        {"group": 0, "prompt_ids": [5, 6], "reward": 0.0, "response_ids": [7, 1]},
    ]  # fmt: skip
    path = tmp_path / "episodes.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    encode = lambda text: [ord(c) - 90 for c in text]  # noqa: E731 - "ab" -> [7, 8]
    first, second = read_rollouts(path, 2, None, encode, 2, 100)
    assert first.response_ids == [7, 8, 7, 8, 9] and first.response_mask == [1, 1, 0, 0, 1]
    labels = first.tensors()["policy_labels"].tolist()
    assert labels == [-100, -100, 7, 8, -100, -100, 9] and second.response_mask is None
    rows[0]["turns"][1] = {"role": "robot", "text": "ab"}
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError, match=r"row 0 \(0-based\): turns\[1\] must be \{role: one of"):
        read_rollouts(path, 2, None, encode, 2, 100)


def test_the_demos_sft_transcripts_call_the_tool_in_tool_fraction_of_rows_and_answer_the_rest_directly(demo: Path):
    import json
    import random

    from examples.agent_calc import sft_transcripts, write_demo

    schema = load_tools([f"{demo / 'calculator.py'}:calculate"])[0].schema

    def check(row: dict) -> bool:
        """The row is a standard tool-calling row (its last turn the question's product); whether it calls the tool."""
        messages = row["messages"]
        assert row["tools"] == [schema], "the schema rl.tools gives the template"
        a, b = (int(x) for x in messages[0]["content"].removeprefix("What is ").removesuffix("?").split(" * "))
        assert messages[-1] == {"role": "assistant", "content": str(a * b)}
        if len(messages) == 2:
            return False
        call = {"type": "function", "function": {"name": "calculate", "arguments": {"expression": f"{a} * {b}"}}}
        assert messages[1] == {"role": "assistant", "content": "", "tool_calls": [call]}
        assert messages[2] == {"role": "tool", "name": "calculate", "content": str(a * b)} and len(messages) == 4
        return True

    rows = [json.loads(line) for line in (demo / "sft_train.jsonl").read_text().splitlines()]
    kinds = [check(row) for row in rows]
    assert len(rows) == 16 and 0 < sum(kinds) < 16  # both kinds at the default fraction (0.3)
    drawn = [check(row) for row in sft_transcripts(random.Random(1), 2000, schema, 0.3)]
    assert 0.27 < sum(drawn) / len(drawn) < 0.33
    assert all(check(row) for row in sft_transcripts(random.Random(1), 20, schema, 1.0))
    assert not any(check(row) for row in sft_transcripts(random.Random(1), 20, schema, 0.0))
    with pytest.raises(ValueError, match="tool_fraction must be in"):
        write_demo(demo / "unused", tool_fraction=1.5)


def test_the_demos_tool_rows_train_the_call_and_the_answer_and_not_the_tools_result(demo: Path, tokenizer):
    """The standard row renders as the template writes an episode (tools header, call, result as a user turn)."""
    import json

    from examples.agent_calc import call_text
    from tests.data.test_sft import trained_runs
    from veomni_lite.data.sft import ChatEncoder, to_conversation

    rows = [json.loads(line) for line in (demo / "sft_train.jsonl").read_text().splitlines()]
    row = next(row for row in rows if len(row["messages"]) == 4)
    encoded = ChatEncoder(tokenizer).encode(to_conversation(row, "messages", {}, "demo"), [], "demo")
    question, _, result, answer = (m["content"] for m in row["messages"])
    rendered = tokenizer.decode(encoded.input_ids)
    assert rendered == tokenizer.apply_chat_template(row["messages"], tools=row["tools"], tokenize=False)
    assert rendered.startswith("<|im_start|>system\nYou can call tools.") and rendered.count("<tool_response>") == 1
    expression = question.removeprefix("What is ").removesuffix("?")
    assert trained_runs(tokenizer, encoded.input_ids, encoded.labels) == [
        call_text(expression) + "<|im_end|>",
        answer + "<|im_end|>",
    ]
    assert f"<|im_start|>user\n<tool_response>\n{result}\n</tool_response><|im_end|>" in rendered
