"""make bench: SFT data start-up at a user's scale: a generated `messages` JSONL (and an image set) on 2 ranks.

Per size, two torchrun launches of `trainers/train_sft.py`'s trainer on the same files and `data.cache_dir`: the
first run preprocesses (and writes the cache), the second finds it. Per run: the time from the launch to the end of
step 1, each rank's peak RSS (`VmHWM`), and the first run's preprocessing rate (rows over the slowest rank's time
to build its datasets). The model is a tiny Qwen2 (Qwen2-VL for images) directory of `examples.sft_demo`.
`python benchmarks/data_startup.py --rows 10000 [--images]` runs one size by hand.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
WORDS = [
    "alpha", "beta", "gamma", "delta", "epsilon", "zeta", "theta", "iota", "kappa", "lambda", "sigma", "omega", "red",
    "green", "blue", "one", "two", "three",
]  # fmt: skip


def write_rows(path: Path, rows: int, images: bool) -> None:
    """`rows` short conversations (for images: one PNG of 16 sizes each, the files shared by many rows)."""
    if path.is_file():
        return
    rng = random.Random(0)
    path.parent.mkdir(parents=True, exist_ok=True)
    if images:
        from PIL import Image

        (path.parent / "img").mkdir(exist_ok=True)
        for i in range(16):
            Image.new("L", (8 + 4 * i, 8 + 2 * i), color=16 * i).save(path.parent / "img" / f"{i}.png")
    with path.with_suffix(".tmp").open("w") as handle:
        for index in range(rows):
            question = " ".join(rng.choices(WORDS, k=rng.randint(4, 16)))
            answer = " ".join(rng.choices(WORDS, k=rng.randint(4, 24)))
            row: dict[str, Any] = {"messages": [{"role": "user", "content": f"Q{index}: {question}?"}]}
            if images:
                row["messages"][0]["content"] = f"<image>{question}?"
                row["images"] = [f"img/{rng.randrange(16)}.png"]
            row["messages"].append({"role": "assistant", "content": answer})
            handle.write(json.dumps(row) + "\n")
    path.with_suffix(".tmp").replace(path)


def model_dir(work: Path, images: bool) -> Path:
    from examples.sft_demo import write_text_model, write_vl_model

    directory = work / ("qwen2_vl" if images else "qwen2")
    if not (directory / "config.json").is_file():
        texts = [" ".join(WORDS), *(f"Q{i}: ?" for i in range(100)), "What digit is this?"]
        (write_vl_model if images else write_text_model)(directory, texts)
    return directory


def worker(args: argparse.Namespace) -> None:
    """One rank: build the trainer (the SFT data timed), run step 1, write this rank's numbers."""
    import torch

    from veomni_lite.config import load_config
    from veomni_lite.trainer.sft import SFTTrainer

    timing: dict[str, float] = {}

    class Timed(SFTTrainer):
        def build_datasets(self) -> Any:
            torch.distributed.barrier(self.control_group)  # timed from when both ranks are here
            start, cpu = time.perf_counter(), time.process_time()
            try:
                return super().build_datasets()
            finally:
                timing["data_s"], timing["cpu_s"] = time.perf_counter() - start, time.process_time() - cpu

    torch.set_num_threads(1)
    overrides = [
        "--model.pretrained_dir", args.model, "--data.train_path", args.data, "--data.format", "messages",
        "--data.max_seq_len", "256", "--train.output_dir", args.out, "--train.eval_batches", "0",
        "--train.micro_batch_size", "4", "--train.global_batch_size", "16", "--train.max_steps", "1",
        "--checkpoint.save_interval", "0", "--logging.progress_bar", "false", "--logging.tensorboard", "false",
        "--logging.plot", "false", *args.extra,
    ]  # fmt: skip
    trainer = Timed(load_config(REPO / "configs" / "sft_help.yaml", overrides))
    micro_batches = [trainer.shard(mb) for mb in trainer.loader.next_step()]
    trainer._agree(micro_batches)
    trainer.train_step(micro_batches)
    done = time.time()
    status = Path("/proc/self/status").read_text()
    peak_kib = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM")))
    result = {"rank": trainer.rank, "first_step_at": done, **timing, "peak_rss_mib": peak_kib / 1024}
    Path(f"{args.result}.{trainer.rank}").write_text(json.dumps(result))
    trainer.close()


