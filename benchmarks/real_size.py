"""make bench: post-training at a real vocabulary: the peak memory and time per token of an SFT step, a GRPO step and a
DPO step through the trainers, on a tiny Qwen2 (hidden 64, 2 layers, untied embeddings, the arithmetic demo's
tokenizer) saved with Qwen's 151,936-token vocabulary, against the same jobs at a 1,024-token vocabulary.

One process per (job, vocabulary), one thread, one packed micro-batch of 4,096 tokens per step (32 sequences of 128
tokens, shared prompts off so that every job runs all of them): SFT on `messages` rows (prompt + response); GRPO on
given rollouts (`rl.rollouts_path`: 4 groups x 8 responses of 32 prompt + 96 response ids, one optimizer step per
rollout batch, so the old log-probabilities are the training forward's, and `rl.kl_coef` 0.05, so a reference forward
runs first: 2 forwards and 1 backward per step); DPO (`pref.loss` sigmoid, live reference: 16 pairs of 128-token sides,
2 forwards and 1 backward). Each worker builds its trainer, trains a warm-up step (AdamW's state), resets the peak RSS
(`/proc/self/clear_refs`) and trains the timed steps, then reads the peak (`VmHWM`; glibc returns large freed blocks to
the system: MALLOC_MMAP_THRESHOLD_ 64 KiB). Growth: a job's peak at vocabulary 151,936 less its peak at 1,024, in units
of one float32 [4,096, 151,936] tensor (2,374 MiB), the whole logits the policy and preference heads never build
(`LogprobRequest`; target <= 0.25). Time: seconds per trained position, each job's over the SFT step's at the same
vocabulary (target: GRPO <= 2x). Quick mode: GRPO alone at both vocabularies, one timed step (its memory target)."""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
VOCAB, BASE_VOCAB = 151_936, 1_024
TOKENS, LENGTH, PROMPT = 4096, 128, 32
SEQUENCES = TOKENS // LENGTH  # 32 per step: SFT rows, GRPO responses (4 groups x 8), DPO sides (16 pairs)
GENERATIONS = 8
LOGITS_MIB = TOKENS * VOCAB * 4 / 2**20
TARGET_GROWTH, TARGET_RL_TIME = 0.25, 2.0
JOBS = ("sft", "grpo", "dpo")
JOBS_LABELS = {"sft": "SFT", "grpo": "GRPO (given rollouts, kl_coef 0.05, on policy)",
               "dpo": "DPO (sigmoid, live reference)"}  # fmt: skip


