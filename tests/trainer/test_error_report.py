"""How a run that stops says why (veomni_lite/torchrun.py): each rank's error file, written by `record_error`, and the
report `python -m veomni_lite.torchrun` prints from torchrun's `ChildFailedError`, the cause last. No process starts
here (tests/e2e/test_entry_points.py runs them)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from veomni_lite.torchrun import POINTER_DELAY_S, SAME_AS_LOCAL_RANK_0, failure_report, record_error

CAUSE = "data error: data.jsonl, row 5 (0-based): malformed JSON, column 41 (the end of the line): Expecting ','"


def recorded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rank: int, text: str, agreed: bool = True) -> str:
    """The error file `record_error` writes on local rank `rank` under torchrun."""
    path = tmp_path / f"error{rank}.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("LOCAL_RANK", str(rank))
    record_error(text, agreed=agreed)
    return str(path)


def failure(rank: int, exitcode: int, error_file: str = "<N/A>") -> ProcessFailure:
    return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file=error_file)


def test_an_agreed_error_is_shown_by_local_rank_0_and_named_by_the_others(tmp_path, monkeypatch, capsys):
    first, second = (recorded(tmp_path, monkeypatch, rank, CAUSE) for rank in (0, 1))
    assert capsys.readouterr().err == "", "under torchrun nothing is printed: the report prints it"
    files = [json.loads(Path(path).read_text()) for path in (first, second)]
    assert [data["message"]["message"] for data in files] == [CAUSE, SAME_AS_LOCAL_RANK_0]
    assert all(data["cause"] == CAUSE for data in files)
    error = ChildFailedError("trainers/train_sft.py", {0: failure(0, 2, first), 1: failure(1, 2, second)})
    assert error.get_first_failure()[0] == 0, "torchrun's own report takes local rank 0's as the root cause"
    assert str(error).count(CAUSE) == 1, "torchrun's own report shows the cause once"
    report, exitcode = failure_report(error)
    assert report.splitlines()[-1] == CAUSE and report.count(CAUSE) == 1
    assert report.splitlines()[0] == (
        "[veomni_lite] trainers/train_sft.py failed (rank 0: exit code 2, rank 1: exit code 2). The cause, from rank 0:"
    )
    assert exitcode == 2


def test_local_rank_0_is_torchruns_root_cause_though_it_recorded_half_a_minute_after_the_others(tmp_path, monkeypatch):
    """On a loaded machine rank 0 may reach an agreed error well after rank 1: its record still comes first."""
    second = recorded(tmp_path, monkeypatch, 1, CAUSE)
    clock = time.time()
    monkeypatch.setattr(time, "time", lambda: clock + 30)
    first = recorded(tmp_path, monkeypatch, 0, CAUSE)
    error = ChildFailedError("train.py", {0: failure(0, 2, first), 1: failure(1, 2, second)})
    assert error.get_first_failure()[0] == 0 and str(error).count(CAUSE) == 1
    monkeypatch.setattr(time, "time", lambda: clock + POINTER_DELAY_S + 2)  # negative control: past the delay
    late = recorded(tmp_path, monkeypatch, 0, CAUSE)
    assert ChildFailedError("train.py", {0: failure(0, 2, late), 1: failure(1, 2, second)}).get_first_failure()[0] == 1


def test_a_rank_stopped_before_it_recorded_leaves_the_cause_to_the_others(tmp_path, monkeypatch):
    """torchrun stops the other ranks when one exits: rank 0 may be stopped before it wrote its file."""
    second = recorded(tmp_path, monkeypatch, 1, CAUSE)
    error = ChildFailedError("train.py", {1: failure(1, 2, second), 0: failure(0, -15)})
    report, exitcode = failure_report(error)
    assert report.splitlines()[-1] == CAUSE
    assert "rank 0: signal SIGTERM, rank 1: exit code 2" in report.splitlines()[0]
    assert exitcode == 2


def test_any_other_error_keeps_its_whole_traceback_on_the_rank_that_raised_it(tmp_path, monkeypatch):
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        import traceback

        text = traceback.format_exc().rstrip()
    path = recorded(tmp_path, monkeypatch, 1, text, agreed=False)  # not agreed: even local rank 1 shows it
    assert json.loads(Path(path).read_text())["message"]["message"] == text
    report, exitcode = failure_report(ChildFailedError("train.py", {1: failure(1, 1, path), 0: failure(0, -15)}))
    assert report.endswith(text) and text.startswith("Traceback") and text.endswith("RuntimeError: boom")
    assert exitcode == 1


def test_a_rank_killed_without_a_file_is_named_by_its_signal(tmp_path):
    report, exitcode = failure_report(ChildFailedError("train.py", {0: failure(0, -9)}))
    assert report.splitlines()[-1].startswith("Signal 9 (SIGKILL) received by PID 1000")
    assert exitcode == 128 + 9


def test_torchruns_own_record_format_shows_its_traceback(tmp_path):
    """A script decorated with torchrun's `record` (no `cause` key) is reported by its traceback."""
    path = tmp_path / "error.json"
    message = {
        "message": "ValueError: x",
        "extraInfo": {"py_callstack": "Traceback ...\nValueError: x", "timestamp": "1"},
    }
    path.write_text(json.dumps({"message": message}))
    report, _ = failure_report(ChildFailedError("train.py", {0: failure(0, 1, str(path))}))
    assert report.splitlines()[-2:] == ["Traceback ...", "ValueError: x"]


@pytest.mark.parametrize(("rank", "agreed", "printed"), [(0, True, True), (1, True, False), (1, False, True)])
def test_without_torchrun_an_agreed_error_is_printed_by_rank_0_only(monkeypatch, capsys, rank, agreed, printed):
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    monkeypatch.setenv("RANK", str(rank))
    record_error(CAUSE, agreed=agreed)
    assert capsys.readouterr().err == (CAUSE + "\n" if printed else "")


def test_an_agreed_error_is_shown_from_rank_0_even_when_rank_1_recorded_it_first(tmp_path, monkeypatch):
    """Ranks reach an agreed error unsynchronized (a config error comes before any process group): rank 1 may record
    it over a minute before rank 0, whose pointer-dating then no longer makes torchrun's clock pick rank 0."""
    import veomni_lite.torchrun as launcher

    second = recorded(tmp_path, monkeypatch, 1, CAUSE)
    later = launcher.time.time() + POINTER_DELAY_S + 5  # past what the pointer's dating covers
    monkeypatch.setattr(launcher.time, "time", lambda: later)
    first = recorded(tmp_path, monkeypatch, 0, CAUSE)
    error = ChildFailedError("train.py", {1: failure(1, 2, second), 0: failure(0, 2, first)})
    assert error.get_first_failure()[0] == 1, "by the clock, rank 1's came first"
    report, exitcode = failure_report(error)
    assert report.splitlines()[0].endswith("The cause, from rank 0:") and report.splitlines()[-1] == CAUSE
    assert exitcode == 2
    # negative control: a rank's own (not agreed) error that came first stays the cause, from that rank
    own = recorded(tmp_path, monkeypatch, 1, "Traceback ...\nRuntimeError: boom", agreed=False)
    monkeypatch.setattr(launcher.time, "time", lambda: later + 5)
    first = recorded(tmp_path, monkeypatch, 0, CAUSE)
    report, exitcode = failure_report(ChildFailedError("train.py", {1: failure(1, 1, own), 0: failure(0, 2, first)}))
    assert report.splitlines()[0].endswith("The cause, from rank 1:") and report.endswith("RuntimeError: boom")
    assert exitcode == 1
