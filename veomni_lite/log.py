"""The project's one logger: modules log through `logging.getLogger(__name__)` under the `veomni_lite` logger.

`setup_logging(rank)` (called once per process by the CLI entry) sends those records to stderr as
`[veomni_lite rank R] LEVEL message`, through `tqdm.write` so a progress bar stays intact. Rank 0 shows INFO and above;
the other ranks WARNING and above, since every rank runs the same code and would repeat the same INFO lines; where
stderr is no terminal, transformers' progress bars are off (see `metrics.logger.progress_bar_shown`). Messages
that every rank reaches alike are logged by rank 0 only (the caller checks). Without `setup_logging` (a library user,
tests), Python's defaults apply: WARNING and above reach stderr.
"""

from __future__ import annotations

import logging
import sys

ROOT_LOGGER = "veomni_lite"


class _TqdmHandler(logging.Handler):
    """Writes records to stderr without breaking a tqdm progress bar."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm import tqdm

            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # noqa: BLE001 - logging must never raise
            self.handleError(record)


def setup_logging(rank: int, level: int = logging.INFO) -> logging.Logger:
    """Route the `veomni_lite` logger to stderr with the rank in every line (idempotent per process)."""
    logger = logging.getLogger(ROOT_LOGGER)
    for handler in [h for h in logger.handlers if isinstance(h, _TqdmHandler)]:
        logger.removeHandler(handler)
    handler = _TqdmHandler()
    handler.setFormatter(logging.Formatter(f"[veomni_lite rank {rank}] %(levelname)s %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(level if rank == 0 else max(level, logging.WARNING))
    logger.propagate = False
    if not sys.stderr.isatty():  # a log file or pipe: transformers' bars (loading, saving) would write '\r' lines
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()
    return logger
