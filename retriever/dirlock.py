"""One process at a time in a directory that it writes: a catalog's data directory, a sharded index's shard part.

An exclusive flock(2) on a lock file in the directory, held for as long as the returned descriptor stays open. The
kernel lets go when the process ends, however it ends (a SIGKILL included), so a lock never outlives its holder; on
NFS v4 the client emulates flock with byte-range locks that the server sees, so processes on different machines
sharing the directory exclude each other too. The file holds the holder's process id and host, for the message a
process turned away gets."""

from __future__ import annotations

import fcntl
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

from fusionrag.retriever.errors import ConflictError


def hold(lock_file: Path, in_use: Callable[[str], str], wait_s: float = 0.0) -> int:
    """The descriptor of lock_file, locked exclusively; trying again for up to wait_s seconds while another process
    holds it (one being stopped may take a moment to go). ConflictError(in_use(holder)) when it still does, holder
    naming that process ("pid on host")."""
    fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o644)
    deadline = time.monotonic() + wait_s
    try:  # the descriptor goes with any failure: a refusal, an interrupted wait, a failed write of the holder
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    holder = os.pread(fd, 256, 0).decode(errors="replace").strip() or "?"
                    raise ConflictError(in_use(holder)) from None
                time.sleep(0.05)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"process {os.getpid()} on {socket.gethostname()}".encode(), 0)
    except BaseException:
        os.close(fd)
        raise
    return fd
