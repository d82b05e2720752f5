"""Accuracy per generated token of RL runs on one task (e.g. `make train-distill` beside `make train-rl-math`):

    python scripts/distill_compare.py OUT.png REWARD LABEL=RUN_DIR [LABEL=RUN_DIR ...]

Each run's metrics.jsonl and config.yaml give, against the response tokens generated so far (each logged window's
`rl/response_length/mean` times its responses: its optimizer steps / the steps of a rollout batch x the batch's
responses), the reward `REWARD` sampled at the run's temperature (`rl/rewards/REWARD`, unweighted: a distillation
run's reward of weight 0 trains nothing but is logged) and greedy (`eval/rewards/REWARD`). Prints the table it draws.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml


def curves(run: Path, reward: str) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """(tokens, sampled reward) per logged window and (tokens, greedy reward) per evaluation of `run`."""
    config = yaml.safe_load((run / "config.yaml").read_text())
    rl, train = config["rl"], config["train"]
    responses = rl["prompts_per_step"] * rl["num_generations"]
    steps_per_batch = responses // train["global_batch_size"] * rl.get("epochs", 1)
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    sampled, greedy, tokens, last = [], [], 0.0, 0
    for event in events:
        if "rl/response_length/mean" in event:
            tokens += event["rl/response_length/mean"] * (event["step"] - last) / steps_per_batch * responses
            last = event["step"]
            sampled.append((tokens, event[f"rl/rewards/{reward}"]))
        if f"eval/rewards/{reward}" in event:
            greedy.append((tokens, event[f"eval/rewards/{reward}"]))
    return sampled, greedy


def main(argv: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out, reward, runs = Path(argv[0]), argv[1], [arg.split("=", 1) for arg in argv[2:]]
    figure, axes = plt.subplots(2, 1, figsize=(6.4, 6.0), sharex=True)
    for (label, run), color in zip(runs, ("tab:blue", "tab:orange", "tab:green", "tab:red")):
        sampled, greedy = curves(Path(run), reward)
        print(f"{label}: greedy " + ", ".join(f"{v:.3f} at {t / 1000:.0f}k" for t, v in greedy))
        print(f"{label}: sampled " + ", ".join(f"{v:.3f}" for _, v in sampled))
        for ax, points in zip(axes, (sampled, greedy)):
            ax.plot([t for t, _ in points], [v for _, v in points], marker="o", markersize=3, color=color, label=label)
    axes[0].set_ylabel(f"rl/rewards/{reward} (sampled)")
    axes[1].set_ylabel(f"eval/rewards/{reward} (greedy)")
    axes[0].legend()
    axes[1].set_xlabel("response tokens generated")
    figure.tight_layout()
    figure.savefig(out, dpi=100)


if __name__ == "__main__":
    main(sys.argv[1:])
