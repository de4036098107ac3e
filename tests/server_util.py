"""Start the real service (`python -m fusionrag serve`) on a free loopback port, and stop it."""

from __future__ import annotations

import json
import os
import re
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx


class ServerProcess:
    def __init__(self, data_dir: Path, log_path: Path, *flags: str, env: dict | None = None,
                 nofile: int | None = None, cgroup=None):
        """nofile: the server's soft and hard limit on open files (as `ulimit -n` sets both); cgroup: a
        tests/cgroup.py Cgroup the server runs in (moved there before it starts)."""
        self.data_dir, self.log_path = data_dir, log_path
        self._log = open(log_path, "w")

        def limit():
            if nofile is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
            if cgroup is not None:
                cgroup.enter()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fusionrag", "serve", "--port", "0", "--data-dir", str(data_dir),
             "--log-format", "json", *flags],
            stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}, preexec_fn=limit)
        try:
            self.url = self._wait_for_port(60)
        except BaseException:
            self.proc.kill()  # never leave a server behind
            self.proc.wait()
            self._log.close()
            raise

    def _wait_for_port(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = re.search(r"Uvicorn running on (http://127\.0\.0\.1:\d+)", self.log_path.read_text())
            if m:
                return m.group(1)
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited with {self.proc.returncode}:\n{self.log_path.read_text()}")
            time.sleep(0.1)
        raise AssertionError(f"server did not start listening:\n{self.log_path.read_text()}")

    def wait_ready(self, timeout: float = 300) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            r = httpx.get(self.url + "/readyz")
            if r.status_code == 200:
                return r.json()
            assert r.json()["status"] != "failed", r.json()
            time.sleep(0.2)
        raise AssertionError(f"server not ready after {timeout} s:\n{self.log_path.read_text()}")

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60, **kw)

    def log_lines(self) -> list[dict]:
        return [json.loads(line) for line in self.log_path.read_text().splitlines() if line.startswith("{")]

    def open_files(self) -> int:
        """Descriptors the server process holds now."""
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode
