"""A cgroup v1 memory cgroup (/sys/fs/cgroup/memory, as on the development and CI machines) with a limit and no
swap, for a child process of a test: the kernel, not the code under test, enforces the limit."""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from pathlib import Path

import pytest

CGROUP_V1 = Path("/sys/fs/cgroup/memory")


class Cgroup:
    """A cgroup v1 memory cgroup with a limit and no swap, for a child process: run() starts a command in it,
    enter() moves the calling process into it (a child's preexec_fn)."""

    def __init__(self, limit: int):
        self.path = CGROUP_V1 / f"fusionrag-test-{uuid.uuid4().hex[:8]}"
        self.path.mkdir()
        (self.path / "memory.limit_in_bytes").write_text(str(limit))
        swap = self.path / "memory.memsw.limit_in_bytes"
        if swap.exists():
            swap.write_text(str(limit))

    def run(self, cmd: list[str], **kw) -> subprocess.CompletedProcess:
        shell = f'echo $$ > {self.path}/cgroup.procs && exec "$@"'
        return subprocess.run(["sh", "-c", shell, "sh", *cmd], **kw)

    def enter(self) -> None:
        """Moves the calling process into the cgroup (a child's preexec_fn, before it execs)."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def oom_kills(self) -> int:
        """How many processes the kernel killed in it for memory (memory.oom_control's oom_kill)."""
        for line in (self.path / "memory.oom_control").read_text().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
        return 0

    def value(self, name: str) -> int:
        return int((self.path / name).read_text())

    def remove(self) -> None:
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


@pytest.fixture
def cgroup_factory():
    made = []

    def make(limit: int) -> Cgroup:
        made.append(Cgroup(limit))
        return made[-1]

    yield make
    for c in made:
        c.remove()
