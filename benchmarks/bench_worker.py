"""torchrun worker: the whole training step with each peer's loss normalization, side by side (gloo, CPU).

Launched by `benchmarks/run_all.py` (`torchrun --standalone --nproc_per_node N benchmarks/bench_worker.py ...`). For
every SP size and GA value: the tiny VLM of configs/vlm_tiny.yaml, per micro-batch count_loss_token, forward, the
strategy's loss scaling, backward; then one flat gradient all-reduce and AdamW (the same for every strategy). An
untimed round per strategy counts the step's collectives and host reads and checks its gradients and world-mean
loss against veomni_lite's; then the strategies are timed interleaved. At SP 1 the real `BaseTrainer` step is also
timed against a bare FSDP2 loop (`trainer_costs.py`). Rank 0 writes the JSON given by `--out`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

# run as a script, this file's folder comes first on sys.path: put the repository root (examples/) there too.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from baselines import LOSS_STRATEGIES, LossStrategy
from harness import MicroBatch, OpCounter, make_steps, timed_reps, vlm_dataset

from examples.attention import causal_attention
from examples.tiny_lm import TinyLMConfig, set_attention_fn
from examples.tiny_vlm import TinyVLM, TinyVLMConfig
from veomni_lite.distributed.collectives import destroy_process_groups
from veomni_lite.distributed.parallel_state import destroy_parallel_state, init_parallel_state
from veomni_lite.distributed.sequence_parallel import ulysses_attention
from veomni_lite.utils.loss_utils import count_loss_token, reset_loss_memo

LOSS_KEYS = ("foundation_loss", "image_decoder_loss")
MICRO_BATCH_SIZE, DATA_STEPS = 2, 2  # distinct global batches per configuration, cycled
MODEL_DIMS = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "intermediate_size": 176}  # configs/vlm_tiny.yaml
GRAD_TOL, LOSS_TOL = 1e-4, 1e-5  # a peer's gradients and world-mean loss against veomni_lite's, relative


def build_model(vocab_size: int, num_image_codes: int, image_token_id: int, sp_size: int, sp_group: Any) -> TinyVLM:
    """The tiny VLM of configs/vlm_tiny.yaml, the same weights on every rank (Ulysses attention under SP)."""
    torch.manual_seed(0)
    lm = TinyLMConfig(vocab_size=vocab_size, **MODEL_DIMS)
    model = TinyVLM(TinyVLMConfig(lm=lm, num_image_codes=num_image_codes, image_token_id=image_token_id))
    if sp_size > 1:
        set_attention_fn(model, ulysses_attention(causal_attention, sp_group))
    return model


def whole_step(
    strategy: LossStrategy,
    model: TinyVLM,
    optimizer: torch.optim.Optimizer | None,
    micro_batches: list[MicroBatch],
    heads: tuple[str, ...] = LOSS_KEYS,
) -> tuple[dict[str, float], torch.Tensor]:
    """One optimizer step with `strategy`'s scaling: (this rank's scaled loss per head, the averaged flat gradient).

    `optimizer=None` (the check round) leaves the parameters as they are.
    """
    step_tokens = count_loss_token(micro_batches)
    strategy.start_step(step_tokens, len(micro_batches))
    totals = dict.fromkeys(heads, 0.0)
    for micro_batch in micro_batches:
        outputs = model(**micro_batch)
        scaled = strategy.scale({key: outputs[key] for key in heads}, count_loss_token(micro_batch), step_tokens)
        sum(scaled.values()).backward()
        totals = {key: totals[key] + scaled[key].detach() for key in heads}
    params = list(model.parameters())
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
    dist.all_reduce(flat)  # the gradient sync: one flat all-reduce, what DDP/FSDP do per bucket
    flat /= dist.get_world_size()
    if optimizer is None:
        model.zero_grad(set_to_none=True)
        return totals, flat
    offset = 0
    for p in params:
        p.grad = flat[offset : offset + p.numel()].view_as(p).clone()
        offset += p.numel()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return totals, flat


def check(strategy: LossStrategy, reference: LossStrategy, model: TinyVLM, data: list[MicroBatch]) -> dict[str, Any]:
    """The strategy's gradients and world-mean loss against veomni_lite's, on the heads it normalizes globally."""
    heads = getattr(strategy, "global_heads", LOSS_KEYS)
    out = {}
    for name, each in (("peer", strategy), ("ref", reference)):
        reset_loss_memo()
        losses, flat = whole_step(each, model, None, data, heads)
        loss = torch.stack([torch.as_tensor(v, dtype=torch.float64) for v in losses.values()]).sum().reshape(1)
        dist.all_reduce(loss)
        out[name] = (loss / dist.get_world_size(), flat)
    (loss, grad), (ref_loss, ref_grad) = out["peer"], out["ref"]
    result = {"heads": list(heads), "grad_rel_diff": float((grad - ref_grad).abs().max() / ref_grad.abs().max())}
    result["loss_rel_diff"] = float((loss - ref_loss).abs().max() / ref_loss.abs().max())
    if result["grad_rel_diff"] > GRAD_TOL or result["loss_rel_diff"] > LOSS_TOL:
        raise AssertionError(f"{strategy.label} differs from veomni_lite: {result}")
    return result


def bench_layout(layout: dict[str, int], model: TinyVLM, data: list[list[MicroBatch]], args: Any) -> list[dict]:
    """Every strategy at one (world, SP, GA): counts, the equality check, then interleaved timing."""
    strategies = {cls.key: cls() for cls in LOSS_STRATEGIES}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    counter, records = OpCounter(), []
    for key, strategy in strategies.items():
        reset_loss_memo()
        records.append({**layout, "strategy": key, "label": strategy.label})
        records[-1]["check"] = check(strategy, strategies["c"], model, data[0])
        records[-1]["counts"] = counter.count(lambda s=strategy: whole_step(s, model, optimizer, data[0]))
    steps = {
        key: (lambda rep, s=s: whole_step(s, model, optimizer, data[rep % len(data)])) for key, s in strategies.items()
    }
    times = timed_reps(steps, args.budget_s, args.min_reps, args.max_reps)
    for record in records:
        record["times_s"] = times[record["strategy"]]
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="the JSON file rank 0 writes")
    parser.add_argument("--ga", default="1,8", help="comma-separated gradient-accumulation values")
    parser.add_argument("--sp", default="1,2", help="comma-separated sequence-parallel sizes")
    parser.add_argument("--budget-s", type=float, default=4.0, help="timed seconds per configuration (all schemes)")
    parser.add_argument("--min-reps", type=int, default=5)
    parser.add_argument("--max-reps", type=int, default=30)
    parser.add_argument("--trainer-ga", default="8", help="GA values of the trainer against the bare loop ('': skip)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    world, rank = dist.get_world_size(), dist.get_rank()
    dataset, records = vlm_dataset(), []
    for sp in (int(v) for v in args.sp.split(",") if v and world % int(v) == 0):
        state = init_parallel_state(world // sp, sp)
        model = build_model(dataset.vocab_size, dataset.num_image_codes, dataset.image_token_id, sp, state.sp_group)
        for ga in (int(v) for v in args.ga.split(",") if v):
            data = make_steps(
                dataset, MICRO_BATCH_SIZE, ga, state.dp_size, state.dp_rank, sp, state.sp_rank, DATA_STEPS
            )
            records += bench_layout({"bench": "step", "world": world, "sp": sp, "ga": ga}, model, data, args)
            if rank == 0:
                print(f"[bench] world {world} sp {sp} ga {ga} done", flush=True)
        reset_loss_memo()
        destroy_parallel_state()
    if args.trainer_ga:
        from trainer_costs import bench_trainer

        ga_values = [int(v) for v in args.trainer_ga.split(",") if v]
        data = {ga: make_steps(dataset, MICRO_BATCH_SIZE, ga, world, rank, 1, 0, DATA_STEPS) for ga in ga_values}
        records += bench_trainer(world, data, MICRO_BATCH_SIZE, args)
    if rank == 0:
        Path(args.out).write_text(json.dumps({"world": world, "records": records}))
    dist.barrier()
    destroy_process_groups()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()


# ------------------------------------------------------------------------------------------- the page's block
MODES = {
    "quick": {"worlds": (2,), "args": ["--ga", "1,8", "--budget-s", "0.5", "--min-reps", "2", "--max-reps", "5"]},
    "full": {"worlds": (2, 4), "args": ["--ga", "1,8,16", "--budget-s", "5", "--min-reps", "6", "--trainer-ga", "1,8"]},
}
TARGETS = (("c", "o", "<=", 1.05), ("b", "c", ">=", 1.0))  # (num, den, op, bound) of the step's paired time ratios
TRAINER_BOUND = 1.1  # trainer / bare at GA 8


def block(work: Path, quick: bool) -> dict[str, Any]:
    """Launch the worker per world size; the page's block (tables and targets)."""
    from harness import summarize, torchrun

    mode = MODES["quick" if quick else "full"]
    records = []
    for world in mode["worlds"]:
        out = work / f"world{world}.json"
        torchrun(Path(__file__), world, ["--out", str(out), *mode["args"]], timeout_s=900)
        records += json.loads(out.read_text())["records"]

    def ms(record: dict[str, Any]) -> str:
        s = summarize(record["times_s"])
        return f"{s['median'] * 1e3:.1f} [{s['q1'] * 1e3:.1f}–{s['q3'] * 1e3:.1f}]"

    def paired(num: dict[str, Any], den: dict[str, Any]) -> list[float]:
        return [a / b for a, b in zip(num["times_s"], den["times_s"])]

    rows, trainer_rows, targets, labels, worst = [], [], [], {}, 0.0
    for layout in sorted({(r["world"], r["sp"], r["ga"]) for r in records if r["bench"] == "step"}):
        by = {r["strategy"]: r for r in records if r["bench"] == "step" and (r["world"], r["sp"], r["ga"]) == layout}
        labels |= {key: r["label"] for key, r in by.items()}
        worst = max([worst] + [r["check"]["grad_rel_diff"] for r in by.values()])
        counts = [" / ".join(str(by[k]["counts"][what]) for k in "abcdo") for what in ("collectives", "host_reads")]
        rows.append([*layout, *(ms(by[k]) for k in "abcdo"), *counts, len(by["c"]["times_s"])])
        where = "world {}, SP {}, GA {}".format(*layout)
        for num, den, op, bound in TARGETS:
            name = f"whole step ({num})/({den}), {where}"
            targets.append({"name": name, "op": op, "bound": bound, "unit": "x", "values": paired(by[num], by[den])})
    for world, ga in sorted({(r["world"], r["ga"]) for r in records if r["bench"] == "trainer"}):
        by = {r["strategy"]: r for r in records if r["bench"] == "trainer" and (r["world"], r["ga"]) == (world, ga)}
        ratio = paired(by["trainer"], by["bare"])
        counts = [f"{by['trainer']['counts'][w]} / {by['bare']['counts'][w]}" for w in ("collectives", "host_reads")]
        trainer_rows.append([world, ga, ms(by["trainer"]), ms(by["bare"]), *counts, len(ratio)])
        if ga == 8:
            name = f"trainer step / bare FSDP2 loop, world {world}, GA {ga}"
            targets.append({"name": name, "op": "<=", "bound": TRAINER_BOUND, "unit": "x", "values": ratio})
    about = (
        "The tiny VLM of `configs/vlm_tiny.yaml` (two loss heads), micro-batch size 2, one process per rank (gloo, "
        "one thread each), `benchmarks/bench_worker.py`: per micro-batch count, forward, the scheme's loss "
        "scaling, backward; one flat gradient all-reduce and AdamW, the same for every scheme. The schemes are small "
        "re-implementations of the published ones (`benchmarks/baselines.py`), run interleaved in the same "
        "processes (order rotated each repetition; a step's time is its slowest rank's); each target's values are "
        "the paired ratios of one repetition. Before timing, one untimed step per scheme counts the whole step's "
        "collectives (gradient sync and Ulysses all-to-alls included) and host reads (AdamW's included) and checks "
        f"its gradients against (c): largest relative difference {worst:.1e} ((d) on `foundation_loss` only: it "
        "has no global count for the other head).\n\n"
        + "\n".join(f"- **{label.split(' ', 1)[0]}** {label.split(' ', 1)[1]}" for label in labels.values())
        + "\n\nThe trainer against a bare loop (`benchmarks/trainer_costs.py`): the real `BaseTrainer` step (data "
        "checks, control all-reduce, train_step, metrics) against the same FSDP2 model, micro-batches and AdamW "
        "with the oracle's normalization and nothing else, from equal weights (equal gradient norms checked)."
    )
    columns = ["world", "SP", "GA", *(f"({k}) ms median [IQR]" for k in "abcdo")]
    columns += ["collectives a/b/c/d/o", "host reads a/b/c/d/o", "reps"]
    trainer_columns = ["world", "GA", "trainer ms", "bare ms", "collectives trainer/bare", "host reads", "reps"]
    tables = [{"columns": columns, "rows": rows}]
    tables += [{"title": "The trainer against a bare loop", "columns": trainer_columns, "rows": trainer_rows}]
    return {"title": "The whole step against the peers' schemes", "about": about, "tables": tables, "targets": targets}
