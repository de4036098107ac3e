"""Ray clusters for the sharded-mode tests, each on 127.0.0.1 inside a network and PID namespace of the test's own
(`unshare --net --pid`, loopback up): loopback is then the only interface, so Ray, which binds every interface and
dials the machine's external address, stays on 127.0.0.1, and when the namespace's first process ends the kernel
ends every other process in it.

The test side: netns_works, in_namespace. The child side (a script run in the namespace): ray_cluster, listening."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

PORT = 6390
LOOPBACK = ("127.0.0.1", "[::ffff:127.0.0.1]", "[::1]")


def netns_works() -> bool:
    try:
        return subprocess.run(["unshare", "--net", "sh", "-c", "ip link set lo up"], capture_output=True,
                              timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def in_namespace(child: Path, work: Path, timeout: int, *args: str) -> dict:
    """Run `child WORK ARGS...` in a namespace of its own; the JSON report it prints last. Its whole stderr is kept
    in WORK for a failure's post-mortem."""
    cmd = ["unshare", "--net", "--pid", "--fork", "--mount-proc", "--kill-child", "sh", "-c",
           'ip link set lo up && exec "$@"', "sh", sys.executable, str(child), str(work), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    (work / f"{child.stem}.stderr").write_text(proc.stderr)
    assert proc.returncode == 0, (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def ray_cli() -> str:
    return str(Path(sys.executable).with_name("ray"))


def listening() -> list[str]:
    """The addresses something listens on (TCP), as `ss` sees them."""
    out = subprocess.run(["ss", "-Htln"], capture_output=True, text=True, check=True).stdout
    return sorted({line.split()[3].rsplit(":", 1)[0] for line in out.splitlines() if line.strip()})


def _copy_logs(temp: str, logs_to: Path | None) -> None:
    logs = Path(temp) / "session_latest" / "logs"
    if logs_to is not None and logs.exists():
        shutil.copytree(logs, logs_to, ignore_dangling_symlinks=True, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("*.sock"))


@contextmanager
def ray_cluster(nodes: int, logs_to: Path | None = None, env: dict | None = None):
    """`nodes` Ray nodes on 127.0.0.1 (`ray start` each, one CPU, a small object store), this process connected
    as the driver. On leaving: every Ray process stopped and the session directory removed; if the body raised,
    its logs are first copied to logs_to (when given). env: more environment for the nodes' processes."""
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", **(env or {})}
    # The session directory holds Unix sockets, whose paths must stay short.
    temp = tempfile.mkdtemp(prefix="fr-ray-", dir="/tmp")
    common = ["--node-ip-address=127.0.0.1", "--num-cpus=1", "--object-store-memory=80000000",
              "--disable-usage-stats"]
    try:
        subprocess.run([ray_cli(), "start", "--head", f"--port={PORT}", "--include-dashboard=false",
                        f"--temp-dir={temp}", *common], env=env, check=True, capture_output=True)
        for _ in range(nodes - 1):
            subprocess.run([ray_cli(), "start", f"--address=127.0.0.1:{PORT}", *common], env=env, check=True,
                           capture_output=True)
        import ray

        ray.init(address=f"127.0.0.1:{PORT}", _node_ip_address="127.0.0.1", log_to_driver=False)
        yield temp
        ray.shutdown()
    except BaseException:
        _copy_logs(temp, logs_to)
        raise
    else:
        # FR_KEEP_RAY_LOGS=1: the logs kept however the body ended (the runs whose GCS exited left none without it).
        if os.environ.get("FR_KEEP_RAY_LOGS"):
            _copy_logs(temp, logs_to)
    finally:
        subprocess.run([ray_cli(), "stop", "--force"], env=env, capture_output=True)
        shutil.rmtree(temp, ignore_errors=True)
