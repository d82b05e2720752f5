"""The SFT path end to end on what `make train-sft` writes: the real entry point on 2 processes, the digits from their
on-disk form, a fault on one rank, the inspect CLI, export and back, and the pieces the trainer gained with it."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.dist_helpers import run_distributed, run_ranks
from tests.trainer.helpers import read_events, train_outcome
from veomni_lite.config import ConfigError, load_config
from veomni_lite.data import inspect
from veomni_lite.data.checks import DataError
from veomni_lite.data.loader import MicroBatchLoader
from veomni_lite.models.sharded_load import loadable
from veomni_lite.trainer.base import parameter_groups
from veomni_lite.trainer.sft import SFT_DEFAULTS, SFTTrainer

REPO = Path(__file__).resolve().parents[2]
# 2 ranks vs 1 process on the same global batches: the same math, summed in another order (float32; the
# run of 2026-12-02 agreed to 1.2e-8 relative at every logged step)
RTOL_TWO_RANKS = 1e-5


def sft_args(demo: Path, out: Path, model: str, train: str, *extra: str) -> list[str]:
    return [
        "--model.pretrained_dir", str(demo / "models" / model),
        "--data.train_path", str(demo / train),
        "--train.output_dir", str(out),
        "--logging.progress_bar", "false",
        "--logging.tensorboard", "false",
        "--logging.plot", "false",
        *extra,
    ]  # fmt: skip


def digits_args(demo: Path, out: Path, *extra: str) -> list[str]:
    eval_path = ["--data.eval_path", str(demo / "digits/eval.jsonl")]
    return sft_args(demo, out, "qwen2_vl_digits", "digits/train.jsonl", *eval_path, *extra)


def help_args(demo: Path, out: Path, *extra: str) -> list[str]:
    return sft_args(demo, out, "qwen2_help", "help/train.jsonl", *extra)


def train(config_file: str, args: list[str], world_size: int = 1) -> SFTTrainer:
    trainer = SFTTrainer(load_config(REPO / "configs" / config_file, args, world_size=world_size))
    try:
        trainer.train()
    finally:
        trainer.metrics.close()
    return trainer


@pytest.mark.slow
def test_two_processes_fine_tune_a_user_jsonl_through_the_entry_point_as_one_process_does(demo, tmp_path):
    out = tmp_path / "help"
    extra = ["--train.max_steps", "30", "--logging.log_interval", "5", "--train.eval_interval", "30"]
    args = help_args(demo, out, *extra)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    done = subprocess.run(
        [*command, "trainers/train_sft.py", "configs/sft_help.yaml", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    losses = {e["step"]: e["train/loss"] for e in read_events(out) if "train/loss" in e}
    # the reference: one process trains the same global batches (the layout never changes them)
    train("sft_help.yaml", help_args(demo, tmp_path / "one", *extra))
    reference = {e["step"]: e["train/loss"] for e in read_events(tmp_path / "one") if "train/loss" in e}
    print(f"\nhelp pages SFT, train/loss: 2 processes {losses}, 1 process {reference}")
    assert sorted(losses) == sorted(reference) == [5, 10, 15, 20, 25, 30]
    for step, loss in losses.items():
        assert loss == pytest.approx(reference[step], rel=RTOL_TWO_RANKS), step
    assert losses[30] < 0.9 * losses[5]  # and it learns: from ln(2048) = 7.6 at random init
    assert "SFT data: train" in done.stderr and "0 dropped" in done.stderr, "what overlength did is logged"


@pytest.mark.slow
def test_the_digits_from_their_on_disk_form_reach_the_built_in_jobs_caption_accuracy(demo, tmp_path):
    """The digits from their files on disk learn on one process as `make train-sft` does on two (its figures:
    docs/figures.json): at least 0.8 at step 200."""
    trainer = train("sft_digits.yaml", digits_args(demo, tmp_path / "digits", "--train.max_steps", "200"))
    evals = {
        e["step"]: e["eval/answer_accuracy"] for e in read_events(tmp_path / "digits") if "eval/answer_accuracy" in e
    }
    print(f"\ndigits SFT from disk, 1 process: eval/answer_accuracy {evals}")
    assert evals[200] >= 0.8
    assert trainer.loss_keys == ("foundation_loss",), "a from_pretrained Qwen2-VL trains its LM head only"


def _one_rank_bad_path(rank: int, world_size: int, demo: Path, out: Path) -> str:
    eval_path = demo / "digits/eval.jsonl" if rank == 0 else demo / "digits/missing.jsonl"
    args = digits_args(demo, out, "--data.eval_path", str(eval_path))
    try:
        SFTTrainer(load_config(REPO / "configs/sft_digits.yaml", args, world_size=world_size)).close()
        return "built"
    except DataError as exc:
        return str(exc)


@pytest.mark.slow
def test_a_data_fault_on_one_rank_is_an_error_on_every_rank(demo, tmp_path):
    outcomes = run_ranks(_one_rank_bad_path, 2, demo, tmp_path / "fault", timeout_s=120, pg_timeout_s=30)
    messages = {rank: value for rank, (status, value) in outcomes.items()}
    assert all(status == "ok" for status, _ in outcomes.values()), outcomes
    assert re.match(r"SFT data: rank 1: .*missing.jsonl' does not exist", messages[1]), messages[1]
    assert messages[0] == messages[1], "the same error, naming the rank and the cause, on every rank"


def _accuracy_collate_error_on_rank_one(rank: int, world_size: int, demo: Path, out: Path) -> str:
    """Rank 1's collate fails in the answer-accuracy pass only (after the eval losses read the same rows fine)."""
    extra = ["--train.max_steps", "1", "--train.eval_interval", "1", "--train.eval_batches", "1"]
    args = digits_args(demo, out, *extra, "--parallel.collective_timeout_s", "4")
    trainer = SFTTrainer(load_config(REPO / "configs/sft_digits.yaml", args, world_size=world_size))
    collate, accuracy, scoring = trainer.collate, trainer.extra_eval_metrics, []

    def failing_collate(samples: Any) -> Any:
        if rank == 1 and scoring:
            raise ValueError("eval row 3: an image the processor cannot read")
        return collate(samples)

    def extra_eval_metrics() -> dict[str, float]:
        scoring.append(1)
        return accuracy()

    trainer.collate, trainer.extra_eval_metrics = failing_collate, extra_eval_metrics
    return train_outcome(trainer)


