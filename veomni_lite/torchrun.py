"""`python -m veomni_lite.torchrun [torchrun options] SCRIPT [ARGS ...]`: torchrun, ending a failed run with its cause.

torchrun ends a failed run with its `ChildFailedError` traceback and a report of every failed rank (about 40 lines).
This runs torchrun's own `main` in this process and, when a rank fails, prints instead one line naming each failed
rank's exit code and then the cause whole, as the last lines: what the first failed rank recorded (`record_error`), else
its signal. It exits with the cause's exit code (2: bad config or data; 128 + N: stopped by signal N; 1: anything else),
where torchrun exits 1. Every option of torchrun works (`--standalone`, `--nproc_per_node`, `--nnodes`, ...);
`OMP_NUM_THREADS` defaults to 1, as under torchrun with several processes, without torchrun's notice saying so, and the
agent's own one-line "failed" log is left out (the report says it).

`record_error(text, agreed)` is the rank's side (`veomni_lite.trainer.launch.main`). Under torchrun it writes `text` to
the rank's error file (`TORCHELASTIC_ERROR_FILE`, set by torchrun for each rank), which both this report and torchrun's
own read, and prints nothing. An agreed error (one every rank raises alike) is shown once: local rank 0's file holds it,
the others' say they stopped on the same error (keeping it under `cause`, for this report) and are dated
`POINTER_DELAY_S` (60 s) later, so torchrun's report picks local rank 0's as the root cause (when the ranks reached it
within a minute of each other; a second was too little on a loaded 2-core machine). The file also says whether the error
was agreed, so that this report shows the lowest rank's (rank 0's when it recorded one) whatever the clock says. Without
torchrun, `text` goes to stderr (an agreed error from rank 0 only).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

ERROR_FILE = "TORCHELASTIC_ERROR_FILE"
SAME_AS_LOCAL_RANK_0 = "stopped on the same error as local rank 0 (every rank raised it alike)"
POINTER_DELAY_S = 60


def recording() -> bool:
    """Whether this process runs under torchrun, which collects each rank's error file."""
    return bool(os.environ.get(ERROR_FILE))


def record_error(text: str, agreed: bool) -> None:
    """Say why this rank stops, once per run (see the module docstring); `agreed`: every rank raises it alike."""
    path = os.environ.get(ERROR_FILE)
    if not path:
        if not agreed or int(os.environ.get("RANK", "0")) == 0:
            print(text, file=sys.stderr, flush=True)
        return
    pointer = agreed and int(os.environ.get("LOCAL_RANK", "0")) > 0
    shown = SAME_AS_LOCAL_RANK_0 if pointer else text
    # torchrun's own format, which its report shows; a pointer is dated later, so that the report's root cause (its
    # earliest failure) is local rank 0's whichever rank exited first
    extra = {"py_callstack": shown, "timestamp": str(int(time.time()) + POINTER_DELAY_S * pointer)}
    record = {"message": {"message": shown, "extraInfo": extra}, "cause": text, "agreed": agreed}
    Path(path).write_text(json.dumps(record))


def failure_report(error: ChildFailedError) -> tuple[str, int]:
    """(the report, the exit code) of torchrun's `ChildFailedError`: a line naming each failed rank's exit code,
    then the cause whole: when the first failure (by torchrun's clock) recorded an agreed error, or recorded nothing,
    and a rank recorded an agreed one, the lowest such rank's (every rank raised it alike: rank 0's when it recorded
    it, however late); else the first failure's recorded text, else that of the lowest rank that recorded one (a rank
    stopped by torchrun before it could), else the first failure's own message."""
    failures = error.failures
    first_rank, first = error.get_first_failure()
    recorded = [(rank, f) for rank, f in sorted(failures.items()) if "cause" in f.error_file_data]
    agreed = [(rank, f) for rank, f in recorded if f.error_file_data.get("agreed")]
    first_is_own = "cause" in first.error_file_data and not first.error_file_data.get("agreed")
    if agreed and not first_is_own:
        rank, failure = agreed[0]
    else:
        rank, failure = (first_rank, first) if "cause" in first.error_file_data or not recorded else recorded[0]
    if "cause" in failure.error_file_data:
        cause = failure.error_file_data["cause"]
    elif isinstance(failure.message, dict):  # torchrun's own `record`: the traceback
        cause = failure.message.get("extraInfo", {}).get("py_callstack") or failure.message.get("message", "")
    else:  # no error file: torchrun's words for the exit (a signal, say)
        cause = failure.message
    codes = ", ".join(f"rank {r}: {_exit_code_words(f.exitcode)}" for r, f in sorted(failures.items()))
    exitcode = failure.exitcode if failure.exitcode > 0 else 128 - failure.exitcode
    return f"[veomni_lite] {error.name} failed ({codes}). The cause, from rank {rank}:\n{cause.rstrip()}", exitcode


def _exit_code_words(exitcode: int) -> str:
    if exitcode >= 0:
        return f"exit code {exitcode}"
    try:
        return f"signal {signal.Signals(-exitcode).name}"
    except ValueError:
        return f"signal {-exitcode}"


def main(argv: list[str] | None = None) -> int:
    """torchrun with `argv` (default: this command's arguments); 0, or the cause's exit code after its report."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    # torchrun's own default for several processes, set here so that it does not print its 5-line notice every run
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # its agent's line "failed (exitcode: 2) local_rank: 0 ..." says what the report below says
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(
        lambda record: not record.getMessage().startswith("failed (exitcode")
    )
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault(ERROR_FILE, os.path.join(tmp, "error.json"))  # where torchrun copies the first failure's
        try:
            torchrun(sys.argv[1:] if argv is None else argv)
        except ChildFailedError as error:
            report, exitcode = failure_report(error)
            sys.stdout.flush()
            print(report, file=sys.stderr, flush=True)
            return exitcode
    return 0


if __name__ == "__main__":
    sys.exit(main())
