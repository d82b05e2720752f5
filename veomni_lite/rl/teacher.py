"""On-policy distillation (`rl.teacher`): a teacher's log-probabilities of the student's sampled tokens, a stage of
the rollout pipeline (`veomni_lite.rl.pipeline`), and the per-token reverse KL as the advantage (`PolicyLoss`).

The teacher is one of
- `pretrained_dir: DIR`: a transformers causal LM directory (local files only, no code from it runs), run in process,
  unsharded and frozen, on its own placement `device` (`auto`: this rank's training device; `cpu`; any torch device)
  in `dtype` (float32 | bfloat16 | float16 | float64 | auto, the directory's own), `batch_size` sequences per forward
  (right-padded under an attention mask);
- `url: BASE`: a vLLM server (OpenAI-compatible; `BASE` without `/v1`, e.g. http://127.0.0.1:8001): one
  `POST {url}/v1/completions` per sequence with the prompt + response ids, `max_tokens` 1 and `prompt_logprobs` 0
  (vLLM then returns each prompt token's log-probability under the raw logits), `max_concurrency` at a time, each
  within `request_timeout_s`; `model` the served name (default: the server's first, `GET {url}/v1/models`),
  `api_key_env` the name of an environment variable holding its key.
Either way the teacher's log-probabilities are at temperature 1 (the teacher's own distribution), of the student's
tokens: the teacher must read the student's ids, so its tokenizer must be the student's. A directory's vocabulary
(`get_vocab()`, every token and id) must equal the student's; a server must tokenize a probe (the first prompt as the
student renders it) into the student's ids (`POST {url}/tokenize`). Else a ConfigError naming both (checked on every
rank with the run's data, before any collective).

The stage (collective): the rollout batch's samples (every rank holds every sample) in consecutive chunks of
`batch_size`, chunk c scored by rank c mod world (the chunks do not depend on the layout, so neither do the values),
then all-gathered; a failure on any rank (a forward, a request) is a `TeacherError` on every rank naming it (`agree`).
Each sample keeps `teacher_logprobs` (one per response token; a checkpointed batch resumes with them).

The advantage (`PolicyLoss`, `coef` = `rl.teacher.coef`): at each response token t,
    A_t = A + -coef * (old_t - teacher_t)
with A the sample's advantage from the rewards (`rl.advantage`; 0 without rewards: a group's equal rewards get 0) and
old_t the student's log-probability of the token under the weights that sampled it (the old pass's; on policy the
training forward's own, detached): the per-token reverse KL log pi_student - log pi_teacher of the sampled token,
negated. `rl/teacher/reverse_kl` is its mean over the response tokens.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from veomni_lite.config import ConfigError, build_section
from veomni_lite.distributed.collectives import agree, all_gather_objects
from veomni_lite.rl.rollouts import RolloutSample

__all__ = ["LocalTeacher", "ServedTeacher", "TeacherError", "TeacherSettings", "make_teacher", "teacher_logprobs"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "float64": torch.float64, "auto": "auto"}  # fmt: skip


class TeacherError(RuntimeError):
    """The teacher failed on some rank (its forward, or its server); raised on every rank alike."""


@dataclass(frozen=True)
class TeacherSettings:
    """`rl.teacher` (see the module docstring): `pretrained_dir` or `url`, exactly one, and `coef`."""

    pretrained_dir: str = ""
    url: str = ""
    coef: float = 1.0
    """The reverse KL's weight in the advantage: A_t = A - coef (old_t - teacher_t)."""
    batch_size: int = 8
    """Sequences per teacher forward, and per rank's chunk of the batch."""
    device: str = "auto"
    dtype: str = "float32"
    model: str = ""
    api_key_env: str = ""
    request_timeout_s: float = 120.0
    max_concurrency: int = 8

    @classmethod
    def parse(cls, raw: TeacherSettings | Mapping[str, Any]) -> TeacherSettings:
        """`rl.teacher` as the config loader read it (or a mapping, read the same way), checked; a bad key or value
        is a ConfigError naming it."""
        settings = raw if isinstance(raw, cls) else build_section(cls, raw, "rl.teacher")
        if bool(settings.pretrained_dir) == bool(settings.url):
            raise ConfigError("rl.teacher: set pretrained_dir (a model directory run in process) or url (a vLLM "
                              "server), exactly one")  # fmt: skip
        if settings.pretrained_dir and not (Path(settings.pretrained_dir) / "config.json").is_file():
            raise ConfigError(f"rl.teacher.pretrained_dir: {settings.pretrained_dir} holds no config.json")
        if not settings.coef > 0:
            raise ConfigError(f"rl.teacher.coef: must be > 0, got {settings.coef}")
        if settings.batch_size < 1 or settings.max_concurrency < 1 or not settings.request_timeout_s > 0:
            raise ConfigError("rl.teacher.batch_size, max_concurrency, request_timeout_s: must be positive")
        if settings.dtype not in _DTYPES:
            raise ConfigError(f"rl.teacher.dtype: one of {sorted(_DTYPES)}, got {settings.dtype!r}")
        if settings.api_key_env and settings.api_key_env not in os.environ:
            raise ConfigError(f"rl.teacher.api_key_env: the environment variable {settings.api_key_env} is not set")
        return settings

    @property
    def where(self) -> str:
        """How errors name the teacher."""
        return f"the teacher {self.pretrained_dir or self.url}"


