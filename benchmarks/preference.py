"""A DPO step against an SFT step on the same tokens, one process: `python benchmarks/preference.py [WORK_DIR]`.

The demo's arithmetic pairs (`make train-dpo`'s files under outputs/) and its warm-start model: DPO with the live
reference (a no-grad reference forward per micro-batch), DPO with `pref.precompute_reference`, and SFT on the same
sides as `messages` rows (prompt + chosen, prompt + rejected: the same positions per step, twice the rows). Per
variant the median over the timed steps (after `WARMUP`) of positions per second of step time, from metrics.jsonl.
Not part of `make bench` yet.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
STEPS, WARMUP = 30, 5


def run(args: list[str], sections: dict, trainer_cls: type) -> float:
    from veomni_lite.config import load_config

    trainer = trainer_cls(load_config(None, args, world_size=1, sections=sections))
    try:
        trainer.train()
    finally:
        trainer.metrics.close()
    rows = [json.loads(line) for line in (Path(trainer.output_dir) / "metrics.jsonl").read_text().splitlines()]
    rates = [
        r["train/positions"] / r["train/step_time_s"] for r in rows if "train/step_time_s" in r and r["step"] > WARMUP
    ]
    return statistics.median(rates)


def main(work: Path) -> dict[str, float]:
    from veomni_lite.rl.preference import PrefConfig
    from veomni_lite.rl.preference_trainer import PreferenceTrainer
    from veomni_lite.trainer.sft import SFTTrainer

    pairs = [json.loads(line) for line in (REPO / "outputs/rl_math/dpo_train.jsonl").read_text().splitlines()]
    sides = work / "sides.jsonl"
    work.mkdir(parents=True, exist_ok=True)
    sides.write_text("".join(
        json.dumps({"messages": [{"role": "user", "content": p["prompt"]}, {"role": "assistant", "content": p[k]}]})
        + "\n" for p in pairs for k in ("chosen", "rejected")
    ))  # fmt: skip
    common = ["--model.arch", "auto", "--model.pretrained_dir", str(REPO / "outputs/rl_math_sft_hf"),
              "--data.max_seq_len", "64", "--train.max_steps", str(STEPS), "--train.eval_interval", "0",
              "--logging.log_interval", "1", "--logging.progress_bar", "false", "--logging.tensorboard", "false",
              "--logging.plot", "false", "--checkpoint.save_interval", "0", "--optim.warmup_steps", "0"]  # fmt: skip
    dpo = [*common, "--data.format", "preference", "--data.train_path", str(REPO / "outputs/rl_math/dpo_train.jsonl"),
           "--train.micro_batch_size", "16", "--train.global_batch_size", "32"]  # fmt: skip
    sft = [*common, "--data.format", "messages", "--data.train_path", str(sides), "--train.micro_batch_size", "32",
           "--train.global_batch_size", "64", "--train.epochs", "0"]  # fmt: skip
    out = {
        "sft": run([*sft, "--train.output_dir", str(work / "sft")], {}, SFTTrainer),
        "dpo_live_reference": run(
            [*dpo, "--train.output_dir", str(work / "live")], {"pref": PrefConfig}, PreferenceTrainer
        ),  # fmt: skip
        "dpo_precomputed": run(
            [*dpo, "--pref.precompute_reference", "true", "--train.output_dir", str(work / "pre")],
            {"pref": PrefConfig},
            PreferenceTrainer,
        ),  # fmt: skip
    }
    return out


if __name__ == "__main__":
    from veomni_lite.log import setup_logging

    setup_logging(0)
    result = main(Path(sys.argv[1]) if len(sys.argv) > 1 else REPO / "outputs/bench_preference")
    print(json.dumps({k: round(v) for k, v in result.items()}))
    print(json.dumps({k: round(v / result["sft"], 3) for k, v in result.items()}))
