"""The MoE demo (`make train-moe`): a tiny Qwen3-MoE fine-tuned on two distinct domains, trained with `micro-batch` and
`global-batch` load balancing from the same start, then each domain's expert distribution per layer.

`python -m examples.moe_demo write OUT_DIR` writes (idempotent; nothing is downloaded):
- `OUT_DIR/train.jsonl`: `messages` rows of two domains, shuffled together: Python's help pages (`pydoc_data`, one
  paragraph a row, as `examples.sft_demo` writes them) and arithmetic word problems (`examples.rl_math`); each row's
  `domain` column (`help` or `math`) is ignored by training and read by the analysis;
- `OUT_DIR/eval_help.jsonl`, `OUT_DIR/eval_math.jsonl`: held-out rows of each domain;
- `OUT_DIR/models/qwen3_moe`: a randomly initialized Qwen3-MoE (`MODEL_SHAPE`: 4 layers, 8 experts, top-2) with a
  byte-level BPE tokenizer trained on both domains and a ChatML template.

`python -m examples.moe_demo analyze OUT_DIR FIGURE_DIR RUN_DIR...` loads each run's export (`RUN_DIR_hf`, written by
`python -m veomni_lite.export`), routes every held-out row of each domain and writes `RUN_DIR/expert_domains.json`
(per layer and domain: the share of routed token-slots each expert received) and, to FIGURE_DIR,
`moe_domains.png` (the distributions side by side) and `moe_curves.png` (each run's loss and `moe/load_imbalance`
from its `metrics.jsonl`), and the two numbers below of every run to the last run's `moe_summary.json`:
`specialization`, the total-variation distance between the two domains' expert distributions averaged over layers (0:
both domains use the experts alike; 1: disjoint experts), and `imbalance`, the busiest expert's load over the mean on
the held-out rows of both domains (worst layer).
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

import torch

from examples.rl_math import problems, write_chat_tokenizer
from examples.sft_demo import write_jsonl

DOMAINS = ("help", "math")
MODEL = "models/qwen3_moe"
MODEL_SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "router_aux_loss_coef": 0.01,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}


def help_rows(limit: int) -> list[dict[str, Any]]:
    """The first `limit` paragraphs of the help pages (topics in sorted order) as question/answer `messages` rows."""
    from pydoc_data.topics import topics

    rows = []
    for name in sorted(topics):
        paragraphs = [p.strip() for p in topics[name].split("\n\n") if p.strip()]
        for part, answer in enumerate(paragraphs):
            question = f"Show paragraph {part + 1} of the Python help topic {name!r}."
            rows.append({"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]})
    return rows[:limit]


def math_rows(count: int) -> list[dict[str, Any]]:
    """`count` arithmetic word problems with their short solutions as `messages` rows."""
    return [
        {"messages": [{"role": "user", "content": r["question"]}, {"role": "assistant", "content": r["solution"]}]}
        for r in problems(count, seed=1)
    ]


def write_demo(out: str | Path, per_domain: int = 1200, held_out: int = 64) -> Path:
    """Everything `write` writes (see the module docstring) under `out`; skipped where it exists."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    out = Path(out)
    done = out / ".complete-v1"
    if done.is_file():
        return out
    rows = {"help": help_rows(per_domain + held_out), "math": math_rows(per_domain + held_out)}
    train = []
    for domain, domain_rows in rows.items():
        random.Random(0).shuffle(domain_rows)
        for row in domain_rows:
            row["domain"] = domain
        write_jsonl(out / f"eval_{domain}.jsonl", domain_rows[:held_out])
        train += domain_rows[held_out:]
    random.Random(0).shuffle(train)
    write_jsonl(out / "train.jsonl", train)
    texts = ["user", "assistant"] + [m["content"] for r in train for m in r["messages"]]
    directory = out / MODEL
    tokenizer = write_chat_tokenizer(directory, texts, 1024)
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **MODEL_SHAPE,
    )
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(config).save_pretrained(str(directory), safe_serialization=True)
    done.write_text("written by python -m examples.moe_demo write\n")
    return out


