"""Run a command with its stderr on a terminal (a pseudo-terminal of 120 columns), as a person at a shell has it."""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import termios
import threading


def run_on_terminal(argv: list[str], timeout: float = 600) -> tuple[int, str]:
    """(exit status, what the command wrote to its terminal); its stdout goes to a pipe, unread."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=slave)
    os.close(slave)
    chunks = []

    def read():
        while True:
            try:
                data = os.read(master, 1 << 16)
            except OSError:  # EIO: the command has closed its side
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        proc.wait(timeout)
    finally:
        proc.kill()
        reader.join(30)
        os.close(master)
    return proc.returncode, b"".join(chunks).decode(errors="replace")
