"""`make figures`: run the demo jobs and rewrite the numbers the README and the docs quote from them.

    python scripts/figures.py [NAME ...]       run these figures' jobs (default: all of FIGURES), then rewrite
    python scripts/figures.py --check          only check the pages against docs/figures.json (what the test does)
    python scripts/figures.py --render         only rewrite the pages from docs/figures.json (after editing `render`)

A figure (`FIGURES`) is a make command and what the pages quote from its run: one eval metric at each eval step (and,
for a LoRA run, the base's value before it, from `before.json`), the command's time, optionally the console's last
two lines and train metrics at their first and last logged step, and the loss curve copied into docs/ (or a figure
drawn there from its metrics.jsonl, `curves`). Each job runs at the checkout's HEAD, which must have no uncommitted
change to a tracked file, from a clean output directory, after `make install` (timed apart: the quoted times never
include the install, and say so). Its values go to docs/figures.json with the commit and the date, and every block

    <!-- figure:NAME -->            (or figure:NAME:log, the console's last two lines)
    ...
    <!-- /figure -->

in README.md and docs/*.md is rewritten from them (`render`). `--check` (and tests/test_figures.py) fails when a block
differs from what its recorded run renders (an edited number, say), when a figure's commit is not an ancestor of
HEAD, or when the minor version in setup.cfg changed since it (0.1 -> 0.2: rerun the jobs). Within a minor version a
figure may predate later commits; it names its commit. Adding a demo (the RL or DPO jobs) is one `FIGURES` entry and
a block where the pages quote it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = "docs/figures.json"
Panel = tuple[str, tuple[str, ...]]  # one axes of a drawn figure: its y label and the metrics.jsonl keys on it
BLOCK = re.compile(r"<!-- figure:([\w-]+)(:log)? -->\n(.*?)<!-- /figure -->", re.S)
STEP_LINE = re.compile(r"step (\d+)/\1 \|[^\r\n]*")  # a console line of the run's last step


@dataclass(frozen=True)
class Figure:
    """A demo job and what the pages quote from it."""

    command: str  # as a user types it
    output_dir: str  # its train.output_dir: metrics.jsonl (and before.json)
    metric: str  # the eval metric quoted at each eval step
    about: str  # what the run is, in a few words, for the sentence
    before: bool = False  # also quote `before.json`'s value of `metric`: the model before the run (LoRA's base)
    clean: tuple[str, ...] = ()  # removed before the run, besides output_dir (e.g. an export the job makes)
    after: str = ""  # the figure whose run this job uses: run first unless recorded at this commit
    images: dict[str, str] = field(default_factory=dict)  # a file of the run -> its copy under docs/
    sampled: str = ""  # a train metric also quoted at its first and last logged step (RL: the reward sampled at T)
    quote: str = ""  # a JSON file the job writes in output_dir, {label: value}, quoted whole (DPO: greedy accuracy)
    tracked: tuple[str, ...] = ()  # more train metrics quoted at their first and last logged step (agent: tool calls)
    curves: dict[str, tuple[Panel, ...]] = field(default_factory=dict)  # a figure drawn under docs/ from metrics.jsonl


UNTRAINED_BASE = "outputs/sft_demo/models/qwen2_vl_digits"
FIGURES: dict[str, Figure] = {
    "train": Figure(
        "make train",
        "outputs/qwen2_vl_digits",
        "eval/caption_accuracy",
        "Qwen2-VL on the digits",
        images={"loss_curve.png": "docs/loss_curve.png"},
    ),
    "train-sft": Figure(
        "make train-sft",
        "outputs/sft_digits",
        "eval/answer_accuracy",
        "the digits from their files, which it writes first",
        clean=("outputs/sft_demo",),
        images={"loss_curve.png": "docs/sft_loss_curve.png"},
    ),
    "train-lora": Figure(
        "make train-lora",
        "outputs/sft_digits_lora",
        "eval/answer_accuracy",
        "LoRA on the model make train-sft trained, which it exports first",
        before=True,
        clean=("outputs/sft_digits_hf",),
        after="train-sft",
    ),
    "train-rl": Figure(
        "make train-rl",
        "outputs/rl_digits",
        "eval/accuracy",
        "GRPO with exact_match on the digits' Qwen2-VL after a 60-step SFT warm start, which it runs first; step 1 "
        "is the warm start's greedy accuracy",
        clean=("outputs/rl_digits_sft", "outputs/rl_digits_sft_hf"),
        images={"reward_curve.png": "docs/rl_digits_reward_curve.png"},
        sampled="rl/reward/mean",
    ),
    "train-rl-math": Figure(
        "make train-rl-math",
        "outputs/rl_math_grpo",
        "eval/accuracy",
        "GRPO with the math reward (a worked-out answer: '12 + 8' for 20 scores 0) on arithmetic word problems after "
        "a short SFT warm start, which it runs first; "
        "step 1 is the warm start's greedy accuracy",
        clean=("outputs/rl_math", "outputs/rl_math_sft", "outputs/rl_math_sft_hf"),
        images={"reward_curve.png": "docs/rl_math_reward_curve.png"},
        sampled="rl/reward/mean",
    ),
    "train-agent": Figure(
        "make train-agent",
        "outputs/agent_calc_grpo",
        "eval/accuracy",
        "GRPO episodes with a calculator tool on 3-digit x 2-digit products after a short SFT warm start on "
        "transcripts of which 30% call the tool, which it runs first; step 1 is the warm start's greedy accuracy",
        clean=("outputs/agent_calc", "outputs/agent_calc_sft", "outputs/agent_calc_sft_hf"),
        sampled="rl/reward/mean",
        tracked=("rl/tool_calls/mean",),
        curves={
            "docs/agent_calc_curve.png": (
                ("sampled reward (T=1)", ("rl/reward/mean",)),
                ("tool calls / episode", ("rl/tool_calls/mean",)),
                ("greedy eval accuracy", ("eval/accuracy",)),
            )
        },
    ),
    "train-dpo": Figure(
        "make train-dpo",
        "outputs/dpo_math_run",
        "eval/rewards/accuracies",
        "DPO (beta 0.5, RPO alpha 1) on arithmetic pairs, the worked solution against the same off by one, from a "
        "short SFT warm start, which it runs first; 0 at step 1 by TRL's strict definition, every margin 0 there",
        clean=("outputs/rl_math", "outputs/rl_math_sft", "outputs/rl_math_sft_hf", "outputs/dpo_math_run_hf"),
        images={"accuracy_curve.png": "docs/dpo_accuracy_curve.png"},
        quote="greedy_accuracy.json",
    ),
    "train-dpo-plain": Figure(
        'make train-dpo DPO_OUT=outputs/dpo_math_plain ARGS="--pref.rpo_alpha 0"',
        "outputs/dpo_math_plain",
        "eval/rewards/accuracies",
        "the same DPO without RPO, on the warm start make train-dpo built",
        clean=("outputs/dpo_math_plain_hf",),
        quote="greedy_accuracy.json",
        after="train-dpo",
    ),
    "train-rm": Figure(
        "make train-rm",
        "outputs/rm_math_run",
        "eval/rewards/accuracy",
        "a Bradley-Terry reward model on the same pairs, its score head new on the warm start make train-dpo built",
        images={"accuracy_curve.png": "docs/rm_accuracy_curve.png"},
        after="train-dpo",
    ),
    "train-lora-untrained": Figure(
        f'make train-lora ARGS="--model.pretrained_dir {UNTRAINED_BASE} --train.output_dir '
        'outputs/sft_digits_lora_untrained"',
        "outputs/sft_digits_lora_untrained",
        "eval/answer_accuracy",
        "the same LoRA on the untrained model make train-sft starts from",
        before=True,
        after="train-lora",
    ),
}


# ---------------------------------------------------------------- rendering


def duration(seconds: float) -> str:
    """85.2 -> "1 min 25 s"; 43.0 -> "43 s"."""
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest} s" if minutes else f"{rest} s"


def listing(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def render(name: str, result: dict, log: bool = False) -> str:
    """The text of a `figure:NAME` block (or `figure:NAME:log`) from the figure's recorded `result`."""
    if log:
        return "```\n" + "\n".join(result["log"]) + "\n```\n"
    figure = FIGURES[name]
    steps = sorted(result["values"], key=int)
    values = [f"{result['values'][step]:.3f}" for step in steps]
    before = f"{result['before']:.3f} before the run, then " if figure.before else ""
    sampled = ""
    if figure.sampled:
        (first, start), (last, end) = sorted(result["sampled"].items(), key=lambda kv: int(kv[0]))
        sampled = (
            f"; `{figure.sampled}` (sampled at temperature 1) {start:.3f} at step {first}, {end:.3f} at step {last}"
        )
    for key in figure.tracked:
        (first, start), (last, end) = sorted(result["tracked"][key].items(), key=lambda kv: int(kv[0]))
        sampled += f"; `{key}` {start:.3f} at step {first}, {end:.3f} at step {last}"
    if figure.quote:
        sampled += f"; `{figure.quote}`: " + ", ".join(f"{k} {v:.3f}" for k, v in result["quoted"].items())
    files = "`before.json` and `metrics.jsonl` in " if figure.before else "`metrics.jsonl` in "
    text = (
        f"One run (`{figure.command}`: {figure.about}; at {result['commit'][:7]}, {result['date']}, on "
        f"{result['machine']}; its {files}`{figure.output_dir}`): `{figure.metric}` {before}"
        f"{listing(values)} at steps {listing(steps)}{sampled}, in {duration(result['seconds'])} for the command "
        f"(1-minute load {result['load_1min'][0]:.1f} before, {result['load_1min'][1]:.1f} after), not counting "
        "`make install`, which a fresh clone's first make target runs first."
    )
    return textwrap.fill(text, width=120, break_on_hyphens=False, break_long_words=False) + "\n"


