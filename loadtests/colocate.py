"""Retrieval and an LLM on one GPU: does retrieval stay fast, and does the LLM barely notice?

One run, three phases of equal length over the same collection and service:
1. retrieval alone (Locust vector users);
2. the LLM alone: the PyTorch decode loop of `fusionrag.loadtests.llm` (a ~1B-parameter model from
   a config, random weights, KV cache, a fixed share of GPU memory held from the start), or any
   OpenAI-compatible server such as vLLM kept busy by streaming chat requests (--llm-command);
3. both at once, the LLM's tokens per second counted over the very seconds Locust ran.
A decode loop runs only in the phases it is measured in; a server (vLLM) is started first and stays
resident, idle, through "retrieval alone", as it would in production.

It writes colocate.json and colocate.md: retrieval p99 and throughput alone vs beside the LLM, LLM
tokens per second alone vs beside retrieval, GPU memory of each against its budget, and the verdict
(p99 within 1.5x, tokens per second within 10%, no out-of-memory, budgets held). A budget is held
when what the driver counts for the process (nvidia-smi's per-process figure, sampled every
second here; the service's and the decode loop's own NVML readings where nvidia-smi lists no
processes) stays within it; on a GPU a budget that could not be measured fails the run.

    python -m fusionrag.loadtests.colocate --out colocate/ --device cuda --preset 1b --seconds 60 \\
        --memory-fraction 0.4 --server-arg=--gpu-budget-mb=4096
On a machine without a GPU, `--device cpu --preset tiny` runs the same phases at toy size.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from fusionrag.loadtests import runner
from fusionrag.loadtests.chat_server import chat_load
from fusionrag.loadtests.decode_loop import rate_between
from fusionrag.loadtests.decoder import PRESETS
from fusionrag.loadtests.plan import Plan, ShapeConfig
from fusionrag.loadtests.report import plot_latency, read_request_log, summarize_metrics, summarize_requests
from fusionrag.retriever.errors import FusionRAGError

P99_LIMIT = 1.5  # retrieval p99 beside the LLM at most this times p99 alone
TOKENS_LIMIT = 0.9  # LLM tokens per second beside retrieval at least this share of alone


class GpuSampler:
    """Peak GPU memory per process, from nvidia-smi once a second (absent without a GPU)."""

    def __init__(self):
        self.available = shutil.which("nvidia-smi") is not None
        self.peak: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.wait(1.0):
            out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                                  "--format=csv,noheader,nounits"], capture_output=True, text=True).stdout
            for line in out.splitlines():
                pid, _, mib = line.partition(",")
                if pid.strip().isdigit() and mib.strip().isdigit():
                    self.peak[int(pid)] = max(self.peak.get(int(pid), 0), int(mib) << 20)

    def __enter__(self):
        if self.available:
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self.available:
            self._thread.join()


class DecodeLLM:
    """The LLM as the decode-loop process, started fresh for each phase it takes part in."""

    def __init__(self, args, out: Path):
        self.args, self.out = args, out
        self.pids: dict[int, str] = {}

    def start(self, seconds: float, tag: str):
        a = self.args
        result, ready = self.out / f"llm-{tag}.json", self.out / f"llm-{tag}.ready"
        argv = [sys.executable, "-m", "fusionrag.loadtests.llm", "decode", "--preset", a.preset,
                "--device", a.device, "--seconds", str(seconds), "--batch", str(a.batch),
                "--prompt-len", str(a.prompt_len), "--memory-fraction", str(a.memory_fraction),
                "--threads", str(a.llm_threads), "--out", str(result), "--ready-file", str(ready)]
        child = runner.Child(f"the LLM decode loop ({tag})", argv, self.out / f"llm-{tag}.log")
        self.pids[child.proc.pid] = f"llm-{tag}"
        deadline = time.monotonic() + a.start_timeout
        while not ready.exists():
            if child.proc.poll() is not None or time.monotonic() > deadline:
                child.stop()
                raise FusionRAGError(f"{child.name} did not start generating; end of {child.log}:\n{child.tail()}")
            time.sleep(0.1)

        def wait() -> dict:
            status = child.proc.wait(timeout=seconds + a.start_timeout)
            child.stop()
            if not result.exists():
                raise FusionRAGError(f"{child.name} exited with status {status} without a report; "
                                     f"end of {child.log}:\n{child.tail()}")
            return json.loads(result.read_text())

        return wait

    def stop(self):
        pass


class ServerLLM:
    """The LLM as an OpenAI-compatible server (vLLM, say), started once, kept busy while measured."""

    def __init__(self, args, out: Path):
        self.args = args
        port = runner.free_port()
        argv = [x.replace("{port}", str(port)) for x in shlex.split(args.llm_command)]
        self.child = runner.Child("the LLM server", argv, out / "llm-server.log")
        self.pids = {self.child.proc.pid: "llm-server"}
        self.url = f"http://127.0.0.1:{port}"
        try:
            body = self.child.wait_http(self.url + "/v1/models", args.start_timeout)
        except BaseException:
            self.child.stop()
            raise
        self.model = args.llm_model or json.loads(body)["data"][0]["id"]

    def start(self, seconds: float, tag: str):
        box = {}
        t = threading.Thread(target=lambda: box.update(chat_load(
            self.url, self.model, self.args.concurrency, seconds, self.args.max_tokens)), daemon=True)
        t.start()

        def wait() -> dict:
            t.join()
            return box

        return wait

    def stop(self):
        self.child.stop()


def retrieval_phase(args, url: str, vector_qs, out: Path, tag: str) -> dict:
    phase_dir = out / tag
    phase_dir.mkdir(parents=True, exist_ok=True)
    plan = Plan(shape=ShapeConfig(users=args.users, seconds=args.seconds), request_log=str(phase_dir / "requests.csv"),
                weights={"vector": 1}, k=args.k, min_recall=args.min_recall, vector=vector_qs)
    _, before = runner.scrape(url)
    status = runner.run_locust(plan, url, phase_dir)
    _, after = runner.scrape(url)
    rows = read_request_log(plan.request_log)
    if not rows:
        raise FusionRAGError(f"locust made no requests in phase {tag} (status {status}); see {phase_dir}")
    start = min(r["t"] for r in rows)
    end = max(r["t"] + r["ms"] / 1000 for r in rows)
    summary = summarize_requests(rows, end - start)
    plot_latency(rows, plan.shape, start, phase_dir / "latency.png", f"retrieval, {tag}")
    a = summary["all"]
    return {"window": [start, end], "requests": a["requests"], "failures": a["failures"], "per_s": a["per_s"],
            "latency_ms": a["latency_ms"], "recall": summary["recall"]["mean"], "errors": summary["errors"][:5],
            "locust_exit_status": status, "service_metrics": summarize_metrics(before, after)}


def llm_rate(result: dict, window: tuple[float, float] | None) -> float:
    """Tokens per second over `window`, or over the run past its first tenth (warm-up) without one."""
    tl = result["timeline"]
    if window is None:
        t0, t1 = tl[0][0], tl[-1][0]
        window = (t0 + 0.1 * (t1 - t0), t1)
    return rate_between(tl, *window)


def _llm_side(result: dict, measured: float | None) -> dict:
    side = {k: v for k, v in result.items() if k not in ("timeline", "tokens_per_s")}
    return {**side, "tokens_per_s_whole_run": result.get("tokens_per_s"), "tokens_per_s": measured}


def _ratio(a, b):
    return None if a is None or not b else a / b


def run(args) -> dict:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data_dir = Path(tempfile.mkdtemp(prefix="fusionrag-colocate-"))
    prep_args = argparse.Namespace(base=args.base, count=args.count, dim=args.dim, queries=None,
                                   num_queries=args.num_queries, metric="l2", k=args.k, texts=None,
                                   rag_route="separate")
    service = llm = None
    try:
        vector_qs, _, prep = runner.prepare(prep_args, data_dir, {"vector": 1})
        service, url = runner.start_service(data_dir, out, args.server_arg)
        service.wait_http(url + "/readyz", args.start_timeout)
        llm = ServerLLM(args, out) if args.llm_command else DecodeLLM(args, out)
        with GpuSampler() as gpu:
            if args.warmup_seconds:
                warm = argparse.Namespace(**{**vars(args), "seconds": args.warmup_seconds})
                retrieval_phase(warm, url, vector_qs, out, "warmup")
            alone = retrieval_phase(args, url, vector_qs, out, "retrieval-alone")
            llm_alone = llm.start(args.seconds, "alone")()
            # The LLM runs on both sides of the Locust window so that it covers the whole of it.
            margin = args.llm_margin
            wait = llm.start(args.seconds + 2 * margin, "beside")
            time.sleep(min(margin, 2.0))
            beside = retrieval_phase(args, url, vector_qs, out, "retrieval-beside-llm")
            llm_beside = wait()
    finally:
        if llm is not None:
            llm.stop()
        service_alive = service is not None and service.proc.poll() is None
        if service is not None:
            service.stop()
        shutil.rmtree(data_dir, ignore_errors=True)
    for r in (llm_alone, llm_beside):
        if not r.get("oom") and "timeline" not in r:
            raise FusionRAGError(f"the LLM side reported no timeline: {str(r)[:300]}")
    tok_alone = None if llm_alone.get("oom") else llm_rate(llm_alone, None)
    tok_beside = None if llm_beside.get("oom") else llm_rate(llm_beside, tuple(beside["window"]))
    by_process = ({"service" if pid == service.proc.pid else llm.pids.get(pid, str(pid)): b
                   for pid, b in gpu.peak.items()} if gpu.available else None) or {}
    metrics = beside["service_metrics"]
    retrieval_held = _held(by_process.get("service"), metrics["gpu_memory_budget_bytes"], metrics["gpu_within_budget"])
    llm_held = [_held(by_process.get(f"llm-{tag}"), r.get("memory_budget_bytes"), r.get("budget_held"))
                for tag, r in (("alone", llm_alone), ("beside", llm_beside))]
    verdict, passed = judge(alone, beside, tok_alone, tok_beside,
                            oom=bool(llm_alone.get("oom") or llm_beside.get("oom")), service_alive=service_alive,
                            llm_budget_held=None if None in llm_held else all(llm_held),
                            retrieval_budget_held=retrieval_held, gpu=args.device.startswith("cuda"),
                            llm_budget_set=isinstance(llm, DecodeLLM) and args.memory_fraction > 0)
    report = {
        "device": args.device, "passed": passed, "verdict": verdict,
        "llm": f"command: {args.llm_command}" if args.llm_command else "decode loop",
        "preset": None if args.llm_command else args.preset,
        "llm_parameters": None if args.llm_command else PRESETS[args.preset].parameters(),
        "retrieval_alone": alone, "retrieval_beside_llm": beside,
        "llm_alone": _llm_side(llm_alone, tok_alone), "llm_beside_retrieval": _llm_side(llm_beside, tok_beside),
        "gpu_peak_bytes_by_process": by_process or None,
        "collection": prep.get("vectors"), "service_alive_at_end": service_alive,
        "machine": runner.machine(), "seconds_per_phase": args.seconds, "users": args.users,
    }
    (out / "colocate.json").write_text(json.dumps(report, indent=1))
    (out / "colocate.md").write_text(markdown(report))
    return report


def _held(peak: int | None, budget: int | None, own_reading: bool | None) -> bool | None:
    """A process's nvidia-smi peak within its budget where both are known, else its own reading."""
    return peak <= budget if peak is not None and budget else own_reading