class LocalTeacher:
    """A teacher directory run in process (module docstring); the model is loaded at the first call and kept."""

    def __init__(self, settings: TeacherSettings) -> None:
        self.settings = settings

    @functools.cached_property
    def model(self) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        from veomni_lite.models.pretrained import LOCAL_ONLY

        s = self.settings
        device = s.device
        if device == "auto":
            device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
        model = AutoModelForCausalLM.from_pretrained(s.pretrained_dir, dtype=_DTYPES[s.dtype], **LOCAL_ONLY)
        return model.to(device).eval().requires_grad_(False)

    def vocabulary(self) -> dict[str, int]:
        from veomni_lite.models.pretrained import load_tokenizer

        return dict(load_tokenizer(self.settings.pretrained_dir).get_vocab())

    @torch.no_grad()
    def logprobs(self, sequences: Sequence[tuple[list[int], int]]) -> list[list[float]]:
        """log p_teacher of each (ids, n)'s last n ids, each given the ids before it, `batch_size` rows a forward."""
        out: list[list[float]] = []
        size = self.settings.batch_size
        for start in range(0, len(sequences), size):
            out += self._forward(sequences[start : start + size])
        return out

    def _forward(self, sequences: Sequence[tuple[list[int], int]]) -> list[list[float]]:
        model = self.model
        device = next(model.parameters()).device
        lengths = [len(ids) for ids, _ in sequences]
        ids = torch.zeros(len(sequences), max(lengths), dtype=torch.long)
        mask = torch.arange(ids.shape[1])[None] < torch.tensor(lengths)[:, None]
        ids[mask] = torch.tensor([t for row, _ in sequences for t in row])
        logits = model(input_ids=ids.to(device), attention_mask=mask.long().to(device)).logits
        logp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
        targets = logp[:, :-1].gather(-1, ids[:, 1:, None].to(device))[..., 0].double().cpu()
        return [targets[row, length - 1 - n : length - 1].tolist() for row, (length, (_, n)) in
                enumerate(zip(lengths, sequences))]  # fmt: skip


class ServedTeacher:
    """A teacher behind a vLLM server's completions API (module docstring)."""

    def __init__(self, settings: TeacherSettings) -> None:
        from veomni_lite.engines.vllm.client import Client, Endpoint
        from veomni_lite.engines.vllm.settings import VLLMSettings

        self.settings = settings
        key = os.environ.get(settings.api_key_env, "") if settings.api_key_env else ""
        self.client = Client(VLLMSettings(request_timeout_s=settings.request_timeout_s), key)  # errors name the URL
        self.endpoint = Endpoint(settings.url.rstrip("/"), None, None, settings.model or None)  # type: ignore[arg-type]

    def _ready(self) -> None:
        self.client.ready([self.endpoint], 0.0)

    def tokenize(self, text: str) -> list[int]:
        """The server's ids of `text` (no special tokens added)."""
        self._ready()
        body = {"model": self.endpoint.model_name, "prompt": text, "add_special_tokens": False}
        answer = self.client.call(self.endpoint, "POST", "/tokenize", body, "tokenize the probe")
        if not isinstance(answer, Mapping) or not isinstance(answer.get("tokens"), list):
            raise ConfigError(f"{self.settings.where}: POST /tokenize answered {str(answer)[:200]!r}")
        return [int(t) for t in answer["tokens"]]

    def logprobs(self, sequences: Sequence[tuple[list[int], int]]) -> list[list[float]]:
        """log p_teacher of each (ids, n)'s last n ids (prompt log-probabilities, `max_concurrency` requests at a
        time)."""
        self._ready()

        def one(sequence: tuple[list[int], int]) -> list[float]:
            ids, n = sequence
            return self.client.prompt_logprobs(self.endpoint, ids)[len(ids) - 1 - n :]

        with ThreadPoolExecutor(self.settings.max_concurrency, "teacher") as pool:
            return list(pool.map(one, sequences))


