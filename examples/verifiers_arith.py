"""A verifiers environment written in verifiers' own API (`verifiers.v1`), for `make train-envs`: arithmetic word
problems that `make train-rl-math`'s warm start did not train on, two tries each.

`rl.environment: verifiers:examples/verifiers_arith.py` loads it (`veomni_lite.rl.hubs`); a package installed from the
Environments Hub would be `verifiers:NAME`. Its parts, as verifiers runs them:
- `ArithTaskset.load`: the tasks (a prompt and its `answer`), read from the JSON Lines files of `paths` (default: the
  held-out `rl_eval.jsonl`, 200 problems, then `rl_train.jsonl` of `python -m examples.rl_math outputs/rl_math`; the
  warm start trained on neither);
- `ArithTask.correct` (`@vf.reward`): 1.0 when the final reply is the answer on the first try, 0.5 on the second,
  else 0; "is the answer" as `make train-rl-math`'s `math` reward judges it (math-verify's equivalence, which also
  counts a reply whose expression evaluates to it, "4 + 6" for 10);
- `ArithEnv.run`: the turn logic: the model answers; a wrong answer gets "Not quite. Try again." and one more turn.
The file is self-contained (the trainer imports it by path): verifiers and math-verify are its only imports.
"""

from __future__ import annotations

import json
from pathlib import Path

import verifiers.v1 as vf

RETRY = "Not quite. Try again."


class ArithData(vf.TaskData):
    answer: str


class ArithTask(vf.Task[ArithData]):
    @vf.reward
    async def correct(self, trace: vf.Trace) -> float:
        replies = [message.content or "" for message in trace.assistant_messages]
        if not replies or not is_answer(replies[-1], self.data.answer):
            return 0.0
        return 1.0 if len(replies) == 1 else 0.5


class ArithTasksetConfig(vf.TasksetConfig):
    paths: list[str] = ["outputs/rl_math/rl_eval.jsonl", "outputs/rl_math/rl_train.jsonl"]
    """JSON Lines of `messages` (the user's question) and `answer` rows, read in order."""


class ArithTaskset(vf.Taskset[ArithTask, ArithTasksetConfig]):
    def load(self):
        for path in self.config.paths:
            for line in Path(path).read_text().splitlines():
                row = json.loads(line)
                yield ArithTask(
                    ArithData(prompt=row["messages"][-1]["content"], answer=row["answer"]), self.config.task
                )


class ArithEnvConfig(vf.EnvConfig):
    solver: vf.AgentConfig = vf.AgentConfig()
    tries: int = 2


class ArithEnv(vf.Env[ArithEnvConfig]):
    async def run(self, task, agents):
        async with agents.solver.interaction(task) as chat:
            segment = await chat.turn()
            for _ in range(self.config.tries - 1):
                if segment.terminated or is_answer(segment.last_reply, task.data.answer):
                    break
                segment = await chat.turn(RETRY)


def is_answer(reply: str, answer: str) -> bool:
    """math-verify's equivalence of the reply and the answer (the `math` reward's; the episode's environment runs on
    the main thread, where math-verify's own timeouts work)."""
    from math_verify import parse, verify

    predicted = parse(reply)
    return bool(predicted) and verify(parse(answer), predicted)


__all__ = ["ArithEnv", "ArithTaskset"]