@torch.no_grad()
def expert_shares(model: Any, tokenizer: Any, rows: list[dict[str, Any]]) -> torch.Tensor:
    """[layers, experts]: the share of the rows' routed token-slots (every token, top-k each) each expert received."""
    counts = torch.zeros(model.config.num_hidden_layers, model.config.num_experts, dtype=torch.float64)
    for row in rows:
        ids = tokenizer.apply_chat_template(row["messages"], tokenize=True, return_dict=False)
        ids = torch.tensor([list(ids)[:512]])
        router_logits = model(input_ids=ids, output_router_logits=True).router_logits
        for layer, logits in enumerate(router_logits):
            chosen = logits.topk(model.config.num_experts_per_tok, dim=-1).indices.flatten()
            counts[layer] += torch.bincount(chosen, minlength=model.config.num_experts).double()
    return counts / counts.sum(dim=-1, keepdim=True)


def summarize(shares: dict[str, torch.Tensor]) -> dict[str, float]:
    """`specialization` (the domains' total-variation distance, mean over layers) and `imbalance` (max over mean
    load on both domains together, worst layer); see the module docstring."""
    a, b = (shares[d] for d in DOMAINS)
    both = (a + b) / 2
    return {
        "specialization": float(0.5 * (a - b).abs().sum(dim=-1).mean()),
        "imbalance": float((both.max(dim=-1).values / both.mean(dim=-1)).max()),
    }


def _series(run: Path, key: str) -> tuple[list[int], list[float]]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    points = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
    return [p[0] for p in points], [p[1] for p in points]


def analyze(data: Path, figures: Path, runs: list[Path]) -> dict[str, float]:
    """Routes each domain's held-out rows through each run's export; writes the JSON and figures (module docstring)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from transformers import AutoModelForCausalLM, AutoTokenizer

    eval_rows = {d: [json.loads(x) for x in (data / f"eval_{d}.jsonl").read_text().splitlines()] for d in DOMAINS}
    results: dict[str, dict[str, Any]] = {}
    for run in runs:
        export = run.with_name(run.name + "_hf")
        model = AutoModelForCausalLM.from_pretrained(str(export), dtype=torch.float32).eval()
        tokenizer = AutoTokenizer.from_pretrained(str(export))
        shares = {d: expert_shares(model, tokenizer, rows) for d, rows in eval_rows.items()}
        summary = summarize(shares)
        per_layer = {d: shares[d].tolist() for d in DOMAINS}
        (run / "expert_domains.json").write_text(json.dumps({**summary, "shares": per_layer}, indent=1) + "\n")
        results[run.name] = {**summary, "shares": shares}

    layers = next(iter(results.values()))["shares"]["help"].shape[0]
    fig, axes = plt.subplots(len(results), layers, figsize=(3 * layers, 2.4 * len(results)), squeeze=False)
    for row, (name, result) in enumerate(results.items()):
        for layer in range(layers):
            ax = axes[row][layer]
            experts = torch.arange(result["shares"]["help"].shape[1])
            for offset, domain in zip((-0.2, 0.2), DOMAINS):
                ax.bar(experts + offset, result["shares"][domain][layer], width=0.4, label=domain)
            ax.set_title(f"{name} layer {layer}", fontsize=8)
            ax.set_ylim(0, 1)
        axes[row][0].set_ylabel(f"TV {result['specialization']:.2f}")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(figures / "moe_domains.png", dpi=90)

    fig, (loss_ax, balance_ax) = plt.subplots(1, 2, figsize=(10, 3.2))
    for run in runs:
        loss_ax.plot(*_series(run, "train/foundation_loss"), label=run.name)
        balance_ax.plot(*_series(run, "moe/load_imbalance"), label=run.name)
    loss_ax.set_title("train/foundation_loss")
    balance_ax.set_title("moe/load_imbalance (busiest / mean, worst layer)")
    for ax in (loss_ax, balance_ax):
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(figures / "moe_curves.png", dpi=90)
    summary = {f"{name} {k}": v for name, r in results.items() for k, v in r.items() if k != "shares"}
    (runs[-1] / "moe_summary.json").write_text(json.dumps(summary, indent=1) + "\n")  # what docs/moe.md quotes
    return summary


if __name__ == "__main__":
    command, target = sys.argv[1], Path(sys.argv[2])
    if command == "write":
        print(f"[veomni_lite] MoE demo data and model directory in {write_demo(target).resolve()}")
    else:
        summary = analyze(target, Path(sys.argv[3]), [Path(p) for p in sys.argv[4:]])
        print("[veomni_lite] " + ", ".join(f"{k} {v:.3f}" for k, v in summary.items()))
