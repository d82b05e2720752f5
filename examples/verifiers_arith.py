"""A verifiers environment written in verifiers' own API (`verifiers.v1`), for `make train-envs`: the arithmetic word
problems of `examples.rl_math` that its warm start did not train on, two tries each.

`rl.environment: verifiers:examples/verifiers_arith.py` loads it (`veomni_lite.rl.hubs`); as a package installed from
the Environments Hub it would be `verifiers:NAME`. Its parts, as verifiers runs them:
- `ArithTaskset.load`: the tasks (a prompt and its `answer`): `examples.rl_math.problems` of the demo's draw after its
  `sft_rows` warm-start rows (`rl_math.write_data`'s `rl_train` and `rl_eval` problems, in order), `size` of them;
- `ArithTask.correct` (`@vf.reward`): 1.0 when the last number of the final reply is the answer on the first try, 0.5
  on the second, else 0;
- `ArithEnv.run`: the turn logic: the model answers; a wrong answer gets "Not quite. Try again." and one more turn.
"""

from __future__ import annotations

import re

import verifiers.v1 as vf

from examples.rl_math import problems

RETRY = "Not quite. Try again."


class ArithData(vf.TaskData):
    answer: str


class ArithTask(vf.Task[ArithData]):
    @vf.reward
    async def correct(self, trace: vf.Trace) -> float:
        replies = [message.content or "" for message in trace.assistant_messages]
        if not replies or last_number(replies[-1]) != self.data.answer:
            return 0.0
        return 1.0 if len(replies) == 1 else 0.5


class ArithTasksetConfig(vf.TasksetConfig):
    sft_rows: int = 300
    """The warm start's rows of the draw, skipped (`examples.rl_math.write_demo`'s default)."""
    draw: int = 4500
    """The demo's draw (`sft_rows + rl_rows + eval_rows` of `rl_math.write_demo`: the same problems, in order)."""
    seed: int = 0


class ArithTaskset(vf.Taskset[ArithTask, ArithTasksetConfig]):
    def load(self):
        for row in problems(self.config.draw, self.config.seed)[self.config.sft_rows :]:
            yield ArithTask(ArithData(prompt=row["question"], answer=row["answer"]), self.config.task)


class ArithEnvConfig(vf.EnvConfig):
    solver: vf.AgentConfig = vf.AgentConfig()
    tries: int = 2


class ArithEnv(vf.Env[ArithEnvConfig]):
    async def run(self, task, agents):
        async with agents.solver.interaction(task) as chat:
            segment = await chat.turn()
            for _ in range(self.config.tries - 1):
                if segment.terminated or last_number(segment.last_reply) == task.data.answer:
                    break
                segment = await chat.turn(RETRY)


def last_number(text: str) -> str | None:
    numbers = re.findall(r"-?\d+", text)
    return numbers[-1] if numbers else None


__all__ = ["ArithEnv", "ArithTaskset"]