def model_dir(work_dir: Path, vocab: int) -> Path:
    """A Qwen2 (hidden 64, 2 layers) of `vocab` ids with the arithmetic demo's tokenizer (kept where it exists)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    from examples.rl_math import MODEL, write_demo

    data = write_demo(work_dir / "data", sft_rows=16, rl_rows=64, eval_rows=16)
    directory = work_dir / f"qwen2_vocab{vocab}"
    if not (directory / "config.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(str(data / MODEL))
        config = Qwen2Config(
            vocab_size=vocab, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
        )  # fmt: skip
        config.eos_token_id, config.pad_token_id = tokenizer.eos_token_id, 0
        AutoModelForCausalLM.from_config(config).save_pretrained(str(directory))
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            (directory / name).write_bytes((data / MODEL / name).read_bytes())
    return directory


def write_data(work_dir: Path) -> Path:
    """The jobs' rows under `work_dir/data` (kept where they exist): texts long enough to be cut at 128 tokens, and
    the rollouts' ids."""
    from transformers import AutoTokenizer

    from examples.rl_math import MODEL

    data = work_dir / "data"
    if (data / "rollouts.jsonl").is_file():
        return data
    rng = random.Random(0)
    problems = [json.loads(line) for line in (data / "train.jsonl").read_text().splitlines()]

    def text(words: int) -> str:
        return " ".join(rng.choice(problems)["messages"][-1]["content"] for _ in range(words))

    sft = [{"messages": [{"role": "user", "content": text(4)}, {"role": "assistant", "content": text(40)}]}
           for _ in range(4 * SEQUENCES)]  # fmt: skip
    pairs = [{"prompt": text(4), "chosen": text(40), "rejected": text(40)} for _ in range(4 * SEQUENCES)]
    vocab = len(AutoTokenizer.from_pretrained(str(data / MODEL)))
    rollouts = []
    for group in range(4 * SEQUENCES // GENERATIONS):
        prompt = [rng.randrange(3, vocab) for _ in range(PROMPT)]
        for _ in range(GENERATIONS):
            response = [rng.randrange(3, vocab) for _ in range(LENGTH - PROMPT)]
            rollouts.append({"group": group, "prompt_ids": prompt, "response_ids": response, "truncated": True,
                             "reward": float(rng.random() < 0.5)})  # fmt: skip
    for name, rows in (("sft.jsonl", sft), ("pairs.jsonl", pairs), ("rollouts.jsonl", rollouts)):
        (data / name).write_text("".join(json.dumps(row) + "\n" for row in rows))
    return data


def _trainer(job: str, work_dir: Path, vocab: int) -> Any:
    from veomni_lite.config import load_config

    data = work_dir / "data"
    args = [
        "--model.arch", "auto", "--model.pretrained_dir", str(model_dir(work_dir, vocab)),
        "--data.max_seq_len", str(LENGTH), "--data.packing", "true", "--data.max_tokens_per_micro_batch", str(TOKENS),
        "--data.shared_prefix", "false",  # every job runs its 4,096 tokens: the head's cost, not the prompts' sharing
        "--train.max_steps", "1000", "--train.eval_interval", "0", "--train.output_dir",
        str(work_dir / f"run_{job}_{vocab}"), "--checkpoint.save_interval", "0", "--logging.log_interval", "1000",
        "--logging.progress_bar", "false", "--logging.tensorboard", "false", "--logging.plot", "false",
        "--optim.warmup_steps", "0",
    ]  # fmt: skip
    if job == "sft":
        from veomni_lite.trainer.sft import SFTTrainer

        args += ["--data.format", "messages", "--data.train_path", str(data / "sft.jsonl"),
                 "--train.global_batch_size", str(SEQUENCES)]  # fmt: skip
        return SFTTrainer(load_config(None, args, world_size=1))
    if job == "dpo":
        from veomni_lite.preference.config import PrefConfig
        from veomni_lite.preference.trainer import PreferenceTrainer

        args += ["--data.format", "preference", "--data.train_path", str(data / "pairs.jsonl"),
                 "--train.global_batch_size", str(SEQUENCES // 2)]  # fmt: skip
        return PreferenceTrainer(load_config(None, args, world_size=1, sections={"pref": PrefConfig}))
    from veomni_lite.rl.config import RLConfig
    from veomni_lite.rl.trainer import RLTrainer

    args += ["--rl.rollouts_path", str(data / "rollouts.jsonl"), "--rl.num_generations", str(GENERATIONS),
             "--rl.prompts_per_step", str(SEQUENCES // GENERATIONS), "--rl.kl_coef", "0.05",
             "--rl.max_new_tokens", str(LENGTH - PROMPT), "--train.global_batch_size", str(SEQUENCES)]  # fmt: skip
    return RLTrainer(load_config(None, args, world_size=1, sections={"rl": RLConfig}))


def _worker(job: str, work_dir: Path, vocab: int, steps: int, out: Path) -> None:
    """One job at one vocabulary in this process: a warm-up step, then `steps` timed steps and their peak RSS."""
    import time

    from harness import peak_rss_mib, reset_peak_rss

    trainer = _trainer(job, work_dir, vocab)
    trainer.train_step(trainer.loader.next_step())
    reset_peak_rss()
    seconds, positions = [], []
    for _ in range(steps):
        start = time.perf_counter()
        micro_batches = trainer.loader.next_step()  # the RL loader assembles the batch and its reference pass here
        trainer.train_step(micro_batches)
        seconds.append(time.perf_counter() - start)
        positions.append(sum(mb["input_ids"].numel() for mb in micro_batches if not mb.get("padding_flag")))
    out.write_text(json.dumps({"seconds": seconds, "positions": positions, "peak_rss_mib": peak_rss_mib()}))
    trainer.metrics.finish(trainer.step, 0)
    trainer.close()


def measure(work_dir: Path, quick: bool) -> dict[str, dict[int, Any]]:
    """{job: {vocab: {"seconds", "positions", "peak_rss_mib"}}}, each run in its own process."""
    from harness import torchrun

    jobs = ("grpo",) if quick else JOBS
    found: dict[str, dict[int, Any]] = {job: {} for job in jobs}
    for vocab in (BASE_VOCAB, VOCAB):
        for job in jobs:
            out = work_dir / f"{job}_{vocab}.json"
            args = ["--worker", job, "--vocab", str(vocab), "--work-dir", str(work_dir), "--steps",
                    str(1 if quick else 3), "--out", str(out)]  # fmt: skip
            torchrun(Path(__file__), 1, args, 1800, {"MALLOC_MMAP_THRESHOLD_": "65536"})
            found[job][vocab] = json.loads(out.read_text())
    return found


def block(work_dir: Path, quick: bool) -> dict[str, Any]:
    """The memory and time table at both vocabularies and the targets."""
    import shutil

    from harness import prose

    work_dir.mkdir(parents=True, exist_ok=True)
    for run in work_dir.glob("run_*"):
        shutil.rmtree(run)
    for vocab in (BASE_VOCAB, VOCAB):
        model_dir(work_dir, vocab)
    write_data(work_dir)
    found = measure(work_dir, quick)

    def per_token(job: str, vocab: int) -> list[float]:
        run = found[job][vocab]
        return [s / p for s, p in zip(run["seconds"], run["positions"])]

    jobs = list(found)
    growth = {job: (found[job][VOCAB]["peak_rss_mib"] - found[job][BASE_VOCAB]["peak_rss_mib"]) / LOGITS_MIB
              for job in jobs}  # fmt: skip
    sft = statistics.median(per_token("sft", VOCAB)) if "sft" in found else None
    labels = JOBS_LABELS
    rows = [
        [labels[job], found[job][BASE_VOCAB]["peak_rss_mib"], found[job][VOCAB]["peak_rss_mib"],
         found[job][VOCAB]["peak_rss_mib"] - found[job][BASE_VOCAB]["peak_rss_mib"], growth[job],
         statistics.median(per_token(job, VOCAB)) * 1e6,
         statistics.median(per_token(job, VOCAB)) / sft if sft else None]
        for job in jobs
    ]  # fmt: skip
    columns = ["job", "peak RSS MiB at vocab 1,024", "at 151,936", "growth MiB",
               "growth / one float32 [4096, 151936] tensor", "us per position at 151,936 (median)",
               "/ SFT's per position"]  # fmt: skip
    quick_note = "quick mode: the full mode runs SFT and DPO too"
    targets = [
        {"name": f"{labels[job]}: peak growth / one float32 logits tensor", "op": "<=", "bound": TARGET_GROWTH,
         "unit": "x", "values": [growth[job]] if job in growth else [], "note": "" if job in growth else quick_note}
        for job in ("grpo", "dpo")
    ]  # fmt: skip
    targets.append({"name": "GRPO time per position / SFT's at vocab 151,936", "op": "<=", "bound": TARGET_RL_TIME,
                    "unit": "x", "values": [s / sft for s in per_token("grpo", VOCAB)] if sft else [],
                    "note": "" if sft else quick_note})  # fmt: skip
    steps = len(found["grpo"][VOCAB]["seconds"])
    return {
        "title": "Post-training at a real vocabulary (151,936)",
        "about": prose(__doc__) + f" {steps} timed step(s) per job after a warm-up step.",
        "tables": [{"title": "Memory and time per position, one process", "columns": columns, "rows": rows}],
        "targets": targets,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", choices=JOBS)
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--work-dir", type=Path, default=REPO / "benchmarks" / "results" / "raw" / "real_size")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]
    if args.worker:
        _worker(args.worker, args.work_dir, args.vocab, args.steps, args.out)
    else:
        print(json.dumps(block(args.work_dir, quick=args.quick), indent=1))