def judge(alone: dict, beside: dict, tok_alone: float | None, tok_beside: float | None, *, oom: bool,
          service_alive: bool, llm_budget_held: bool | None, retrieval_budget_held: bool | None,
          gpu: bool, llm_budget_set: bool) -> tuple[dict, bool]:
    """The verdict on the measured figures, and whether the run passed. A budget held None was not
    measured: acceptable on a CPU, where there is no GPU memory to hold, and for an LLM server given
    no share here (--llm-command), a failure otherwise."""
    p99_ratio = _ratio(beside["latency_ms"].get("p99"), alone["latency_ms"].get("p99"))
    tok_ratio = _ratio(tok_beside, tok_alone)
    verdict = {
        "retrieval_p99_ratio": p99_ratio, "retrieval_p99_ok": p99_ratio is not None and p99_ratio <= P99_LIMIT,
        "llm_tokens_ratio": tok_ratio, "llm_tokens_ok": tok_ratio is not None and tok_ratio >= TOKENS_LIMIT,
        "no_oom": not oom and alone["failures"] == 0 and beside["failures"] == 0 and service_alive,
        "llm_budget_held": llm_budget_held, "retrieval_budget_held": retrieval_budget_held,
    }
    unmeasured = gpu and (retrieval_budget_held is None or (llm_budget_set and llm_budget_held is None))
    passed = (verdict["retrieval_p99_ok"] and verdict["llm_tokens_ok"] and verdict["no_oom"]
              and False not in (llm_budget_held, retrieval_budget_held) and not unmeasured)
    return verdict, passed