# ---------------------------------------------------------------- checking


def pages(repo: Path) -> dict[str, str]:
    """README.md and docs/*.md by their path in the repository."""
    files = [repo / "README.md", *sorted((repo / "docs").glob("*.md"))]
    return {str(path.relative_to(repo)): path.read_text() for path in files}


def is_ancestor(commit: str, repo: Path) -> bool:
    """Whether `commit` is HEAD or an ancestor of it."""
    done = subprocess.run(["git", "merge-base", "--is-ancestor", commit, "HEAD"], cwd=repo, capture_output=True)
    return done.returncode == 0


def minor_version(setup_cfg: str) -> str:
    """The major.minor of setup.cfg's `version` ("0.1" for 0.1.0)."""
    return re.search(r"^version\s*=\s*(\d+\.\d+)", setup_cfg, re.M).group(1)


def problems(texts: dict[str, str], results: dict[str, dict], repo: Path, version: str | None = None) -> list[str]:
    """Each way the pages and the recorded runs drift apart: a block that is not what its run renders, a block of no
    recorded figure, a recorded figure no page quotes, a figure whose commit is not an ancestor of HEAD or whose
    commit's minor version (setup.cfg) is not the checkout's (`version`, default read from `repo`)."""
    version = version or minor_version((repo / "setup.cfg").read_text())
    found, quoted = [], set()
    for page, text in texts.items():
        for match in BLOCK.finditer(text):
            name, log, body = match.group(1), bool(match.group(2)), match.group(3)
            quoted.add(name)
            if name not in results or name not in FIGURES:
                found.append(f"{page}: figure:{name} is no recorded figure ({RESULTS} has {sorted(results)})")
            elif body != render(name, results[name], log):
                found.append(f"{page}: figure:{name}{':log' if log else ''} differs from its run in {RESULTS}")
    for name, result in results.items():
        if name not in quoted:
            found.append(f"{RESULTS}: {name} is quoted on no page")
        if not is_ancestor(result["commit"], repo):
            found.append(f"{RESULTS}: {name}'s commit {result['commit'][:12]} is not an ancestor of HEAD")
            continue
        show = ["git", "show", f"{result['commit']}:setup.cfg"]
        ran_at = minor_version(subprocess.run(show, cwd=repo, capture_output=True, text=True, check=True).stdout)
        if ran_at != version:
            found.append(f"{RESULTS}: {name} ran at version {ran_at}, the checkout is {version}: run make figures")
    return found


