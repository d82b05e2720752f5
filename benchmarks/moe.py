"""make bench: what the router losses cost, an MoE SFT step against a dense one of equal active size, 2 gloo ranks;
our MoE step against transformers' own model, one process; each rank's bytes and the step's collectives by
expert-parallel size.

The MoE demo's data (`examples.moe_demo`: help pages and arithmetic, max_seq_len 256, 4 samples per micro-batch, 16
per step: GA 2) through the real SFT trainer, on three models written here with the demo's tokenizer: a Qwen3-MoE
(hidden 128, 4 layers, 16 experts of width 128, top-2; quick: 2 layers) with `moe.balance` micro-batch and
global-batch, and a dense Qwen3 of the same shape whose MLP width is top-k x the expert width (256), so a token runs
the same number of parameters. Per variant: the collectives of one step (counted on an untimed step with the
harness's `OpCounter`), the parameters and active parameters, and the median step time (the max over ranks of each
step after a warm-up step). The router losses' cost is the MoE step with them against the dense step; their
collectives: none beyond the dense step's (global-batch adds E + 1 int64 slots to the step's one loss all-reduce).

Ours against transformers (`moe_step.py`): one process, our `SFTTrainer` step against transformers' own forward
(`grouped_mm` experts, its `load_balancing_loss_func`), backward, clip and AdamW on the same packed micro-batches
(see that module), a Qwen3-MoE whose experts hold most parameters (64 experts of width 256, top-8, hidden 256, 2
layers, 2,048 tokens a step; quick: 16 experts of 128, top-4, hidden 128, 512 tokens). Launched as `python` (one
process, no FSDP2) and, in the full mode, as `torchrun` with one rank (FSDP2 over it, as `make train` starts it).
Both sides' CPU seconds too: on a shared machine the wall time carries the other jobs.

Memory and collectives by EP (`ep_run`): the micro-batch variant's trainer on 2 (and 4) gloo ranks, one untimed step
under torch's profiler: each rank's bytes of parameters, gradients and AdamW state (local shards; the routed experts
apart), the bytes of one MoE layer's experts as its forward sees them (what FSDP2 gathers: every expert at EP=1, the
target at `parallel.ep_size` e is 1/e of them), and the share of the step during which an all-gather, an all-to-all,
a reduce-scatter, an all-reduce was in flight (the backend's profiler events; gloo runs FSDP2's reduce-scatter as an
all-reduce, NCCL as its own). Quick: the 16-expert model's EP=1 run above. Full: a
Qwen3-MoE of 64 experts of width 128, top-8 (hidden 128, 2 layers) at DP=2 and DP=4. Layouts with `ep_size` > 1 run
where the tree has `parallel.ep_size`.
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
MOE_EP = {**MOE, "num_experts": 64, "num_experts_per_tok": 8}  # the full mode's EP layouts: experts hold most bytes
VARIANTS = ("dense", "micro-batch", "global-batch")
EP_LAYOUTS = {True: ((2, 1), (2, 2)), False: ((2, 1), (2, 2), (4, 1), (4, 2), (4, 4))}  # (world, ep_size) by quick
COLLECTIVE_KINDS = ("all_gather", "all_to_all", "reduce_scatter", "all_reduce")  # gloo reduce-scatters by all-reduce
MIB = 2**20


def write_models(work_dir: Path, layers: int, moe: dict[str, Any] = MOE) -> dict[str, Path]:
    """The demo's data and the two model directories (skipped where they exist): {"dense": DIR, "moe": DIR}, the
    MoE of `moe`'s experts."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from examples.moe_demo import MODEL, write_demo

    tokenizer_dir = write_demo(work_dir / "data") / MODEL
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    ids = {"vocab_size": len(tokenizer), "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    common = {**SHAPE, **ids, "num_hidden_layers": layers, "tie_word_embeddings": False}
    experts = f"{moe['num_experts']}x{moe['num_experts_per_tok']}"
    dirs = {"dense": work_dir / f"qwen3_dense_{layers}_{experts}", "moe": work_dir / f"qwen3_moe_{layers}_{experts}"}
    configs = {
        "dense": Qwen3Config(intermediate_size=moe["num_experts_per_tok"] * moe["moe_intermediate_size"], **common),
        "moe": Qwen3MoeConfig(intermediate_size=256, norm_topk_prob=True, **moe, **common),
    }
    for name, directory in dirs.items():
        if not (directory / "config.json").is_file():
            torch.manual_seed(0)
            build = Qwen3MoeForCausalLM if name == "moe" else AutoModelForCausalLM.from_config
            model = build(configs[name])
            model.save_pretrained(str(directory))
            tokenizer.save_pretrained(str(directory))
    return dirs


def _worker(work_dir: Path, model_dir: Path, variant: str, steps: int, out: Path, ep_size: int) -> None:
    import torch.distributed as dist
    from harness import OpCounter, collective_seconds, gathered_bytes, rank_bytes

    from veomni_lite.config import load_config
    from veomni_lite.models.heads import active_parameters, active_shares
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
    if ep_size > 1:
        args += ["--parallel.ep_size", str(ep_size)]
    config = load_config(REPO / "configs" / "moe_domains.yaml", args, world_size=int(os.environ["WORLD_SIZE"]))
    trainer = SFTTrainer(config)

    def step() -> int:
        micro_batches = [trainer.shard(micro_batch) for micro_batch in trainer.loader.next_step()]
        trainer.train_step(micro_batches)
        return sum(int(mb["input_ids"].numel()) for mb in micro_batches)  # positions run, padding included

    step()  # warm-up (and global-batch's first step, whose f is uniform)
    counter = OpCounter()
    with counter.active():
        step()
    experts = set(active_shares(trainer.model))
    memory: dict[str, Any] = {}
    zero_grad = trainer.optimizer.zero_grad

    def measured_zero_grad(*args: Any, **kwargs: Any) -> None:  # the step's gradients and AdamW state, still set
        memory["bytes"] = rank_bytes(trainer.model, trainer.optimizer, experts)
        zero_grad(*args, **kwargs)

    trainer.optimizer.zero_grad = measured_zero_grad
    layers = [m for m in trainer.model.modules() if any(id(p) in experts for p in m.parameters(recurse=False))]
    with gathered_bytes(layers) as gathered:
        wall, busy = collective_seconds(step)
    trainer.optimizer.zero_grad = zero_grad
    seconds, positions = [], []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        positions.append(step())
        seconds.append(time.perf_counter() - start)
    rows: list[Any] = [None] * dist.get_world_size()
    mine = {
        "seconds": seconds,
        "positions": positions,
        "bytes": memory["bytes"],
        "gathered": gathered,
        "profiled_s": wall,
        "busy_s": busy,
    }
    dist.all_gather_object(rows, mine)
    if dist.get_rank() == 0:
        model = trainer.model
        result = {
            "seconds": [max(values) for values in zip(*(row["seconds"] for row in rows))],
            "collectives": dict(counter.collectives),
            "parameters": sum(p.numel() for p in model.parameters()),  # a DTensor's numel is the whole tensor's
            "active": active_parameters(model),
            "experts": sum(p.numel() for p in model.parameters() if id(p) in experts),
            "positions": [sum(values) for values in zip(*(row["positions"] for row in rows))],  # every rank's
            "ranks": [{key: row[key] for key in ("bytes", "gathered", "profiled_s", "busy_s")} for row in rows],
            "ep_size": ep_size,
            "num_experts": getattr(model.config, "num_experts", 0),  # 0: the dense model
            "top_k": getattr(model.config, "num_experts_per_tok", 0),
        }
        out.write_text(json.dumps(result))
    trainer.metrics.finish(trainer.step, 0)
    trainer.close()


def ep_supported() -> bool:
    """Whether this tree's config has `parallel.ep_size` (expert parallelism)."""
    from dataclasses import fields

    from veomni_lite.config_sections import ParallelConfig

    return any(f.name == "ep_size" for f in fields(ParallelConfig))


def launch(work_dir: Path, model_dir: Path, variant: str, world: int, ep_size: int, steps: int) -> dict[str, Any]:
    """One `_worker` run under torchrun: its results (see `_worker`)."""
    from harness import torchrun

    out = work_dir / f"{variant}_{model_dir.name}_w{world}_ep{ep_size}.json"
    args = ["--worker", variant, "--work-dir", str(work_dir), "--model-dir", str(model_dir), "--steps", str(steps)]
    torchrun(Path(__file__), world, [*args, "--ep-size", str(ep_size), "--out", str(out)], 900)
    return json.loads(out.read_text())


def ep_run(work_dir: Path, model_dir: Path, world: int, ep_size: int, steps: int) -> dict[str, Any]:
    """The micro-batch variant at `world` ranks with `parallel.ep_size` `ep_size` (see the module doc)."""
    return launch(work_dir, model_dir, "micro-batch", world, ep_size, steps)


def _last_error(message: str) -> str:
    """The last `SomethingError: ...` line of a failed run's output (the cause), else its last line."""
    lines = [line.split("]:", 1)[-1].strip() for line in message.splitlines() if line.strip()]
    errors = [line for line in lines if "Error: " in line and not line.startswith("torch.distributed.elastic")]
    return (errors or lines or [""])[-1][:200]


def ep_rows(runs: dict[tuple[int, int], dict[str, Any]]) -> tuple[list[list[Any]], list[dict[str, Any]]]:
    """The memory and EP table's rows and targets from `ep_run`'s results by (world, ep_size)."""
    rows, gathered, speedup, which = [], [], [], ""
    for (world, ep), r in sorted(runs.items()):
        ranks = r["ranks"]
        experts = max(sum(rank["bytes"]["experts"].values()) for rank in ranks)
        other = max(sum(rank["bytes"]["other"].values()) for rank in ranks)
        layer = max(max(rank["gathered"]) for rank in ranks)  # one MoE layer's experts, as its forward sees them
        whole_layer = r["experts"] * 4 / len(ranks[0]["gathered"])  # float32 parameters
        gathered.append(layer / (whole_layer / ep))
        share = {
            kind: max(rank["busy_s"].get(kind, 0.0) / rank["profiled_s"] for rank in ranks) for kind in COLLECTIVE_KINDS
        }
        median = statistics.median(r["seconds"])
        base = runs.get((world, 1))
        if (world, ep) == (2, 2) and base is not None:
            speedup += [b / s for b, s in zip(base["seconds"], r["seconds"])]
            which = f" ({r['num_experts']} experts, top-{r['top_k']})"
        rate = sum(r["positions"]) / sum(r["seconds"])
        rows.append([world, ep, r["experts"] / r["parameters"], experts / MIB, other / MIB, layer / MIB, median * 1e3,
                     rate, *(share[kind] for kind in COLLECTIVE_KINDS)])  # fmt: skip
    note = "" if ep_supported() else "parallel.ep_size is not in this tree (the expert-parallel branch has not landed)"
    targets = [
        {"name": "one MoE layer's experts gathered per rank / (all of them / EP)", "op": "<=", "bound": 1.0,
         "unit": "x", "values": gathered},
        {"name": f"positions/s, DP=2: EP=2 / EP=1{which}", "op": ">=", "bound": 1.3, "unit": "x", "values": speedup,
         "note": note or "no EP layout ran"},
    ]  # fmt: skip
    return rows, targets


LAUNCHES = {True: ("python",), False: ("python", "torchrun")}  # by quick: how our one process is started


def ours_against_transformers(work_dir: Path, quick: bool) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """`moe_step.py` in one process per launch (`python`: the trainer without FSDP2; `torchrun`: one rank, FSDP2 over
    it, as `make train` starts it): its table and targets (ours / transformers' tokens/s, paired steps)."""
    from harness import run_script, torchrun

    shape, steps = ("quick", 10) if quick else ("full", 8)
    rows, targets = [], []
    for launch in LAUNCHES[quick]:
        out = work_dir / f"ours_vs_transformers_{launch}.json"
        args = ["--shape", shape, "--work-dir", str(work_dir / "step"), "--out", str(out), "--steps", str(steps)]
        script = Path(__file__).with_name("moe_step.py")
        if launch == "python":
            run_script([sys.executable], script, args, 900)
        else:
            torchrun(script, 1, args, 900)
        r = json.loads(out.read_text())
        ratios = [theirs / ours for ours, theirs in zip(r["seconds"]["ours"], r["seconds"]["theirs"])]
        cpu = [theirs / ours for ours, theirs in zip(r["cpu_seconds"]["ours"], r["cpu_seconds"]["theirs"])]
        tokens = statistics.median(r["step_tokens"])
        ours_s, theirs_s = (statistics.median(r["seconds"][side]) for side in ("ours", "theirs"))
        rows.append([launch, f"{r['num_experts']} (top-{r['num_experts_per_tok']})", r["hidden_size"],
                     r["num_hidden_layers"], tokens, ours_s * 1e3, theirs_s * 1e3, tokens / ours_s, tokens / theirs_s,
                     statistics.median(ratios), statistics.median(cpu), r["loss_rel_diff"], len(ratios)])  # fmt: skip
        targets.append({"name": f"ours / transformers tokens/s, one process ({launch})", "op": ">=", "bound": 1.0,
                        "unit": "x", "values": ratios})  # fmt: skip
    columns = ["launch", "experts (top-k)", "hidden", "layers", "tokens / step", "ours ms", "transformers ms",
               "ours tokens/s", "transformers tokens/s", "ours / transformers tokens/s (median of paired steps)",
               "the same by CPU seconds", "first-step loss difference (relative)", "timed steps"]  # fmt: skip
    table = {"title": "Ours against transformers' own MoE step, one process", "columns": columns, "rows": rows}
    return table, targets


def block(work_dir: Path, quick: bool) -> dict[str, Any]:
    """Per variant: collectives per step, parameters, active parameters, median step time; the cost target; ours
    against transformers; memory and collectives by EP."""
    from harness import prose

    layers, steps = (2, 2) if quick else (4, 6)
    work_dir.mkdir(parents=True, exist_ok=True)
    dirs = write_models(work_dir, layers)
    results = {}
    for variant in VARIANTS:
        model_dir = dirs["dense" if variant == "dense" else "moe"]
        results[variant] = launch(work_dir, model_dir, variant, 2, 1, steps)
    dense_ms = statistics.median(results["dense"]["seconds"]) * 1e3
    rows = []
    for variant, r in results.items():
        collectives = ", ".join(f"{n} {name}" for name, n in sorted(r["collectives"].items()))
        median = statistics.median(r["seconds"]) * 1e3
        rows.append([variant, r["parameters"], r["active"], collectives, median, median / dense_ms])
    columns = ["variant", "parameters", "active parameters", "collectives per step", "step ms (median)"]
    columns += ["step time / dense"]
    same = all(r["collectives"] == results["dense"]["collectives"] for r in results.values())
    against, against_targets = ours_against_transformers(work_dir, quick)
    if quick:  # the 16-expert model's EP=1 run above
        ep_model, runs = dirs["moe"], {(2, 1): results["micro-batch"]}
    else:
        ep_model, runs = write_models(work_dir, 2, MOE_EP)["moe"], {}
    failed = {}
    for world, ep in EP_LAYOUTS[quick]:
        if (world, ep) not in runs and (ep == 1 or ep_supported()):
            try:
                runs[world, ep] = ep_run(work_dir, ep_model, world, ep, steps)
            except RuntimeError as error:  # a layout that fails is a row saying why; the other layouts still run
                failed[world, ep] = _last_error(str(error))
    memory_rows, memory_targets = ep_rows(runs)
    memory_rows += [[world, ep, f"failed: {why}"] + [None] * 9 for (world, ep), why in sorted(failed.items())]
    memory_columns = ["world", "EP", "experts' share of parameters", "experts MiB per rank (param + grad + AdamW)",
                      "the rest MiB per rank", "one layer's experts gathered MiB per rank", "step ms (median)",
                      "positions/s (every rank's)"]  # fmt: skip
    memory_columns += [f"{kind} share of the step" for kind in COLLECTIVE_KINDS]
    about = prose(__doc__) + f" {steps} timed steps after a warm-up step; same collectives in every variant: {same}."
    return {
        "title": "MoE router losses against a dense step of equal active size",
        "about": about,
        "tables": [
            {"columns": columns, "rows": rows},
            against,
            {
                "title": "Memory per rank and the step's collectives by EP",
                "columns": memory_columns,
                "rows": memory_rows,
            },
        ],  # fmt: skip
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
            },
            *against_targets,
            *memory_targets,
        ],
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", choices=VARIANTS)
    parser.add_argument("--work-dir", type=Path, default=REPO / "benchmarks" / "results" / "raw" / "moe")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--model-dir", type=Path)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--ep-size", type=int, default=1)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]
    if args.worker:
        _worker(args.work_dir, args.model_dir, args.worker, args.steps, args.out, args.ep_size)
    else:
        print(json.dumps(block(args.work_dir, quick=args.quick), indent=1))
