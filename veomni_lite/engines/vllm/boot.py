"""The first process of a launched vLLM server, and how a server's process group ends. Standard library only: vLLM's
interpreter runs this file (`python -I boot.py TRAINER_PID MODULE ARGS...`, from `VLLMServer`) without
veomni_lite on its path.

`VLLMServer` starts this file in a session of its own, so the server and every process it starts (its engine core,
its workers, Python's resource tracker) share one process group, whose id is this first process's pid. The group ends
as a whole however the server ends:
- the server dies with the trainer: PR_SET_PDEATHSIG SIGKILL (Linux), which survives the exec below;
- this process forks a watchdog, then becomes the server (`exec python -m MODULE ARGS`): the trainer's child is the
  server itself, so its exit code is the server's;
- the watchdog, the server's child, notices within `POLL_S` that the server has exited, whatever the cause (killed,
  crashed, shut down, or killed with the trainer), and ends the group (`end_group`).
`VLLMServer.stop` ends the group the same way from the trainer, by its id (the server, the trainer's child, is reaped
only after, so the id cannot name another group meanwhile).

`end_group`: SIGTERM, up to `GRACE_S` for the group to empty, then SIGKILL to whatever is left. SIGTERM first because
vLLM unlinks its shared memory (two segments of 160 and 240 MB in /dev/shm on the CPU build) when it shuts down; a
SIGKILL alone leaves them in /dev/shm (measured). Python's resource tracker ignores SIGTERM and unlinks what a killed
process of the group registered once the others have exited.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time

GRACE_S = 10.0
POLL_S = 0.2
_PR_SET_PDEATHSIG = 1


def members(pgid: int) -> list[int]:
    """The processes of group `pgid` that have not exited (zombies excluded); Linux reads /proc, elsewhere the group is
    reported as [pgid] while any process, a zombie included, holds its id."""
    if not os.path.isdir("/proc/self"):
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return []
        except PermissionError:
            pass
        return [pgid]
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()  # after "pid (comm)": state, ppid, pgrp, ...
        except OSError:  # exited meanwhile
            continue
        if int(fields[2]) == pgid and fields[0] not in (b"Z", b"X"):
            pids.append(int(entry))
    return pids


def end_group(pgid: int, grace_s: float = GRACE_S, spare: int = 0) -> None:
    """End process group `pgid`: SIGTERM, up to `grace_s` for its processes other than `spare` to exit, then SIGKILL
    to every process left, and up to 5 s more until none is left. The caller makes sure `pgid` still names the group
    (a member it has not reaped)."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    for wait_s, final in ((grace_s, False), (5.0, True)):
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and [pid for pid in members(pgid) if pid != spare]:
            time.sleep(0.05)
        if not final:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)  # `spare` too, when it is of the group


def _set_parent_death_signal(sig: int) -> None:
    """Linux: receive `sig` when the parent exits (kept across exec); elsewhere nothing."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, sig)


def _watch(server: int) -> None:
    """The watchdog: once the server (its parent) has exited, end the group, itself last."""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # a SIGTERM to the group is for the server
        signal.signal(sig, signal.SIG_IGN)
    while os.getppid() == server:  # reparented once the server exits
        time.sleep(POLL_S)
    print(f"[veomni_lite] vLLM server pid {server} exited; ending its process group {os.getpgrp()}", flush=True)
    end_group(os.getpgrp(), spare=os.getpid())
    os._exit(0)


def main(argv: list[str]) -> None:
    trainer, module, args = int(argv[0]), argv[1], argv[2:]
    _set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != trainer:  # the trainer exited before the line above
        sys.exit(1)
    server = os.getpid()
    if os.fork() == 0:
        _watch(server)
    os.execv(sys.executable, [sys.executable, "-m", module, *args])


if __name__ == "__main__":
    main(sys.argv[1:])