def check(repo: Path = REPO) -> list[str]:
    """`problems` of the checkout `repo`."""
    return problems(pages(repo), json.loads((repo / RESULTS).read_text()), repo)


# ---------------------------------------------------------------- running


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()


def run_logged(command: str, log_file: Path) -> tuple[int, float, str]:
    """Run `command` in the repository, its output shown and kept in `log_file`: (exit code, seconds, output)."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    proc = subprocess.Popen(shlex.split(command), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    output = []
    with log_file.open("w") as log:
        for line in proc.stdout:
            sys.stdout.write(line)
            log.write(line)
            output.append(line)
    code = proc.wait()
    return code, time.monotonic() - start, "".join(output)


def draw_curves(events: list[dict], path: Path, panels: tuple[Panel, ...]) -> None:
    """`panels` of the run's metrics.jsonl `events` against step, stacked, drawn to `path` as the trainer draws."""
    from veomni_lite.metrics.sinks import LossCurveSink

    series: dict[str, list[dict]] = {}
    for event in events:
        for key, value in event.items():
            if key not in ("step", "epoch"):
                series.setdefault(key, []).append({"step": event["step"], "epoch": event.get("epoch"), "value": value})
    LossCurveSink(path, series, panels=panels).redraw()


def machine() -> str:
    """The machine a run's numbers hold on: its cores, its CPU's name and the float32 kernels torch picks for it
    (AVX512, AVX2, ...: their sums round differently, so a demo's figures reproduce on the same kind of CPU only)."""
    import torch

    cpuinfo = Path("/proc/cpuinfo")  # Linux; elsewhere platform's name
    names = re.findall(r"^model name\s*:\s*(.+)$", cpuinfo.read_text(), re.M) if cpuinfo.is_file() else []
    name = names[0].strip() if names else platform.processor() or platform.machine()
    return f"{os.cpu_count()} CPU cores ({name}, torch's {torch.backends.cpu.get_cpu_capability()} kernels)"