def make_teacher(
    raw: TeacherSettings | Mapping[str, Any], student_dir: str, tokenizer: Any, probe_ids: list[int], vision: bool
) -> LocalTeacher | ServedTeacher:
    """The teacher of `rl.teacher`, its tokenizer checked against the student's (`tokenizer`, of `student_dir`;
    `probe_ids`: a prompt, whose text a server must tokenize as the student does); a ConfigError naming both
    otherwise, or for a vision-language student (`vision`)."""
    settings = TeacherSettings.parse(raw)
    if vision:
        raise ConfigError("rl.teacher: distillation scores text sequences; the policy is a vision-language model")
    if settings.pretrained_dir:
        teacher: LocalTeacher | ServedTeacher = LocalTeacher(settings)
        mine, theirs = dict(tokenizer.get_vocab()), teacher.vocabulary()
        if mine != theirs:
            differ = sorted(set(mine.items()) ^ set(theirs.items()), key=lambda item: item[1])[:3]
            raise ConfigError(
                f"rl.teacher.pretrained_dir: the teacher {settings.pretrained_dir} has another tokenizer than the "
                f"student {student_dir} ({len(theirs)} tokens against {len(mine)}; first differences (token, id): "
                f"{differ}); the teacher scores the student's token ids, so it needs the student's tokenizer"
            )
        return teacher
    teacher = ServedTeacher(settings)
    probe = tokenizer.decode(probe_ids, skip_special_tokens=False)
    mine_ids = list(tokenizer(probe, add_special_tokens=False)["input_ids"])
    try:
        theirs_ids = teacher.tokenize(probe)
    except RuntimeError as exc:  # the server's EngineError (unreachable, an HTTP error) as a config error
        raise ConfigError(f"rl.teacher.url: {exc}") from exc
    if mine_ids != theirs_ids:
        at = next(
            (i for i, (a, b) in enumerate(zip(mine_ids, theirs_ids)) if a != b), min(len(mine_ids), len(theirs_ids))
        )
        raise ConfigError(
            f"rl.teacher.url: the teacher at {settings.url} tokenizes the probe {probe[:60]!r} otherwise than the "
            f"student {student_dir} (first difference at token {at}: {theirs_ids[at : at + 3]} against "
            f"{mine_ids[at : at + 3]}); the teacher scores the student's token ids, so it needs the student's tokenizer"
        )
    return teacher


def teacher_logprobs(context: Any, samples: list[RolloutSample], where: str) -> None:
    """The teacher's stage (collective; module docstring): every sample's `teacher_logprobs`, chunk c of
    `batch_size` samples scored by rank c mod world, all-gathered; a failure on any rank a TeacherError on every rank
    naming `where` (the batch) and the rank."""
    teacher, parallel = context.teacher, context.parallel
    size = teacher.settings.batch_size
    chunks = range(parallel.rank * size, len(samples), parallel.world_size * size)
    mine: dict[int, list[float]] = {}
    problem: Exception | None = None
    try:
        for start in chunks:
            chunk = samples[start : start + size]
            values = teacher.logprobs([(s.prompt_ids + s.response_ids, len(s.response_ids)) for s in chunk])
            mine.update(zip(range(start, start + len(chunk)), values))
    except Exception as exc:  # noqa: BLE001 - agreed below, then raised on every rank
        problem = exc
    agree(problem, TeacherError, context.control_group, where=f"{where}: {teacher.settings.where}: ")
    for part in all_gather_objects(mine, context.control_group):
        for index, values in part.items():
            samples[index].teacher_logprobs = values
