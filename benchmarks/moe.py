"""make bench: what the router losses cost, an MoE SFT step against a dense one of equal active size, 2 gloo ranks.

The MoE demo's data (`examples.moe_demo`: help pages and arithmetic, max_seq_len 256, 4 samples per micro-batch, 16
per step: GA 2) through the real SFT trainer, on three models written here with the demo's tokenizer: a Qwen3-MoE
(hidden 128, 4 layers, 16 experts of width 128, top-2; quick: 2 layers) with `moe.balance` micro-batch and
global-batch, and a dense Qwen3 of the same shape whose MLP width is top-k x the expert width (256), so a token runs
the same number of parameters. Per variant: the collectives of one step (counted on an untimed step with the
harness's `OpCounter`), the parameters and active parameters, and the median step time (the max over ranks of each
step after a warm-up step). The router losses' cost is the MoE step with them against the dense step; their
collectives: none beyond the dense step's (global-batch adds E + 1 int64 slots to the step's one loss all-reduce).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SHAPE = {"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32}
MOE = {"num_experts": 16, "num_experts_per_tok": 2, "moe_intermediate_size": 128, "router_aux_loss_coef": 0.01}
VARIANTS = ("dense", "micro-batch", "global-batch")


def write_models(work_dir: Path, layers: int) -> dict[str, Path]:
    """The demo's data and the two model directories (skipped where they exist): {"dense": DIR, "moe": DIR}."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from examples.moe_demo import MODEL, write_demo

    tokenizer_dir = write_demo(work_dir / "data") / MODEL
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    ids = {"vocab_size": len(tokenizer), "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    common = {**SHAPE, **ids, "num_hidden_layers": layers, "tie_word_embeddings": False}
    dirs = {"dense": work_dir / f"qwen3_dense_{layers}", "moe": work_dir / f"qwen3_moe_{layers}"}
    configs = {
        "dense": Qwen3Config(intermediate_size=MOE["num_experts_per_tok"] * MOE["moe_intermediate_size"], **common),
        "moe": Qwen3MoeConfig(intermediate_size=256, norm_topk_prob=True, **MOE, **common),
    }
    for name, directory in dirs.items():
        if not (directory / "config.json").is_file():
            torch.manual_seed(0)
            build = Qwen3MoeForCausalLM if name == "moe" else AutoModelForCausalLM.from_config
            model = build(configs[name])
            model.save_pretrained(str(directory))
            tokenizer.save_pretrained(str(directory))
    return dirs


def _worker(work_dir: Path, model_dir: Path, variant: str, steps: int, out: Path) -> None:
    import torch.distributed as dist
    from harness import OpCounter

    from veomni_lite.config import load_config
    from veomni_lite.models.heads import active_parameters
    from veomni_lite.trainer.sft import SFTTrainer

    args = [
        "--model.pretrained_dir", str(model_dir), "--data.train_path", str(work_dir / "data/train.jsonl"),
        "--train.output_dir", str(work_dir / f"run_{variant}"), "--train.micro_batch_size", "4",
        "--train.global_batch_size", "16", "--train.max_steps", "1000", "--checkpoint.save_interval", "0",
        "--logging.log_interval", "1000", "--logging.progress_bar", "false", "--logging.tensorboard", "false",
        "--logging.plot", "false",
    ]  # fmt: skip
    if variant != "dense":
        args += ["--moe.balance", variant]
    config = load_config(REPO / "configs" / "moe_domains.yaml", args, world_size=int(os.environ["WORLD_SIZE"]))
    trainer = SFTTrainer(config)

    def step() -> None:
        trainer.train_step([trainer.shard(micro_batch) for micro_batch in trainer.loader.next_step()])

    step()  # warm-up (and global-batch's first step, whose f is uniform)
    counter = OpCounter()
    with counter.active():
        step()
    seconds = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - start)
    rows: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(rows, seconds)
    if dist.get_rank() == 0:
        model = trainer.model
        result = {
            "seconds": [max(values) for values in zip(*rows)],
            "collectives": dict(counter.collectives),
            "parameters": sum(p.numel() for p in model.parameters()) * dist.get_world_size(),  # FSDP2 shards
            "active": active_parameters(model) * dist.get_world_size(),
        }
        out.write_text(json.dumps(result))
    trainer.metrics.finish(trainer.step, 0)
    trainer.close()


def block(work_dir: Path, quick: bool) -> dict[str, Any]:
    """Per variant: collectives per step, parameters, active parameters, median step time; the cost target."""
    from harness import prose, torchrun

    layers, steps = (2, 2) if quick else (4, 6)
    work_dir.mkdir(parents=True, exist_ok=True)
    dirs = write_models(work_dir, layers)
    results = {}
    for variant in VARIANTS:
        out = work_dir / f"{variant}.json"
        model_dir = dirs["dense" if variant == "dense" else "moe"]
        args = ["--worker", variant, "--work-dir", str(work_dir), "--model-dir", str(model_dir), "--steps", str(steps)]
        torchrun(Path(__file__), 2, [*args, "--out", str(out)], 900)
        results[variant] = json.loads(out.read_text())
    dense_ms = statistics.median(results["dense"]["seconds"]) * 1e3
    rows = []
    for variant, r in results.items():
        collectives = ", ".join(f"{n} {name}" for name, n in sorted(r["collectives"].items()))
        median = statistics.median(r["seconds"]) * 1e3
        rows.append([variant, r["parameters"], r["active"], collectives, median, median / dense_ms])
    columns = ["variant", "parameters", "active parameters", "collectives per step", "step ms (median)"]
    columns += ["step time / dense"]
    same = all(r["collectives"] == results["dense"]["collectives"] for r in results.values())
    about = prose(__doc__) + f" {steps} timed steps after a warm-up step; same collectives in every variant: {same}."
    return {
        "title": "MoE router losses against a dense step of equal active size",
        "about": about,
        "tables": [{"columns": columns, "rows": rows}],
        "targets": [
            {
                "name": "MoE collectives per step beyond the dense step's",
                "op": "<=",
                "bound": 0,
                "unit": "",
                "values": [
                    sum(r["collectives"].values()) - sum(results["dense"]["collectives"].values())
                    for r in results.values()
                ],
            }
        ],
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", choices=VARIANTS)
    parser.add_argument("--work-dir", type=Path, default=REPO / "benchmarks" / "results" / "raw" / "moe")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--model-dir", type=Path)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]
    if args.worker:
        _worker(args.work_dir, args.model_dir, args.worker, args.steps, args.out)
    else:
        print(json.dumps(block(args.work_dir, quick=args.quick), indent=1))
