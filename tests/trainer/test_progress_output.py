"""Progress output where stderr is no terminal (a log file, a pipe): no tqdm bar and its carriage returns, the
console's one line per `log_interval`, and transformers' bars off; on a terminal, the bars."""

from __future__ import annotations

import io
import logging
import sys

from transformers.utils import logging as transformers_logging

from tests.models.small_hf import train_small
from veomni_lite.config import LoggingConfig
from veomni_lite.log import ROOT_LOGGER, setup_logging
from veomni_lite.metrics.logger import progress_bar_shown


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_run_logged_to_a_file_writes_plain_lines_and_a_terminal_gets_the_bar(tmp_path, capsys, monkeypatch):
    trainer = train_small("text", tmp_path, "--logging.progress_bar", "true", "--logging.log_interval", "1")
    out, err = capsys.readouterr()
    assert not sys.stderr.isatty() and "\r" not in out + err
    assert [line.split(" |")[0] for line in out.splitlines() if line.startswith("step ")] == ["step 1/2", "step 2/2"]
    assert trainer._progress_bar() is None
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)  # the control: the same settings on a terminal draw the bar
    bar = trainer._progress_bar()
    bar.update(1)
    bar.close()
    assert "\r" in terminal.getvalue() and "train" in terminal.getvalue()
    assert progress_bar_shown(LoggingConfig()) and not progress_bar_shown(LoggingConfig(progress_bar=False))


def test_setup_logging_turns_transformers_bars_off_where_stderr_is_no_terminal(monkeypatch):
    logger = logging.getLogger(ROOT_LOGGER)
    saved = logger.handlers[:], logger.level, logger.propagate
    try:
        transformers_logging.enable_progress_bar()  # an earlier test of the session may have turned them off
        monkeypatch.setattr(sys, "stderr", Terminal())  # the control: a terminal keeps them
        setup_logging(0)
        assert transformers_logging.is_progress_bar_enabled()
        monkeypatch.setattr(sys, "stderr", io.StringIO())
        setup_logging(0)
        assert not transformers_logging.is_progress_bar_enabled()
    finally:
        transformers_logging.enable_progress_bar()
        logger.handlers[:], logger.propagate = saved[0], saved[2]
        logger.setLevel(saved[1])