@pytest.mark.slow
def test_a_collate_error_in_the_answer_accuracy_pass_on_one_rank_is_the_same_data_error_on_every_rank(demo, tmp_path):
    """Issue 48: the answer-accuracy pass agrees its micro-batches as the eval losses do (`eval_micro_batches`); with
    a 4 s collective timeout, rank 0 left in a forward would end in a timeout instead (the harness's negative
    control: tests/trainer/test_agreement.py)."""
    outcomes = run_ranks(_accuracy_collate_error_on_rank_one, 2, demo, tmp_path / "o", timeout_s=180, pg_timeout_s=4)
    messages = {rank: value for rank, (status, value) in outcomes.items()}
    assert all(status == "ok" for status, _ in outcomes.values()), outcomes
    expected = "DataError: evaluation at step 1, eval batch 1: rank 1: ValueError: eval row 3: an image the processor"
    assert messages[1].startswith(expected), messages
    assert messages[0] == messages[1], messages


class _RecordingTrainer(SFTTrainer):
    def build_model(self):
        model = super().build_model()
        self.built_on_meta = all(param.is_meta for param in model.parameters())
        return model


def _sharded_against_whole(rank: int, world_size: int, demo: Path, out: Path) -> dict[str, Any]:
    """Per model directory and way of loading (read into the shards; every rank whole; rank 0 whole and scattered, as
    for a directory whose weight names do not map): whether this rank built on the meta device, and the largest
    difference of its sharded weights and buffers from the model every rank loaded whole."""
    from torch.distributed.tensor import DTensor

    from veomni_lite.trainer import base

    results = {}
    for name, config_file, args in (("help", "sft_help.yaml", help_args), ("digits", "sft_digits.yaml", digits_args)):
        states, on_meta = {}, {}
        for sharded in ("true", "false", "scattered"):
            flag = "false" if sharded == "false" else "true"
            config_args = args(demo, out / f"{name}_{sharded}", "--model.load_sharded", flag)
            base.loadable = (lambda model, directory: False) if sharded == "scattered" else loadable
            trainer = _RecordingTrainer(load_config(REPO / "configs" / config_file, config_args, world_size=world_size))
            state = {**trainer.model.state_dict(), **dict(trainer.model.named_buffers())}
            states[sharded] = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in state.items()}
            on_meta[sharded] = trainer.built_on_meta
            trainer.metrics.close()
            trainer.loader.close()
        whole = states.pop("false")
        diffs = {way: max(float((state[k] - whole[k]).abs().max()) for k in whole) for way, state in states.items()}
        assert all(set(state) == set(whole) for state in states.values())
        results[name] = {"on_meta": on_meta, "max_diff": diffs}
    base.loadable = loadable
    return results