def launch(work: Path, data: Path, model: Path, run: str, extra: list[str], timeout_s: float) -> dict[str, Any]:
    """One 2-rank launch; (seconds to step 1, slowest rank's data time, peak RSS per rank)."""
    result = work / f"result_{run}"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__]
    command += ["--worker", "--data", str(data), "--model", str(model), "--out", str(work / "run"), "--result"]
    command += [str(result), "--", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    start = time.time()
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode:
        raise RuntimeError(f"data start-up run {run} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    ranks = [json.loads(Path(f"{result}.{rank}").read_text()) for rank in range(2)]
    return {
        "to_first_step_s": max(r["first_step_at"] for r in ranks) - start,
        "data_s": max(r["data_s"] for r in ranks),
        "cpu_s": sum(r["cpu_s"] for r in ranks),
        "peak_rss_mib": [round(r["peak_rss_mib"], 1) for r in ranks],
    }


def measure_one(work: Path, rows: int, images: bool, again: bool = True, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """A first and a second launch on `rows` generated rows; `extra`: more trainer arguments for both."""
    timeout_s = max(600.0, rows / 100)  # a run at 100 rows per second would be broken
    kind = "images" if images else "text"
    data = work / f"{kind}_{rows}" / "train.jsonl"
    write_rows(data, rows, images)
    model = model_dir(work, images)
    cache = work / f"cache_{kind}_{rows}"
    extra = [*(["--data.cache_dir", str(cache)] if os.environ.get("BENCH_DATA_CACHE", "1") == "1" else []), *extra]
    if cache.exists():
        subprocess.run(["rm", "-rf", str(cache)], check=True)
    first = launch(work, data, model, f"{kind}{rows}a", extra, timeout_s)
    second = launch(work, data, model, f"{kind}{rows}b", extra, timeout_s) if again else None
    row = {"kind": kind, "rows": rows, "first": first, "second": second, "rows_per_s": rows / first["data_s"]}
    row["cpu_ms_per_row"] = first["cpu_s"] / rows * 1e3  # both ranks' CPU time: steadier on a shared machine
    print(f"[bench] data start-up {kind} {rows} rows: {json.dumps(row)}", flush=True)
    return row


OLD_RATE = 593  # rows/s, both ranks, the best first run before the cache (issue 31: main at 4a25425, 417-593)


def block(work: Path, quick: bool) -> dict[str, Any]:
    """10^4, 10^5 and 10^6 text rows and 10^4 image rows; quick: 10^4 text rows (a launch costs about 20 s here)."""
    from harness import prose

    sizes = [(10**4, False)] if quick else [(10**4, False), (10**5, False), (10**6, False), (10**4, True)]
    runs = [measure_one(work, rows, images) for rows, images in sizes]
    rows = []
    for run in runs:
        first, second = run["first"], run["second"]
        rss = ["{:.0f} / {:.0f}".format(*each["peak_rss_mib"]) for each in (first, second)]
        times = [first["to_first_step_s"], second["to_first_step_s"]]
        rows.append([run["kind"], run["rows"], *times, *rss, run["rows_per_s"], run["cpu_ms_per_row"]])
    text = {run["rows"]: run for run in runs if run["kind"] == "text"}
    images = [run for run in runs if run["kind"] == "images"]
    big, small = text.get(10**6), text[10**4]
    rss_ratio = (
        [max(a / b for a, b in zip(big["first"]["peak_rss_mib"], small["first"]["peak_rss_mib"]))] if big else []
    )
    largest, note = text[max(text)], "quick mode: the full mode runs 10^6 text rows and 10^4 image rows"
    targets = [
        {"name": f"first-run rate, {largest['rows']:,} text rows, both ranks", "op": ">=", "bound": 4 * OLD_RATE}
        | {"unit": "rows/s", "values": [largest["rows_per_s"]]},
        {"name": "second run to step 1, 10^6 text rows", "op": "<=", "bound": 60, "unit": "s", "note": note}
        | {"values": [big["second"]["to_first_step_s"]] if big else []},
        {"name": "peak RSS per rank, 10^6 / 10^4 text rows (first run)", "op": "<=", "bound": 1.5, "unit": "x"}
        | {"note": note, "values": rss_ratio},
        {"name": "second run to step 1, 10^4 image rows", "op": "<=", "bound": 60, "unit": "s", "note": note}
        | {"values": [images[0]["second"]["to_first_step_s"]] if images else []},
    ]
    columns = ["set", "rows", "first run: s to step 1", "second run: s to step 1"]
    columns += ["first run peak RSS MiB (rank 0 / 1)", "second run peak RSS MiB", "first run rows/s (both ranks)"]
    columns += ["first run CPU ms per row"]
    about = prose(__doc__) + f" The rate target is 4x the best first-run rate before the cache ({OLD_RATE} rows/s)."
    table = {"columns": columns, "rows": rows}
    return {"title": "SFT data start-up", "about": about, "tables": [table], "targets": targets}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--data", default="")
    parser.add_argument("--model", default="")
    parser.add_argument("--out", default="")
    parser.add_argument("--result", default="")
    parser.add_argument("--rows", type=int, default=10**4)
    parser.add_argument("--images", action="store_true")
    parser.add_argument("--work", type=Path, default=REPO / "benchmarks" / "results" / "raw" / "data_startup")
    parser.add_argument("extra", nargs="*")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))  # the repository's top-level examples/ (sft_demo's model directories)
    if args.worker:
        worker(args)
    else:
        measure_one(args.work, args.rows, args.images, extra=tuple(args.extra))


if __name__ == "__main__":
    main()