def _fmt(x, digits=3):
    return "n/a" if x is None else f"{x:.{digits}g}" if isinstance(x, float) else str(x)


def markdown(r: dict) -> str:
    a, b = r["retrieval_alone"], r["retrieval_beside_llm"]
    la, lb = r["llm_alone"], r["llm_beside_retrieval"]
    v = r["verdict"]
    lines = [f"# Retrieval beside an LLM on one device ({r['device']}): {'PASSED' if r['passed'] else 'FAILED'}", "",
             f"LLM: {r['llm']}, preset {r['preset']} ({_fmt(r['llm_parameters'])} parameters); "
             f"{r['seconds_per_phase']} s per phase, {r['users']} retrieval users.", "",
             "| | alone | beside the other | ratio | limit |", "|---|---|---|---|---|",
             f"| retrieval p99 (ms) | {_fmt(a['latency_ms'].get('p99'))} | {_fmt(b['latency_ms'].get('p99'))} | "
             f"{_fmt(v['retrieval_p99_ratio'])} | <= {P99_LIMIT} |",
             f"| retrieval p50 (ms) | {_fmt(a['latency_ms'].get('p50'))} | {_fmt(b['latency_ms'].get('p50'))} | | |",
             f"| retrieval requests/s | {_fmt(a['per_s'])} | {_fmt(b['per_s'])} | | |",
             f"| retrieval failures | {a['failures']} | {b['failures']} | | 0 |",
             f"| retrieval recall@k | {_fmt(a['recall'])} | {_fmt(b['recall'])} | | |",
             f"| LLM tokens/s | {_fmt(la['tokens_per_s'])} | {_fmt(lb['tokens_per_s'])} | "
             f"{_fmt(v['llm_tokens_ratio'])} | >= {TOKENS_LIMIT} |", "",
             f"- no out-of-memory and no failed request: {v['no_oom']}",
             f"- LLM memory within its share: {_fmt(v['llm_budget_held'])} (budget "
             f"{_fmt(la.get('memory_budget_bytes'))} B, process peak {_fmt(lb.get('memory_process_max_bytes'))} B)",
             f"- retrieval GPU memory within its budget: {_fmt(v['retrieval_budget_held'])} (budget "
             f"{_fmt(b['service_metrics']['gpu_memory_budget_bytes'])} B, booked "
             f"{_fmt(b['service_metrics']['gpu_memory_used_bytes'])} B, process "
             f"{_fmt(b['service_metrics']['gpu_memory_process_bytes'])} B)",
             f"- peak GPU memory per process (nvidia-smi): {r['gpu_peak_bytes_by_process']}"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fusionrag.loadtests.colocate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--seconds", type=float, default=60.0, help="length of each measured phase")
    p.add_argument("--warmup-seconds", type=float, default=10.0, help="retrieval warm-up before measuring")
    p.add_argument("--users", type=int, default=8, help="retrieval users (steady)")
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--min-recall", type=float, default=0.5)
    p.add_argument("--base", help="vector file for the collection (default: synthetic clustered)")
    p.add_argument("--count", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--num-queries", type=int, default=200)
    p.add_argument("--server-arg", action="append", default=[],
                   help="extra flag for `fusionrag serve` (GPU budget, batching), repeatable")
    p.add_argument("--device", default="cuda", help="device of the decode loop")
    p.add_argument("--preset", default="1b", choices=sorted(PRESETS))
    p.add_argument("--batch", type=int, default=16, help="sequences decoded at once")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--memory-fraction", type=float, default=0.4, help="GPU share the decode loop holds (0: none)")
    p.add_argument("--llm-threads", type=int, default=1, help="CPU threads of the decode loop")
    p.add_argument("--llm-command", help="start an OpenAI-compatible server instead of the decode loop, "
                                         "e.g. 'vllm serve MODEL --port {port} --gpu-memory-utilization 0.4'")
    p.add_argument("--llm-model", help="with --llm-command: model name (default: the server's first)")
    p.add_argument("--concurrency", type=int, default=16, help="with --llm-command: streams in flight")
    p.add_argument("--max-tokens", type=int, default=256, help="with --llm-command: tokens per answer")
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds a server or model may take to start")
    p.add_argument("--llm-margin", type=float, default=8.0,
                   help="seconds the LLM runs before and after the Locust window of the shared phase")
    args = p.parse_args(argv)
    try:
        report = run(args)
    except FusionRAGError as e:
        print(f"colocate: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"passed": report["passed"], **report["verdict"]}))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
