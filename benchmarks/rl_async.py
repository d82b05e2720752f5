"""make bench: bounded-staleness RL (`rl.async_steps: k`, `rl.partial_rollouts`): tokens trained per second with the
engine and the trainer each pinned to one core.

GRPO through the real trainer on one process: the arithmetic prompts of `examples/rl_math.py` (8 prompts x 4 samples, up
to 48 new tokens, one optimizer step per rollout batch, `rl.importance_sampling: token`) on a Qwen2 of hidden size 256,
2 layers with the demo's tokenizer. The trainer's thread is pinned to core 1 and the embedded engine's worker thread
(`BackgroundEngine`, k >= 1) to core 0 (`os.sched_setaffinity`), one torch thread each; at k = 0 the engine generates on
the trainer's thread (core 1), as a synchronous run does. Per variant: the response tokens trained per second over the
timed rollout batches after two warm-up batches (the queue filled), the best of the rounds (the variants run in turn
each round, so a burst of the machine's other load falls on one round), and the speed-up over k = 0. What overlap can
give is bounded by k = 0's own split, (generate + train) / max(generate, train) (2x on two cores when the two are
equal), reported beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
MODEL = {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 2, "num_attention_heads": 8}
VARIANTS = {"k=0": (0, False), "k=1": (1, False), "k=2": (2, False), "k=4": (4, False), "k=2 partial": (2, True)}
TARGET_SPEEDUP = 1.6  # k = 2 over k = 0 (the target; two cores bound it at 2)


def _worker(work_dir: Path, model_dir: Path, batches: int, rounds: int, variants: list[str], out: Path) -> None:
    """Every variant in turn through `RLTrainer`, `rounds` times: per round the response tokens its timed rollout
    batches trained, their seconds and the seconds spent waiting for a batch to be made."""
    import torch

    from veomni_lite.config import load_config
    from veomni_lite.engines.background import BackgroundEngine
    from veomni_lite.rl.config import RLConfig
    from veomni_lite.rl.trainer import RLTrainer

    torch.set_num_threads(1)
    os.sched_setaffinity(0, {1})  # this (the trainer's) thread; the engine's worker pins itself to core 0
    results: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
    for name in [name for _ in range(rounds) for name in variants]:
        k, partial = VARIANTS[name]
        args = [
            "--model.arch", "auto", "--model.pretrained_dir", str(model_dir), "--data.format", "messages",
            "--data.train_path", str(work_dir / "data" / "rl_train.jsonl"), "--data.max_seq_len", "160",
            "--rl.prompts_per_step", "8", "--rl.num_generations", "4", "--rl.max_new_tokens", "48",
            "--rl.rewards", "[{name: correct, function: math}]", "--rl.importance_sampling", "token",
            "--rl.async_steps", str(k), "--rl.partial_rollouts", str(partial).lower(),
            "--train.micro_batch_size", "32", "--train.global_batch_size", "32", "--train.max_steps", "1000",
            "--train.output_dir", str(work_dir / "run"), "--checkpoint.save_interval", "0",
            "--logging.log_interval", "1000", "--logging.progress_bar", "false", "--logging.tensorboard", "false",
            "--logging.plot", "false",
        ]  # fmt: skip
        trainer = RLTrainer(load_config(None, args, world_size=1, sections={"rl": RLConfig}))
        if isinstance(trainer.engine, BackgroundEngine):
            trainer.engine.call(lambda: os.sched_setaffinity(0, {0})).result()
        trainer.loader.max_steps = batches + 2
        tokens, start, waited = 0, 0.0, 0.0
        for step in range(batches + 2):
            if step == 2:  # two warm-up batches: the queue is full from here
                tokens, start, waited = 0, time.perf_counter(), 0.0
            micro_batches = trainer.loader.next_step()
            waited += trainer.loader.made.generate_s  # one rollout batch per step: each step makes one
            tokens += sum(int((mb["policy_labels"] != -100).sum()) for mb in micro_batches)
            trainer.train_step(micro_batches)
        seconds = time.perf_counter() - start
        results[name].append({"tokens": tokens, "seconds": seconds, "generate_s": waited})
        print(f"[rl_async] {name}: {tokens} tokens in {seconds:.2f} s, {waited:.2f} s making batches", flush=True)
        trainer.metrics.finish(trainer.step, 0)
        trainer.close()
    out.write_text(json.dumps(results))


def block(work_dir: Path, quick: bool) -> dict[str, Any]:
    """Per variant: response tokens trained per second and the speed-up over k = 0."""
    import subprocess

    from harness import math_model, prose

    batches, rounds = (4, 2) if quick else (8, 3)
    variants = ["k=0", "k=2"] if quick else list(VARIANTS)
    work_dir.mkdir(parents=True, exist_ok=True)
    model_dir = math_model(work_dir, MODEL)
    out = work_dir / "rl_async.json"
    if len(os.sched_getaffinity(0)) < 2:
        return {"title": "Bounded-staleness RL: tokens trained per second", "not_run": "it needs two cores"}
    command = [sys.executable, str(Path(__file__)), "--worker", "--work-dir", str(work_dir), "--model-dir",
               str(model_dir), "--batches", str(batches), "--rounds", str(rounds), "--variants",
               ",".join(variants), "--out", str(out)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    subprocess.run(command, env=env, check=True, capture_output=True, text=True, timeout=1800)
    results = {name: max(runs, key=lambda r: r["tokens"] / r["seconds"]) for name, runs in json.loads(
        out.read_text()).items()}  # fmt: skip
    rate = {name: r["tokens"] / r["seconds"] for name, r in results.items()}
    rows = [[name, r["tokens"], r["seconds"], r["generate_s"], rate[name], rate[name] / rate["k=0"]]
            for name, r in results.items()]  # fmt: skip
    columns = ["variant", "response tokens trained", "seconds", "waiting for rollouts s", "tokens trained / s",
               "x k=0"]  # fmt: skip
    sync = results["k=0"]
    generate, train = sync["generate_s"], sync["seconds"] - sync["generate_s"]
    split = (f" k = 0's best round: {generate:.2f} s making rollout batches, {train:.2f} s training, so overlap can "
             f"give at most {(generate + train) / max(generate, train):.2f}x.")  # fmt: skip
    return {
        "title": "Bounded-staleness RL: tokens trained per second",
        "about": prose(__doc__) + f" {batches} timed rollout batches per variant, {rounds} round(s)." + split,
        "tables": [{"columns": columns, "rows": rows}],
        "targets": [
            {"name": "k=2 tokens trained / s over k=0 (engine, trainer: one core each)", "op": ">=",
             "bound": TARGET_SPEEDUP, "unit": "x", "values": [rate["k=2"] / rate["k=0"]]},
        ],
    }  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--work-dir", type=Path, default=REPO / "benchmarks" / "results" / "raw" / "rl_async")
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model-dir", type=Path)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]
    if args.worker:
        _worker(args.work_dir, args.model_dir, args.batches, args.rounds, args.variants.split(","), args.out)
    else:
        print(json.dumps(block(args.work_dir, quick=args.quick), indent=1))