def run_figure(name: str, commit: str) -> dict:
    """Run one figure's job from a clean output directory; its recorded result."""
    figure = FIGURES[name]
    for path in (figure.output_dir, *figure.clean):
        shutil.rmtree(REPO / path, ignore_errors=True)
    load = os.getloadavg()[0]  # the machine is shared: a time read with the load around it
    code, seconds, output = run_logged(figure.command, REPO / "outputs" / "figures" / f"{name}.log")
    if code:
        raise SystemExit(f"figures: `{figure.command}` failed (exit code {code}); see outputs/figures/{name}.log")
    out = REPO / figure.output_dir
    events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    values = {str(e["step"]): e[figure.metric] for e in events if figure.metric in e}
    last = [m.group(0).rstrip() for m in STEP_LINE.finditer(output)][-2:]  # the last step's train and eval lines
    for source, copy in figure.images.items():
        shutil.copyfile(out / source, REPO / copy)
    for copy, panels in figure.curves.items():
        draw_curves(events, REPO / copy, panels)
    result = {
        "command": figure.command,
        "commit": commit,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "machine": machine(),
        "seconds": round(seconds, 1),
        "load_1min": [round(load, 2), round(os.getloadavg()[0], 2)],  # before and after the command
        "values": values,
        "log": last,
    }
    if figure.before:
        result["before"] = json.loads((out / "before.json").read_text())[figure.metric]
    if figure.quote:
        result["quoted"] = json.loads((out / figure.quote).read_text())
    if figure.sampled:
        logged = [(str(e["step"]), e[figure.sampled]) for e in events if figure.sampled in e]
        result["sampled"] = dict([logged[0], logged[-1]])
    for key in figure.tracked:
        logged = [(str(e["step"]), e[key]) for e in events if key in e]
        result.setdefault("tracked", {})[key] = dict([logged[0], logged[-1]])
    return result


def rewrite(results: dict[str, dict]) -> list[str]:
    """Rewrite every figure block of the pages from `results`; the pages changed."""
    changed = []
    for page, text in pages(REPO).items():
        new = BLOCK.sub(
            lambda m: (
                f"<!-- figure:{m.group(1)}{m.group(2) or ''} -->\n"
                + (render(m.group(1), results[m.group(1)], bool(m.group(2))) if m.group(1) in results else m.group(3))
                + "<!-- /figure -->"
            ),
            text,
        )
        if new != text:
            (REPO / page).write_text(new)
            changed.append(page)
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help=f"figures to run (default: all of {sorted(FIGURES)})")
    parser.add_argument("--check", action="store_true", help="only check the pages against the recorded runs")
    parser.add_argument("--render", action="store_true", help="only rewrite the pages from the recorded runs")
    args = parser.parse_args(argv)
    if args.render:
        print(f"[figures] rewrote {rewrite(json.loads((REPO / RESULTS).read_text())) or 'no page'}")
        return 0
    if args.check:
        found = check()
        print("\n".join(found) or f"figures: every block matches {RESULTS}, run at an ancestor of HEAD of this version")
        return 1 if found else 0
    unknown = sorted(set(args.names) - set(FIGURES))
    if unknown:
        parser.error(f"unknown figure(s) {unknown}; figures are {sorted(FIGURES)}")
    if git("status", "--porcelain", "--untracked-files=no"):
        raise SystemExit("figures: commit first: a figure names the commit it ran at, so no tracked file may differ")
    commit = git("rev-parse", "HEAD")
    code, seconds, _ = run_logged("make install", REPO / "outputs" / "figures" / "install.log")
    if code:
        raise SystemExit("figures: make install failed; see outputs/figures/install.log")
    print(f"[figures] make install: {duration(seconds)} (not counted in any figure)")
    path = REPO / RESULTS
    results = json.loads(path.read_text()) if path.is_file() else {}
    wanted = set(args.names or FIGURES)
    for name in reversed(FIGURES):  # what a job uses comes first in FIGURES: run it too, unless recorded at HEAD
        after = FIGURES[name].after
        if name in wanted and after and results.get(after, {}).get("commit") != commit:
            wanted.add(after)
    for name in [name for name in FIGURES if name in wanted]:
        results[name] = run_figure(name, commit)
        path.write_text(json.dumps(results, indent=1) + "\n")
        print(f"[figures] {name}: {results[name]['values']} in {duration(results[name]['seconds'])}")
    print(f"[figures] rewrote {rewrite(results) or 'no page'}; {RESULTS} holds the runs: commit them")
    return 0


if __name__ == "__main__":
    sys.exit(main())
