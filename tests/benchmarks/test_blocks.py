"""The bench blocks' targets from stubbed measurements (nothing is launched): the values each target gets, and a
target the mode does not measure left without values, with its reason."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import data_startup  # noqa: E402
import lm_head  # noqa: E402


def by_name(block: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {target["name"]: target for target in block["targets"]}


def fake_run(rows: int, images: bool, peaks: list[float], second_s: float, rate: float) -> dict[str, Any]:
    first = {"to_first_step_s": 20.0, "data_s": rows / rate, "cpu_s": 1.0, "peak_rss_mib": peaks}
    second = {"to_first_step_s": second_s, "data_s": 1.0, "cpu_s": 0.5, "peak_rss_mib": [p - 10 for p in peaks]}
    kind = "images" if images else "text"
    return {"kind": kind, "rows": rows, "first": first, "second": second, "rows_per_s": rate, "cpu_ms_per_row": 0.5}


def test_data_startup_targets(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    runs = {
        (10**4, False): fake_run(10**4, False, [500.0, 510.0], 12.0, 1000.0),
        (10**5, False): fake_run(10**5, False, [520.0, 530.0], 14.0, 2000.0),
        (10**6, False): fake_run(10**6, False, [600.0, 700.0], 30.0, 2500.0),
        (10**4, True): fake_run(10**4, True, [540.0, 545.0], 70.0, 300.0),
    }
    monkeypatch.setattr(data_startup, "measure_one", lambda work, rows, images: runs[rows, images])
    full = by_name(data_startup.block(tmp_path, quick=False))
    assert full["first-run rate, 1,000,000 text rows, both ranks"]["values"] == [2500.0]
    assert full["first-run rate, 1,000,000 text rows, both ranks"]["bound"] == 4 * data_startup.OLD_RATE
    assert full["second run to step 1, 10^6 text rows"]["values"] == [30.0]
    assert full["peak RSS per rank, 10^6 / 10^4 text rows (first run)"]["values"] == [max(600 / 500, 700 / 510)]
    assert full["second run to step 1, 10^4 image rows"]["values"] == [70.0]
    quick = by_name(data_startup.block(tmp_path, quick=True))
    assert quick["first-run rate, 10,000 text rows, both ranks"]["values"] == [1000.0]
    for name in ("second run to step 1, 10^6 text rows", "second run to step 1, 10^4 image rows"):
        assert quick[name]["values"] == [] and "quick mode" in quick[name]["note"]


def test_lm_head_targets(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    peaks = {(lm_head.BASE_VOCAB, True): 400.0, (lm_head.BASE_VOCAB, False): 420.0}
    peaks |= {(lm_head.VOCAB, True): 700.0, (lm_head.VOCAB, False): 7000.0}
    seconds = {True: [2.0, 4.0, 5.0], False: [4.0, 4.0, 4.0]}

    def run(vocab: int, tokens: int, fused: bool, reps: int) -> dict[str, Any]:
        return {"seconds": seconds[fused][:reps], "peak_rss_mib": peaks[vocab, fused] + tokens / 1024}

    monkeypatch.setattr(lm_head, "_run", run)
    monkeypatch.setattr(lm_head, "_available_mib", lambda: 50_000.0)  # the plain head fits at 4,096 tokens, not 32,768
    full = by_name(lm_head.block(tmp_path, quick=False))
    logits = 4096 * lm_head.VOCAB * 4 / 2**20
    assert full["fused growth / one float32 [4,096, vocab] tensor"]["values"] == [300.0 / logits]
    assert full["fused / plain tokens/s, 4,096 tokens"]["values"] == [2.0, 1.0, 0.8]  # step by step
    assert full["fused / plain tokens/s, 32,768 tokens"]["values"] == []
    assert "does not fit" in full["fused / plain tokens/s, 32,768 tokens"]["note"]
    quick = by_name(lm_head.block(tmp_path, quick=True))
    assert quick["fused / plain tokens/s, 4,096 tokens"]["values"] == []
    assert "quick mode" in quick["fused / plain tokens/s, 4,096 tokens"]["note"]


def test_step_targets_are_paired_ratios(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import bench_worker
    import harness

    times = {"a": [3.0, 3.0], "b": [2.0, 4.0], "c": [2.0, 2.0], "d": [1.0, 1.0], "o": [1.0, 4.0]}
    check, counts = {"grad_rel_diff": 1e-7}, {"collectives": 2, "host_reads": 3}
    records = [
        {"bench": "step", "world": 2, "sp": 1, "ga": 8, "strategy": key, "label": f"({key}) scheme {key}"}
        | {"times_s": value, "check": check, "counts": counts}
        for key, value in times.items()
    ]
    for ga in (1, 8):
        for name, value in (("trainer", [1.2, 0.9]), ("bare", [1.0, 1.0])):
            records.append(
                {"bench": "trainer", "world": 2, "ga": ga, "strategy": name, "times_s": value, "counts": counts}
            )

    def torchrun(script: Path, nproc: int, args: list[str], timeout_s: float) -> str:
        Path(args[args.index("--out") + 1]).write_text(json.dumps({"records": records}))
        return ""

    monkeypatch.setattr(harness, "torchrun", torchrun)
    block = by_name(bench_worker.block(tmp_path, quick=True))
    assert block["whole step (c)/(o), world 2, SP 1, GA 8"]["values"] == [2.0, 0.5]
    assert block["whole step (b)/(c), world 2, SP 1, GA 8"]["values"] == [1.0, 2.0]
    assert block["trainer step / bare FSDP2 loop, world 2, GA 8"]["values"] == [1.2, 0.9]
    assert not any("GA 1" in name for name in block)  # GA 1 of the trainer is shown, not a target


def test_preference_targets_are_paired_ratios_to_sft(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import preference

    timed = {
        "seconds": {"sft": [1.0, 2.0, 1.0], "live": [1.5, 2.0, 1.2], "precomputed": [1.0, 2.5, 1.1]},
        "positions": {"sft": [100, 100, 100], "live": [90, 120, 100], "precomputed": [100, 100, 99]},
        "reference_pass_s": 0.5,
    }
    mib = 2**20
    memory = {
        "live": {"whole_bytes": 8 * mib, "lora_whole_bytes": 9 * mib,
                 "ranks": [{"peak_rss_mib": 500.0, "reference_bytes": 4 * mib, "lora_reference_bytes": 0},
                           {"peak_rss_mib": 502.0, "reference_bytes": 4 * mib + 8, "lora_reference_bytes": 0}]},
        "precomputed": {"whole_bytes": 8 * mib,
                        "ranks": [{"peak_rss_mib": 496.0, "reference_bytes": 0},
                                  {"peak_rss_mib": 497.5, "reference_bytes": 0}]},
    }  # fmt: skip
    monkeypatch.setattr(preference, "write_inputs", lambda work, model: (tmp_path, tmp_path, tmp_path))
    monkeypatch.setattr(preference, "speed", lambda work, model_dir, quick: timed)
    monkeypatch.setattr(preference, "memory", lambda work, model_dir, quick: memory)
    block = preference.block(tmp_path, quick=True)
    targets = by_name(block)
    # each DPO step's positions/s over the SFT step of the same repetition
    assert targets["DPO precomputed reference / SFT positions/s"]["values"] == pytest.approx([1.0, 0.8, 0.9])
    assert targets["DPO precomputed reference / SFT positions/s"]["bound"] == 0.90
    assert targets["live reference / whole model per rank (2 ranks)"]["values"] == [(4 * mib + 8) / (8 * mib)]
    assert targets["live reference bytes per rank under LoRA"]["values"] == [0]
    speed, mem = (table["rows"] for table in block["tables"])
    assert speed[1][2] == pytest.approx(100 / 1.2 / 100)  # live: the median of 60/100, 60/50, 83.3/100
    assert speed[2][5] == 0.5 and speed[0][5] is None
    assert mem[0][4] == 502.0 and mem[0][5] == "+4.0 / +4.5" and mem[1][4] == 497.5


def test_real_size_targets(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import real_size

    peaks = {"sft": (500.0, 900.0), "grpo": (480.0, 1000.0), "dpo": (510.0, 1100.0)}
    seconds = {"sft": [10.0, 12.0, 11.0], "grpo": [15.0, 30.0, 20.0], "dpo": [14.0, 14.0, 14.0]}

    def measure(work_dir: Path, quick: bool) -> dict[str, Any]:
        jobs = ("grpo",) if quick else real_size.JOBS
        vocabs = (real_size.BASE_VOCAB, real_size.VOCAB)
        run = {"seconds": None, "positions": [4096] * 3}
        return {job: {vocab: {**run, "seconds": seconds[job], "peak_rss_mib": peaks[job][big]}
                      for big, vocab in enumerate(vocabs)} for job in jobs}  # fmt: skip

    monkeypatch.setattr(real_size, "measure", measure)
    monkeypatch.setattr(real_size, "model_dir", lambda work_dir, vocab: work_dir)
    monkeypatch.setattr(real_size, "write_data", lambda work_dir: work_dir)
    full = by_name(real_size.block(tmp_path, quick=False))
    grpo, dpo = (f"{real_size.JOBS_LABELS[j]}: peak growth / one float32 logits tensor" for j in ("grpo", "dpo"))
    assert full[grpo]["values"] == [520.0 / real_size.LOGITS_MIB]
    assert full[dpo]["values"] == [590.0 / real_size.LOGITS_MIB]
    assert full["GRPO time per position / SFT's at vocab 151,936"]["values"] == [15 / 11, 30 / 11, 20 / 11]
    quick = by_name(real_size.block(tmp_path, quick=True))
    assert quick[grpo]["values"] == [520.0 / real_size.LOGITS_MIB] and quick[dpo]["values"] == []
    assert "quick mode" in quick["GRPO time per position / SFT's at vocab 151,936"]["note"]


def test_trl_side_by_side_targets(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import preference
    import trl_side_by_side as bench

    def result(job: str, nproc: int, steps: int, variant: str) -> dict[str, Any]:
        warmup = bench.WARMUP[steps == bench.STEPS[True]]  # slow first steps, then 1, 3, 2, 1, ... against 4
        ours = [9.0] * warmup + [[1.0, 3.0, 2.0][i % 3] for i in range(steps - warmup)]
        trl = [9.0] * warmup + [4.0] * (steps - warmup)
        generate = [0.0] * steps if job != "grpo" else [1.0] * steps
        out = {
            "times": {"ours": ours, "trl": trl, "ours_generate": generate, "trl_generate": generate},
            "build_s": {"ours": 1.0, "trl": 2.0}, "reference_pass_s": {"ours": 0.5, "trl": 0.7},
            "trl_parallel": "DistributedDataParallel (MULTI_CPU)",
            "losses": {"ours": [0.5] * steps, "trl": [0.5 + 1e-7] * steps},
            "grad_norms": {"ours": [2.0] * steps, "trl": [2.0] * steps},
        }  # fmt: skip
        if job == "grpo":
            out["losses"]["ours"] = [0.3] * steps  # its own samples: no equality expected
            out |= {"lengths": {"ours": [15.0], "trl": [16.0]}, "rewards": {"ours": [0.1], "trl": [0.2]}}
            if nproc == 1 and not variant:  # the real block checks the given rollouts in its first launch only
                out |= {"given": {"losses": [0.5 + 3e-6] * steps, "grad_norms": [2.0] * steps}, "prompts_equal": True}
        return out

    launched = []

    def launch(work: Path, model: Path, nproc: int, jobs: list[str], steps: int, variant: str) -> dict[str, Any]:
        launched.append((nproc, steps, variant))
        return {job: result(job, nproc, steps, variant) for job in jobs}

    monkeypatch.setattr(preference, "write_inputs", lambda work, model: (tmp_path, tmp_path, tmp_path))
    monkeypatch.setattr(bench, "_launch", launch)
    full = by_name(bench.block(tmp_path, quick=False))
    variants = [(1, ""), (1, "padded"), (2, ""), (2, "replicated")]
    assert launched == [(n, bench.STEPS[False], variant) for n, variant in variants]
    steps = bench.STEPS[False] - bench.WARMUP[False]  # the paired ratios after the warm-up steps
    for layout in ("1, ours padded", "2, ours FSDP2", "2, ours replicated"):
        for which, bound in (("issue 48's", 0.7), ("proposed", 1.0)):
            target = full[f"SFT step, ours / TRL, processes {layout}, {which} target"]
            assert target["values"] == [[0.25, 0.75, 0.5][i % 3] for i in range(steps)] and target["bound"] == bound
    assert full["GRPO step without generation, ours / TRL, processes 1"]["values"][:3] == [0.0, 2.0 / 3.0, 1.0 / 3.0]
    assert full["DPO, live reference: largest per-step loss difference, processes 1"]["values"] == [pytest.approx(1e-7)]
    assert full["GRPO on TRL's samples: largest per-step loss difference"]["values"] == [pytest.approx(2.9e-6)]
    assert len([name for name in full if "GRPO on TRL" in name]) == 1  # 1 process, ours packed
    launched.clear()
    quick = by_name(bench.block(tmp_path, quick=True))
    assert launched == [(1, bench.STEPS[True], "")]
    assert quick["DPO, precomputed reference step, ours / TRL, processes 1, proposed target"]["values"] == [0.25]


def fake_moe_worker(variant: str, world: int, ep: int, counted: dict[str, Any]) -> dict[str, Any]:
    """One `moe._worker` result: EP=2 halves the gathered experts and each step's time."""
    seconds = [0.10, 0.12, 0.11] if variant == "dense" else [0.13 / max(ep, 1), 0.15 / ep, 0.14 / ep]
    rank = {
        "bytes": {
            "experts": {"parameters": 400, "gradients": 400, "optimizer": 800},
            "other": {"parameters": 100, "gradients": 100, "optimizer": 200},
        },
        "gathered": [320 // ep, 320 // ep],
        "profiled_s": 2.0,
        "busy_s": {"all_gather": 0.5, "all_reduce": 0.2},
    }
    return {"seconds": seconds, "collectives": counted[variant], "parameters": 100, "active": 50, "experts": 160,
            "positions": [64, 64, 64], "ranks": [rank] * world, "ep_size": ep, "num_experts": 16,
            "top_k": 2}  # fmt: skip


@pytest.mark.parametrize(("with_ep", "fail_ep2"), [(False, False), (True, False), (True, True)])
def test_moe_block_targets(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, with_ep: bool, fail_ep2: bool) -> None:
    import harness
    import moe

    dense = {"all_reduce": 2, "all_gather_into_tensor": 8, "reduce_scatter_tensor": 4}
    counted = {"dense": dense, "micro-batch": dense, "global-batch": {**dense, "all_reduce": 3}}  # one too many
    launched = []

    def fake_torchrun(script: Path, nproc: int, args: list[str], timeout: float, env: Any = None) -> None:
        variant, out = args[args.index("--worker") + 1], Path(args[args.index("--out") + 1])
        ep = int(args[args.index("--ep-size") + 1])
        launched.append((variant, nproc, ep))
        if fail_ep2 and ep == 2:
            raise RuntimeError("moe.py exited 1:\n[rank0]: RuntimeError: Cannot use ReduceOp.PREMUL_SUM with Gloo\n")
        out.write_text(json.dumps(fake_moe_worker(variant, nproc, ep, counted)))

    def fake_step(launcher: list[str], script: Path, args: list[str], timeout: float) -> None:
        assert script.name == "moe_step.py" and args[args.index("--shape") + 1] == "quick"
        seconds = {"ours": [0.2, 0.4, 0.3], "theirs": [0.3, 0.3, 0.3]}
        shape = {"num_experts": 16, "num_experts_per_tok": 4, "hidden_size": 128, "num_hidden_layers": 2}
        result = {**shape, "seconds": seconds, "cpu_seconds": seconds, "step_tokens": [512] * 3, "loss_rel_diff": 1e-8}
        Path(args[args.index("--out") + 1]).write_text(json.dumps(result))

    monkeypatch.setattr(
        moe, "write_models", lambda work_dir, layers, experts=None: {"dense": tmp_path, "moe": tmp_path}
    )
    monkeypatch.setattr(moe, "ep_supported", lambda: with_ep)
    monkeypatch.setattr(harness, "torchrun", fake_torchrun)
    monkeypatch.setattr(harness, "run_script", fake_step)
    block = moe.block(tmp_path, quick=True)
    targets = by_name(block)
    assert targets["MoE collectives per step beyond the dense step's"]["values"] == [0, 0, 1]
    rows = {row[0]: row for row in block["tables"][0]["rows"]}
    assert rows["micro-batch"][-1] == pytest.approx(0.14 / 0.11) and rows["dense"][-1] == 1.0
    assert "same collectives in every variant: False" in block["about"]
    # ours against transformers: transformers' time over ours, step by step
    assert targets["ours / transformers tokens/s, one process (python)"]["values"] == pytest.approx([1.5, 0.75, 1.0])
    assert not any("(torchrun)" in name for name in targets), "quick: the plain launch alone"
    # quick: EP=1 is the micro-batch variant's run; EP=2 runs only where the tree has parallel.ep_size
    assert (
        launched == [("dense", 2, 1), ("micro-batch", 2, 1), ("global-batch", 2, 1)] + [("micro-batch", 2, 2)] * with_ep
    )
    if fail_ep2:  # the layout's row says why; the EP=1 row and the other targets stand
        memory = block["tables"][2]["rows"]
        assert [row[:3] for row in memory] == [
            [2, 1, 160 / 100],
            [2, 2, "failed: RuntimeError: Cannot use ReduceOp.PREMUL_SUM with Gloo"],
        ]
        assert targets["positions/s, DP=2: EP=2 / EP=1"]["values"] == []
        return
    gathered = targets["one MoE layer's experts gathered per rank / (all of them / EP)"]["values"]
    assert gathered == pytest.approx([320 / (160 * 4 / 2)] + [160 / (160 * 4 / 2 / 2)] * with_ep)
    speedup = targets["positions/s, DP=2: EP=2 / EP=1" + " (16 experts, top-2)" * with_ep]  # the EP run's model
    if with_ep:
        assert speedup["values"] == pytest.approx([2.0, 2.0, 2.0])
    else:
        assert speedup["values"] == [] and "parallel.ep_size is not in this tree" in speedup["note"]
    memory = block["tables"][2]["rows"]
    assert [row[:2] for row in memory] == [[2, 1]] + [[2, 2]] * with_ep
    assert memory[0][3] == pytest.approx(1600 / 2**20) and memory[0][8] == 0.25 and memory[0][-1] == 0.1