@pytest.mark.slow
def test_pretrained_weights_fill_the_shards_exactly_read_per_rank_or_scattered_from_rank_0(demo, tmp_path):
    results = run_distributed(_sharded_against_whole, 2, demo, tmp_path, timeout_s=300)
    for rank, rank_results in enumerate(results):
        for name, result in rank_results.items():
            assert result["on_meta"] == {"true": True, "false": False, "scattered": rank > 0}, (name, result)
            # parameters and the rotary buffers (recomputed, or broadcast from rank 0)
            assert result["max_diff"] == {"true": 0.0, "scattered": 0.0}, (name, result)


def test_an_eval_set_smaller_than_one_eval_batch_is_an_error_at_start(demo, tmp_path):
    rows = (demo / "digits/eval.jsonl").read_text().splitlines()[:5]
    small = tmp_path / "small_eval.jsonl"
    small.write_text("\n".join(rows) + "\n")
    args = digits_args(demo, tmp_path, "--data.eval_path", str(small), "--data.media_dir", str(demo / "digits"))
    config = load_config(REPO / "configs/sft_digits.yaml", args)
    with pytest.raises(DataError, match=r"the eval set has 5 samples, fewer than one eval batch"):
        SFTTrainer(config)


def refusing_template_setup(demo: Path, tmp_path: Path) -> tuple[Path, Path, Path]:
    """(the demo's Qwen2 directory with a Mistral-style template of its own, 8 good rows, the same with a row 9 whose
    roles do not alternate, after a blank line: a JSON Lines file's rows are its lines, the blank one included)."""
    import shutil

    from tests.data.test_chat_families import MISTRAL, TURNS

    model = tmp_path / "mistral_style"
    shutil.copytree(demo / "models/qwen2_help", model)
    (model / "chat_template.jinja").write_text(MISTRAL)
    good, bad = tmp_path / "good.jsonl", tmp_path / "bad.jsonl"
    lines = [json.dumps({"messages": TURNS[:2]})] * 8
    good.write_text("\n".join(lines) + "\n")
    bad.write_text("\n".join([*lines, "", json.dumps({"messages": [TURNS[0], *TURNS[2:4]]})]) + "\n")
    return model, good, bad


REFUSED = "row 9 (0-based): the chat template (the tokenizer's chat template) raised on the first 2 message(s) (roles "
REFUSED += "user, user): TemplateError: Conversation roles must alternate"


def refusing_args(demo: Path, out: Path, model: Path, data: Path) -> list[str]:
    small = ["--train.eval_batches", "0", "--train.micro_batch_size", "4", "--train.global_batch_size", "8"]
    return sft_args(demo, out, str(model), str(data), "--data.format", "messages", *small)


def test_inspect_names_the_file_and_the_row_a_template_refuses(demo, tmp_path, capsys):
    model, good, bad = refusing_template_setup(demo, tmp_path)
    assert inspect.main([str(REPO / "configs/sft_help.yaml"), *refusing_args(demo, tmp_path, model, good)]) == 0
    out = capsys.readouterr().out  # the template writes ' ' + content + eos_token: the lone space does not train
    assert "row 0 (0-based)" in out and "[INST] Hello there [/INST] [[General Kenobi<|im_end|>]]" in out
    assert inspect.main([str(REPO / "configs/sft_help.yaml"), *refusing_args(demo, tmp_path, model, bad)]) == 2
    assert capsys.readouterr().err.startswith(f"error: {bad}, {REFUSED}")


def _one_rank_refused_by_the_template(rank: int, world_size: int, demo: Path, out: Path, model: Path, bad: Path) -> str:
    args = refusing_args(demo, out / "run", model, bad)
    try:
        SFTTrainer(load_config(REPO / "configs/sft_help.yaml", args, world_size=world_size)).close()
        return "built"
    except DataError as exc:
        return str(exc)


