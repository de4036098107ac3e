"""The process's anonymous resident memory, as /proc reports it: what tests check a meter or a saving against,
measured in a process of their own (memory an earlier test freed, reused, would not show as resident growth)."""

import os
import subprocess
import sys
from pathlib import Path


def status(*keys: str) -> dict[str, int]:
    """These size lines of this process's /proc/self/status (VmRSS, VmHWM, RssAnon, RssFile ...), bytes."""
    out = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            key = line.split(":")[0]
            if key in keys:
                out[key] = int(line.split()[1]) * 1024
    missing = set(keys) - set(out)
    assert not missing, f"no {sorted(missing)} in /proc/self/status"
    return out


def rss_anon() -> int:
    """Anonymous resident bytes of this process (/proc/self/status RssAnon)."""
    return status("RssAnon")["RssAnon"]


def run_alone(script: str, *args: str, timeout: float = 300) -> str:
    """Runs a test module's __main__ (script, with args) in a fresh interpreter that can import this module;
    returns its stdout's last line, asserting it exited 0."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent),
                                                                     os.environ.get("PYTHONPATH")]))}
    p = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, timeout=timeout, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout.strip().splitlines()[-1]