@pytest.mark.slow
def test_a_row_the_template_refuses_in_one_ranks_share_is_an_error_on_every_rank(demo, tmp_path):
    """The ranks share the rows of the file: row 9 (the last) is in rank 1's share only, and both raise its error."""
    model, _, bad = refusing_template_setup(demo, tmp_path)
    outcomes = run_ranks(
        _one_rank_refused_by_the_template, 2, demo, tmp_path, model, bad, timeout_s=120, pg_timeout_s=30
    )
    assert all(status == "ok" for status, _ in outcomes.values()), outcomes
    for rank in (0, 1):
        assert outcomes[rank][1].startswith(f"{bad}, {REFUSED}"), outcomes[rank][1]


def test_inspect_prints_the_trained_tokens_and_counts(demo, capsys):
    code = inspect.main(["configs/sft_digits.yaml", "--n", "2", *digits_args(demo, demo / "unused")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "--- sample 0" in out and "--- sample 1" in out and "--- sample 2" not in out
    assert "[[a handwritten" in out and "<image x 4>" in out and "1 image(s)" in out
    assert "1438 samples from 1438 rows, 0 truncated, 0 dropped" in out


def assert_byte_for_byte(source: Path, copy: Path, *, but: tuple[str, ...] = ()) -> set[str]:
    """Every tokenizer / processor file of `source` (but `but`) is in `copy`, the same bytes; returns their names."""
    from veomni_lite.export import TOKENIZER_FILES

    names = {name for name in TOKENIZER_FILES if (source / name).is_file() and name not in but}
    for name in names:
        assert (copy / name).read_bytes() == (source / name).read_bytes(), name
    return names


def same_samples(first: Any, second: Any) -> int:
    """The two datasets hold the same token ids and labels, sample by sample; returns how many."""
    assert len(first) == len(second)
    for index in range(len(first)):
        assert first.where(index) == second.where(index)
        (ids, labels), (their_ids, their_labels) = first.tokens(index), second.tokens(index)
        assert ids.tolist() == their_ids.tolist(), f"{first.where(index)} tokenizes differently"
        assert labels.tolist() == their_labels.tolist(), f"{first.where(index)} trains differently"
    return len(first)


def test_export_of_a_fine_tuned_run_is_a_model_directory_again(demo, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoImageProcessor, AutoTokenizer

    from veomni_lite.export import export

    def whole(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor

    run = tmp_path / "run"
    trained = train("sft_digits.yaml", digits_args(demo, run, "--train.max_steps", "2", "--train.eval_interval", "0"))
    export(run, tmp_path / "export")
    source = demo / "models/qwen2_vl_digits"
    copied = assert_byte_for_byte(source, tmp_path / "export")
    assert {"tokenizer.json", "chat_template.jinja", "preprocessor_config.json", "generation_config.json"} <= copied
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "export"))
    assert tokenizer.chat_template == trained.tokenizer.chat_template
    assert AutoImageProcessor.from_pretrained(str(tmp_path / "export")).merge_size == 2
    again = SFTTrainer(
        load_config(
            REPO / "configs/sft_digits.yaml",
            digits_args(demo, tmp_path / "again", "--model.pretrained_dir", str(tmp_path / "export")),
        )
    )
    try:
        assert same_samples(trained.train_dataset, again.train_dataset) == 1438
        mine, theirs = trained.model.state_dict(), again.model.state_dict()
        assert sorted(mine) == sorted(theirs), "the export read back holds every trained weight, and nothing else"
        for key, value in mine.items():
            assert torch.equal(whole(value), whole(theirs[key])), key
        # control: the 2 steps changed the weights, so the source directory's weights differ from the export's
        source_weights, exported = (
            load_file(source / "model.safetensors"),
            load_file(tmp_path / "export/model.safetensors"),
        )
        assert sorted(source_weights) == sorted(exported)
        assert any(not torch.equal(source_weights[key], exported[key]) for key in exported)
    finally:
        again.close()


def test_export_keeps_the_runs_tokenizer_and_its_chat_template_so_a_run_from_it_tokenizes_alike(demo, tmp_path):
    """160 help conversations fine-tuned with `data.chat_template: chatml`, exported, and read again from the export
    (no override): the same token ids and labels, row by row; the tokenizer files are the source's bytes, the template
    the run's. Control: the export as it was (the tokenizer re-saved through AutoTokenizer, i.e. Qwen2Tokenizer)
    tokenizes them differently."""
    import shutil

    from transformers import AutoTokenizer

    from veomni_lite.data.sft import CHATML
    from veomni_lite.export import export
    from veomni_lite.trainer.sft import build_sft_data

    rows = tmp_path / "help160.jsonl"
    rows.write_text("\n".join((demo / "help/train.jsonl").read_text().splitlines()[:160]) + "\n")
    small = ["--train.eval_batches", "0", "--train.micro_batch_size", "4", "--train.global_batch_size", "8"]
    run_args = [*small, "--data.chat_template", "chatml", "--train.max_steps", "2", "--train.eval_interval", "0"]
    trained = train("sft_help.yaml", sft_args(demo, tmp_path / "run", "qwen2_help", str(rows), *run_args))
    export(tmp_path / "run", tmp_path / "export")
    assert assert_byte_for_byte(demo / "models/qwen2_help", tmp_path / "export", but=("chat_template.jinja",)) >= {
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    }
    assert (tmp_path / "export/chat_template.jinja").read_text() == CHATML  # the run's data.chat_template

    def samples_from(directory: Path) -> Any:
        config_args = [*sft_args(demo, tmp_path / "again", "qwen2_help", str(rows), *small)]
        config = load_config(REPO / "configs/sft_help.yaml", [*config_args, "--model.pretrained_dir", str(directory)])
        return build_sft_data(config)[2]

    assert same_samples(trained.train_dataset, samples_from(tmp_path / "export")) == 160
    resaved = tmp_path / "resaved"  # what export.py wrote before: AutoTokenizer's class for the model type, re-saved
    shutil.copytree(tmp_path / "export", resaved)
    AutoTokenizer.from_pretrained(str(tmp_path / "run/model_config")).save_pretrained(str(resaved))
    control = samples_from(resaved)
    first = trained.train_dataset
    differ = sum(first.tokens(i)[0].tolist() != control.tokens(i)[0].tolist() for i in range(len(control)))
    print(f"\nre-saved through AutoTokenizer: {differ} of 160 conversations tokenize differently; copied: 0")
    assert differ > 0


# ---------------------------------------------------------------- what the trainer gained with it


def test_prefetching_yields_the_same_batches_and_resumes_exactly():
    data = [{"input_ids": torch.tensor([i])} for i in range(40)]
    collate = lambda samples: {"input_ids": torch.cat([s["input_ids"] for s in samples])}  # noqa: E731
    plain = MicroBatchLoader(data, collate, 8, 2, seed=3)
    ahead = MicroBatchLoader(data, collate, 8, 2, seed=3, prefetch_steps=2)
    for _ in range(7):  # past an epoch boundary
        assert [b["input_ids"].tolist() for b in plain.next_step()] == [
            b["input_ids"].tolist() for b in ahead.next_step()
        ]
    state = ahead.state_dict()
    resumed = MicroBatchLoader(data, collate, 8, 2, seed=3, prefetch_steps=1)
    resumed.next_step()  # fetched ahead for a step the checkpoint does not continue from
    resumed.load_state_dict(state)
    assert [b["input_ids"].tolist() for b in resumed.next_step()] == [
        b["input_ids"].tolist() for b in plain.next_step()
    ]
    for loader in (ahead, resumed):
        loader.close()


def test_weight_decay_only_on_matrices_unless_asked():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    decay, keep = parameter_groups(model, 0.1)
    assert [tuple(p.shape) for p in decay["params"]] == [(4, 4)] and decay["weight_decay"] == 0.1
    assert sorted(tuple(p.shape) for p in keep["params"]) == [(4,), (4,), (4,), (10, 4)] and keep["weight_decay"] == 0
    decay, keep = parameter_groups(model, 0.1, "all")
    assert len(decay["params"]) == 5 and not keep["params"]


def test_config_paths_archs_and_model_directory_heads(demo, tmp_path):
    model = ["--model.pretrained_dir", str(demo / "models/qwen2_vl_digits")]
    config = load_config(REPO / "configs/sft_digits.yaml", [*model, "--data.train_path", "a.jsonl"], world_size=1)
    assert config.data.train_path == ["a.jsonl"]
    config = load_config(
        REPO / "configs/sft_digits.yaml", [*model, "--data.train_path", "[a.jsonl, 'b/*.parquet']"], world_size=1
    )
    assert config.data.train_path == ["a.jsonl", "b/*.parquet"]
    assert load_config(REPO / "configs/qwen2_text.yaml", ["--model.arch", "llama"], world_size=1).model.arch == "llama"
    with pytest.raises(ConfigError, match="model.arch: 'qwen9' is neither"):
        load_config(REPO / "configs/qwen2_text.yaml", ["--model.arch", "qwen9"], world_size=1)
    heads = str(demo / "models/qwen2_vl_digits/config.json") + ".text_config.num_key_value_heads"
    with pytest.raises(ConfigError, match=rf"parallel.sp_size \(4\) does not divide {heads}|num_attention_heads"):
        load_config(
            REPO / "configs/sft_digits.yaml", [*digits_args(demo, tmp_path), "--parallel.sp_size", "4"], world_size=4
        )
    settings = json.loads((demo / "models/qwen2_vl_digits/config.json").read_text())
    assert settings["text_config"]["num_key_value_heads"] == 2


# ---------------------------------------------------------------- held-out rows and the SFT defaults


@pytest.mark.parametrize(
    ("settings", "evaluates"),
    [
        (["--train.eval_interval", "0"], False),
        (["--train.eval_interval", "100", "--train.eval_batches", "0"], False),
        (["--train.eval_interval", "100", "--train.eval_batches", "1"], True),
    ],
)
def test_only_a_run_that_evaluates_holds_rows_out_and_the_log_counts_them(demo, tmp_path, caplog, settings, evaluates):
    """configs/sft_help.yaml has no eval_path and data.eval_fraction 0.05: 5% of the samples are held out for eval,
    and none when evaluation is off (train.eval_interval or train.eval_batches 0)."""
    config = load_config(REPO / "configs/sft_help.yaml", help_args(demo, tmp_path, *settings), world_size=1)
    with caplog.at_level(logging.INFO, logger="veomni_lite"):
        trainer = SFTTrainer(config)
    try:
        stats = trainer.train_dataset.dataset.stats if evaluates else trainer.train_dataset.stats
        samples = stats.rows - stats.dropped
        held_out = int(samples * 0.05) if evaluates else 0
        assert samples == len((demo / "help/train.jsonl").read_text().splitlines())
        assert len(trainer.train_dataset) == samples - held_out
        if evaluates:
            train_rows, eval_rows = set(trainer.train_dataset.indices), set(trainer.eval_dataset.indices)
            assert len(eval_rows) == held_out and not train_rows & eval_rows
            assert len(train_rows | eval_rows) == samples
        else:
            assert trainer.eval_dataset is None
        off = "evaluation off: train.eval_interval or train.eval_batches is 0"
        why = "data.eval_fraction 0.05" if evaluates else off
        line = f"SFT data: train {stats}; {samples - held_out} samples train, {held_out} held out ({why})"
        assert line in caplog.text
    finally:
        trainer.close()


def test_the_sft_defaults_train_three_epochs_with_a_three_percent_warmup(demo, tmp_path, caplog):
    """A YAML that names only the model and the data trains as `SFT_DEFAULTS` say: 3 epochs of the rows at lr 1e-5,
    the warmup ceil(0.03 x steps), cosine decay to 0, nothing held out (no evaluation asked for)."""
    path = tmp_path / "mine.yaml"
    path.write_text("model:\n  arch: auto\ndata:\n  format: sharegpt\n")
    config = load_config(path, help_args(demo, tmp_path), world_size=1, defaults=SFT_DEFAULTS)
    with caplog.at_level(logging.INFO, logger="veomni_lite"):
        trainer = SFTTrainer(config)
    try:
        samples = len((demo / "help/train.jsonl").read_text().splitlines())
        per_epoch = samples // 16  # the default global batch
        steps, warmup = 3 * per_epoch, math.ceil(0.03 * 3 * per_epoch)
        assert (trainer.max_steps, len(trainer.train_dataset), trainer.eval_dataset) == (steps, samples, None)
        factor = trainer.scheduler.lr_lambdas[0]
        assert trainer.scheduler.get_last_lr()[0] == pytest.approx(1e-5 / warmup)
        assert factor(warmup - 1) == 1.0 and factor(steps) == 0.0
        assert trainer.optimizer.param_groups[0]["weight_decay"] == 0.0
        assert (
            f"run: {steps} optimizer steps = train.epochs 3 of {per_epoch} steps ({samples} training samples // "
            f"train.global_batch_size 16; {samples - 16 * per_epoch} left out of each epoch); lr 1e-05, cosine "
            f"schedule, {warmup} warmup steps" in caplog.text
        )
    finally:
        trainer.close()
