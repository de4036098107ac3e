"""The GPU acceptance in one command (`make gpu-accept OUT=dir`), run on the GPU machine from a fresh
copy of the repository that carries the wheels of `make gpu-wheels` (.whl/, git-ignored):

  install  the wheels into /tmp/fusionrag-site, then this package, its native extension built there by
           CMake (scikit-build-core; incremental in build/); every later step imports it from there
  a        the kernel, GPU-tier and GPU-memory tests, the service's GPU-budget test, and the device tier over
           4-bit codes, on the device
  b        a collection on the GPU tier: writes, a merge, deletes and writes, a second merge, searches
           after each (bench/gpu/gpu_collection.py)
  c        bench/gpu/gpu_tier.py on 1M x 128 clustered vectors made there: scan bandwidth against the measured
           copy bandwidth, QPS at recall@10 0.90 and 0.95 (GPU tier, CPU tier, exact on the GPU), each
           kernel's first compile (an empty Triton cache), the process's GPU memory against its budget,
           the device tier with a tenth of the postings resident (the rest streamed from pinned host memory,
           no raw vectors on the device), and filter_tier auto against each tier alone at
           calls of 1, 8, 64 and 1024 queries
  d        the co-location run: loadtests/colocate.py --device cuda, the ~1B decoder holding 40% of the
           GPU from the start, the service a 4 GiB budget, with its verdict
  e        the service at 1, 8 and 64 concurrent users, --filter-tier auto against cpu on the same box
           (loadtests/levels.py, 200k x 128)

Not covered here: the vLLM plugin on the GPU tier inside vLLM's own API-server process. The GPU machine
has no vLLM (a CUDA vLLM is not among the wheels), so its order and refusal are tested on the CPU
(tests/integrations/test_integration_vllm.py: vLLM calls the plugin only once its engine has profiled and allocated
its KV cache; a budget plan_plugin_split finds too large stops vLLM with what to set). On a GPU with
vLLM, the check to make is that nvidia-smi's figure for vLLM's API-server process stays within
FUSIONRAG_GPU_BUDGET_MB (or the budget the plugin logs) while vLLM's engine holds what it was given.

Each step runs in a process of its own under a time limit, its log and outputs kept; a failed step
does not stop the next. OUT gets three files, rewritten after every step: gpu_accept.json and
gpu_accept.md (the device as torch names it, every step's outcome and figures) and
gpu_accept-files.tar.gz (every log and output). Without CUDA every step runs at toy size on the CPU,
through Triton's interpreter (install is skipped where the package imports already): the dry run
that tests/bench/test_gpu_accept.py makes in CI, so that this script cannot rot.

    python -m bench.gpu.gpu_accept --out DIR [--steps install,a,b,c,d] [--deadline SECONDS]
    python -m bench.gpu.gpu_accept --merge DIR1 DIR2 ... --out DIR    # one summary of runs made step by step
    python -m bench.gpu.gpu_accept --wheels .whl                      # make gpu-wheels (needs a registry)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from bench.harness.paths import ROOT
WHEELS = ROOT / ".whl"
SITE = Path("/tmp/fusionrag-site")
STEPS = ("install", "a", "b", "c", "d", "e")
TITLES = {"install": "wheels and the native extension", "a": "kernel, GPU-tier, GPU-memory and service tests",
          "b": "a collection on the GPU tier: writes, merges, searches", "c": "bench/gpu/gpu_tier.py",
          "d": "co-location beside a ~1B decoder", "e": "the service at 1, 8 and 64 users, auto against cpu"}
# Seconds each step may take; the device runs a command for at most 10 minutes.
LIMITS = {"install": 300, "a": 540, "b": 420, "c": 560, "d": 560, "e": 400}
WHEELS_MAX = 60 << 20
FILE_MAX = 4 << 20  # bytes of one file kept in gpu_accept-files.tar.gz
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")
DATA_SETS = ("sift5k-ngt-texmexq",)  # what the tests of step a read from shared/data


def machine() -> dict:
    """The device as torch names it, and the versions; asked in a process of its own, so that this
    one holds no CUDA context (it would sit in GPU memory beside the steps' own)."""
    code = ("import json, platform, torch, triton; c = torch.cuda.is_available(); print(json.dumps({"
            "'device': torch.cuda.get_device_name() if c else None, 'cuda': c, 'torch': torch.__version__, "
            "'triton': triton.__version__, 'python': platform.python_version()}))")
    m = json.loads(subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                                  check=True).stdout)
    m["device"] = m["device"] or "no CUDA device: a dry run on the CPU through Triton's interpreter"
    return m


class Run:
    """One invocation: its steps' records, the summary files in OUT, logs and outputs in a work folder."""

    def __init__(self, out: Path, deadline: float, colocate_seconds: int = 45):
        self.out, self.start, self.deadline = out, time.time(), deadline
        self.colocate_seconds = colocate_seconds  # each measured phase of step d on a GPU
        self.files = Path(tempfile.mkdtemp(prefix="fusionrag-accept-"))
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if (WHEELS / "data").is_dir():
            self.env["FUSIONRAG_DATA"] = str(WHEELS / "data")
        m = machine()
        self.cuda = m["cuda"]
        if not self.cuda:  # every process the steps start runs the kernels in Triton's interpreter
            self.env["TRITON_INTERPRET"] = "1"
        self.summary = {**m, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": platform.node(),
                        "cpus": os.cpu_count(), "steps": {}}

    def left(self) -> float:
        return self.deadline - (time.time() - self.start)

    def run(self, step: str, argv: list[str], env: dict | None = None) -> tuple[int | None, float]:
        """Run argv with its output to the step's log; (exit status or None on timeout, seconds)."""
        limit = min(LIMITS[step], self.left() - 20)  # 20 s to write the summary before the deadline
        log = self.files / f"{step}.log"
        t = time.perf_counter()
        if limit < 30:
            log.write_text(f"not started: {self.left():.0f} s left before the deadline\n")
            return None, 0.0
        with open(log, "a") as f:
            f.write(f"$ {' '.join(argv)}\n")
            f.flush()
            proc = subprocess.Popen(argv, cwd=ROOT, env=env or self.env, stdout=f, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                status = proc.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)  # the step's whole process group: a service or an LLM it started too
                proc.wait()
                f.write(f"\nkilled after {limit:.0f} s\n")
                status = None
        return status, time.perf_counter() - t

    def record(self, step: str, status: int | None, seconds: float, figures: dict, ok: bool | None = None,
               outcome: str | None = None) -> None:
        if outcome is None:
            outcome = "timeout" if status is None else "passed" if (status == 0 if ok is None else ok) else "failed"
        self.summary["steps"][step] = {**figures, "title": TITLES[step], "outcome": outcome, "exit_status": status,
                                       "seconds": round(seconds, 1), "log": f"{step}.log"}
        self.write()

    def write(self) -> None:
        s = self.summary
        s["seconds"] = round(time.time() - self.start, 1)
        s["passed"] = bool(s["steps"]) and all(r["outcome"] in ("passed", "skipped") for r in s["steps"].values())
        write_summary(self.out, s)
        # Large per-request logs stay out: the device hands back files of at most 16 MiB.
        with tarfile.open(self.out / "gpu_accept-files.tar.gz", "w:gz") as tar:
            tar.add(self.files, arcname="gpu_accept-files",
                    filter=lambda info: None if info.size > FILE_MAX else info)


# Issue 47's targets (and 14's for co-location), judged from the steps' figures: a run whose every step passed can
# still miss them. (name, step, what is measured, how it is read from the step's record, its test, the target)
TARGETS = (
    ("gpu_over_cpu", "c", "GPU tier QPS over the CPU tier's at recall@10 >= 0.90",
     lambda r: r.get("gpu_over_cpu_at_0.90"), lambda v: v >= 5, ">= 5"),
    ("gpu_over_cpu_95", "c", "GPU tier QPS over the CPU tier's at recall@10 >= 0.95",
     lambda r: r.get("gpu_over_cpu_at_0.95"), lambda v: v >= 5, ">= 5"),
    ("gpu_over_exact", "c", "GPU tier QPS over brute force on the device at recall@10 >= 0.90",
     lambda r: r.get("gpu_over_exact_at_0.90"), lambda v: v > 1, "> 1"),
    ("tenth_resident_over_cpu", "c", "a tenth of the postings' codes resident (lists placed by length), no raw "
     "vectors: QPS over the CPU tier's at 0.90",
     lambda r: r.get("tenth_resident_over_cpu_at_0.90"), lambda v: v >= 3, ">= 3"),
    ("scan_bandwidth", "c", "ADC scan (list-ordered, streamed), fraction of the device's copy bandwidth",
     lambda r: max((x for x in (r.get("stream_fraction_of_bandwidth") or []) + (r.get("scan_fraction_of_bandwidth")
                                                                                or []) if x is not None),
                   default=None),
     lambda v: v >= 0.5, ">= 0.5"),
    ("first_compile", "c", "kernel compile at the first open, seconds in all",
     lambda r: None if not r.get("kernel_compile_seconds") else max(r["kernel_compile_seconds"].values()),
     lambda v: v <= 5, "<= 5"),
    ("second_open", "c", "kernels at a second open of the index (Triton's cache warm), seconds in all",
     lambda r: None if not r.get("second_open_kernel_compile_seconds") else
     max(r["second_open_kernel_compile_seconds"].values()), lambda v: v <= 1, "<= 1"),
    ("memory_within_budget", "c", "process's GPU memory (NVML) within its budget, all and a tenth of the codes",
     lambda r: None if not r.get("gpu_memory") else bool(
         r["gpu_memory"].get("process_within_budget") and
         (r.get("gpu_memory_tenth_codes_resident") or {}).get("process_within_budget")),
     lambda v: v is True, "true"),
    ("auto_never_slower", "c", "filter_tier auto (each call to the tier measured cheaper): its call time over the "
     "faster of the CPU and the GPU tier alone, worst of 1, 8, 64 and 1024 queries a call",
     lambda r: r.get("auto_over_best_worst"), lambda v: v <= 1.15, "<= 1.15"),
    ("retrieval_p99_beside_llm", "d", "retrieval p99 beside the decoder over alone",
     lambda r: (r.get("verdict") or {}).get("retrieval_p99_ratio"), lambda v: v <= 1.5, "<= 1.5"),
    ("llm_tokens_beside_retrieval", "d", "decoder tokens/s beside retrieval over alone",
     lambda r: (r.get("verdict") or {}).get("llm_tokens_ratio"), lambda v: v >= 0.9, ">= 0.9"),
    ("no_oom_no_failure", "d", "no out-of-memory and no failed request beside the decoder",
     lambda r: (r.get("verdict") or {}).get("no_oom"), lambda v: v is True, "true"),
    ("service_auto_over_cpu", "e", "through the service at 1, 8 and 64 users: filter_tier auto's requests/s over "
     "cpu's on the same box, the worst level", lambda r: r.get("auto_over_cpu_worst"), lambda v: v >= 1, ">= 1"),
)


def targets(s: dict) -> dict:
    """Each target: what was measured (None where its step did not run or gave no figure) and whether it is met."""
    out = {}
    for name, step, what, read, test, target in TARGETS:
        r = s["steps"].get(step)
        value = read(r) if r and r.get("outcome") != "skipped" else None
        out[name] = {"what": what, "measured": value, "target": target,
                     "met": None if value is None else bool(test(value))}
    return out


def write_summary(out: Path, s: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    s["targets"] = targets(s)
    met = [t["met"] for t in s["targets"].values()]
    s["targets_met"] = None if None in met else all(met)
    (out / "gpu_accept.json").write_text(json.dumps(s, indent=1) + "\n")
    (out / "gpu_accept.md").write_text(markdown(s))


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        return {"unreadable": f"{path.name}: {e}"}


# -- the steps ---------------------------------------------------------------------------------------

def step_install(run: Run) -> None:
    probe = [sys.executable, "-c", "import fusionrag.native, fusionrag.server.app, locust"]
    if not run.cuda and subprocess.run(probe, cwd=ROOT, capture_output=True).returncode == 0:
        run.record("install", 0, 0.0, {"note": "no CUDA, and the package imports here"}, outcome="skipped")
        return
    wheels = sorted(WHEELS.glob("*.whl"))
    env = {**run.env, "PYTHONPATH": os.pathsep.join([str(SITE), run.env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
           "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 4)}
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-cache-dir", "--upgrade",
           "--target", str(SITE)]
    t = time.perf_counter()
    status, _ = run.run("install", [*pip, "--no-compile", *map(str, wheels)], env) if wheels else (0, 0.0)
    if status == 0:  # the package itself: its native extension built by CMake through scikit-build-core
        status, _ = run.run("install", [*pip, "--no-build-isolation", "."], env)
    if status == 0:
        status, _ = run.run("install", [*probe[:2], probe[2] + "; import fastapi, torch, triton, numpy; print("
                                        "'fusionrag from', fusionrag.native.__file__, 'torch', torch.__version__, "
                                        "'triton', triton.__version__, 'numpy', numpy.__version__)"], env)
    seconds = time.perf_counter() - t
    if status == 0:
        run.env = env
    run.record("install", status, seconds, {"wheels": len(wheels), "site": str(SITE)})


def step_a(run: Run) -> None:
    junit = run.files / "a.xml"
    files = ["tests/kernels/test_kernels.py", "tests/retriever/test_gpu_tier.py", "tests/kernels/test_gpu_memory.py",
             "tests/server/test_gpu_service.py", "tests/native/test_native_scan.py",
             # 4-bit codes on the device tier against the CPU tier and numpy (never yet run on a GPU)
             "tests/retriever/test_pq4_index.py::"
             "test_the_device_tier_scans_four_bit_codes_and_the_lists_tier_refuses_them"]
    # The dry run: one test of each file, enough to see the step run (make test runs them all).
    pick = [] if run.cuda else ["-k", "test_rank_keys_order or test_budget_too_small"]
    status, seconds = run.run("a", [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files, *pick,
                                    f"--junitxml={junit}"])
    figures = {}
    if junit.exists():
        suite = ET.parse(junit).getroot()
        suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
        figures = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
        figures["failed"] = [f"{c.get('classname')}::{c.get('name')}" for c in suite.iter("testcase")
                             if c.find("failure") is not None or c.find("error") is not None]
    ok = status == 0 and figures.get("tests", 0) > 0
    run.record("a", status, seconds, figures, ok)


def step_b(run: Run) -> None:
    out = run.files / "b.json"
    status, seconds = run.run("b", [sys.executable, "-m", "bench.gpu.gpu_collection", "--out", str(out)])
    run.record("b", status, seconds, read_json(out) if out.exists() else {})


def step_c(run: Run) -> None:
    out = run.files / "c.json"
    work = Path(tempfile.mkdtemp(prefix="fusionrag-accept-c-"))
    # An empty Triton cache: the compile times the GPU tier reports are first compiles.
    env = {**run.env, "TRITON_CACHE_DIR": str(work / "triton-cache")}
    status, seconds = run.run("c", [sys.executable, "-m", "bench.gpu.gpu_tier", "--out", str(out), "--work", str(work)], env)
    shutil.rmtree(work, ignore_errors=True)
    run.record("c", status, seconds, bench_figures(read_json(out)) if out.exists() else {})


def bench_figures(r: dict) -> dict:
    """The figures of bench/gpu/gpu_tier.py the summary shows (its whole JSON is in the files)."""
    if "unreadable" in r:
        return r
    e2e = r.get("end_to_end", {})
    best = {}
    for tier in ("gpu_tier", "cpu_tier", "lists_tier", "gpu_tier_raw_on_ssd", "gpu_tier_tenth_codes_resident",
                 "gpu_tier_tenth_rebalanced"):
        for target in ("0.90", "0.95"):
            run = (e2e.get(tier) or {}).get(f"qps_at_recall_{target}")
            best[f"{tier}_qps_at_recall_{target}"] = run and {k: run[k] for k in (
                "qps", "recall@10", "nprobe", "rerank", "device_busy", "bytes_per_query") if k in run}
    ratios = {k: v for k, v in e2e.items() if "_over_" in k}
    return {
        "bench_device": r.get("device"), "index": r.get("index"), "gpu_search": r.get("gpu_search"),
        "raw_vectors_resident": r.get("raw_vectors_resident"),
        "measured_bandwidth_GBps": r.get("measured_bandwidth_GBps"),
        "scan_fraction_of_bandwidth": [s.get("scan_fraction_of_bandwidth") for s in r.get("scan", [])],
        "stream_fraction_of_bandwidth": [s.get("stream_fraction_of_bandwidth") for s in r.get("scan_stream", [])],
        "kernel_compile_seconds": r.get("kernel_compile_seconds"), "gpu_tier_open_s": r.get("gpu_tier_open_s"),
        "gpu_tier_second_open_s": r.get("gpu_tier_second_open_s"),
        "second_open_kernel_compile_seconds": r.get("second_open_kernel_compile_seconds"),
        **best, "exact_on_device": e2e.get("exact_on_device"), **ratios,
        "by_call_size": e2e.get("by_call_size"), "crossover": r.get("crossover"),
        "gpu_memory": r.get("gpu_memory"),
        "gpu_memory_tenth_codes_resident": r.get("gpu_memory_tenth_codes_resident"),
    }


def step_d(run: Run) -> None:
    out = run.files / "colocate"
    if run.cuda:
        size = ["--device", "cuda", "--preset", "1b", "--seconds", str(run.colocate_seconds), "--warmup-seconds",
                str(max(3, run.colocate_seconds // 4)), "--users", "8",
                "--count", "100000", "--dim", "128", "--memory-fraction", "0.4",
                "--server-arg=--filter-tier=gpu", "--server-arg=--gpu-budget-mb=4096"]
    else:
        size = ["--device", "cpu", "--preset", "tiny", "--seconds", "2", "--warmup-seconds", "0", "--users", "2",
                "--count", "1200", "--dim", "16", "--num-queries", "20", "--batch", "2", "--prompt-len", "8",
                "--memory-fraction", "0", "--llm-margin", "3", "--server-arg=--filter-tier=gpu"]
    status, seconds = run.run("d", [sys.executable, "-m", "fusionrag.loadtests.colocate", "--out", str(out), *size])
    report = read_json(out / "colocate.json") if (out / "colocate.json").exists() else {}
    figures = {}
    if "verdict" in report:
        a, b = report["retrieval_alone"], report["retrieval_beside_llm"]
        figures = {"verdict_passed": report["passed"], "verdict": report["verdict"],
                   "retrieval_p99_ms": [a["latency_ms"].get("p99"), b["latency_ms"].get("p99")],
                   "retrieval_requests_per_s": [a["per_s"], b["per_s"]],
                   "llm_tokens_per_s": [report["llm_alone"]["tokens_per_s"],
                                        report["llm_beside_retrieval"]["tokens_per_s"]],
                   "llm_parameters": report["llm_parameters"],
                   "gpu_peak_bytes_by_process": report["gpu_peak_bytes_by_process"],
                   "service_gpu_memory": {k: b["service_metrics"].get(k) for k in (
                       "gpu_memory_budget_bytes", "gpu_memory_used_bytes", "gpu_memory_process_bytes")}}
    # Exit status 1 is a verdict that failed, 2 a run that could not finish: both fail the step.
    run.record("d", status, seconds, figures)


def step_e(run: Run) -> None:
    out = run.files / "levels"
    if run.cuda:
        size = ["--users", "1", "8", "64", "--seconds", "10", "--warmup-seconds", "5", "--count", "200000",
                "--dim", "128", "--server-arg=--gpu-budget-mb=8192"]
    else:
        size = ["--users", "1", "4", "--seconds", "2", "--warmup-seconds", "1", "--count", "1500", "--dim", "16",
                "--num-queries", "30"]
    status, seconds = run.run("e", [sys.executable, "-m", "fusionrag.loadtests.levels", "--out", str(out), *size])
    report = read_json(out / "levels.json") if (out / "levels.json").exists() else {}
    figures = {}
    if "levels" in report:
        figures = {"verdict_passed": report["passed"], "auto_over_cpu": report["auto_over_cpu"],
                   "auto_over_cpu_worst": report["auto_over_cpu_worst"], "failures": report["failures"],
                   "levels": {tier: {u: {"per_s": x["per_s"], "p99_ms": x["latency_ms"].get("p99"),
                                         "served_by": x["queries_by_filter_tier"]} for u, x in by.items()}
                              for tier, by in report["levels"].items()}}
    # Exit status 1 is a verdict that failed (auto below cpu somewhere), 2 a run that could not finish.
    run.record("e", status, seconds, figures, ok=status in (0, 1) and bool(figures))


RUNNERS = {"install": step_install, "a": step_a, "b": step_b, "c": step_c, "d": step_d, "e": step_e}


# -- the summary -------------------------------------------------------------------------------------

def _short(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    if isinstance(v, dict):
        return ", ".join(f"{k} {_short(x)}" for k, x in v.items() if x is not None)
    if isinstance(v, list):
        return "[" + ", ".join(_short(x) for x in v) + "]"
    return str(v)


MD_FIGURES = {
    "a": ("tests", "failures", "errors", "skipped", "failed"),
    "b": ("vectors", "dim", "after_first_merge", "after_second_merge", "checks", "gpu_memory", "phase_seconds"),
    "c": ("index", "gpu_search", "raw_vectors_resident", "measured_bandwidth_GBps", "scan_fraction_of_bandwidth",
          "stream_fraction_of_bandwidth", "kernel_compile_seconds", "gpu_tier_open_s", "gpu_tier_second_open_s",
          "second_open_kernel_compile_seconds",
          "gpu_tier_qps_at_recall_0.90", "gpu_tier_qps_at_recall_0.95", "cpu_tier_qps_at_recall_0.90",
          "cpu_tier_qps_at_recall_0.95", "lists_tier_qps_at_recall_0.90", "gpu_tier_raw_on_ssd_qps_at_recall_0.90",
          "gpu_tier_tenth_codes_resident_qps_at_recall_0.90", "exact_on_device", "gpu_over_cpu_at_0.90",
          "gpu_over_cpu_at_0.95", "gpu_over_exact_at_0.90", "lists_over_cpu_at_0.90",
          "tenth_resident_over_cpu_at_0.90", "raw_on_ssd_over_cpu_at_0.90", "by_call_size", "crossover",
          "auto_over_best_worst", "gpu_memory",
          "gpu_memory_tenth_codes_resident"),
    "d": ("verdict_passed", "verdict", "retrieval_p99_ms", "llm_tokens_per_s", "gpu_peak_bytes_by_process",
          "service_gpu_memory"),
    "e": ("verdict_passed", "auto_over_cpu", "auto_over_cpu_worst", "failures", "levels"),
}


def markdown(s: dict) -> str:
    verdict = {True: "every target met", False: "targets NOT met", None: "targets not all measured"}
    lines = [f"# GPU acceptance: steps {'PASSED' if s['passed'] else 'FAILED'}, {verdict[s.get('targets_met')]}", "",
             f"Device: **{s['device']}** (torch {s['torch']}, triton {s['triton']}, Python {s['python']}, "
             f"{s['cpus']} CPUs); {s['seconds']} s from {s['started']}.", "",
             "| step | what | outcome | seconds |", "|---|---|---|---|"]
    for name, r in s["steps"].items():
        lines.append(f"| {name} | {r['title']} | {r['outcome']} | {r['seconds']} |")
    t = s.get("targets") or {}
    met = {True: "met", False: "NOT met", None: "not measured"}
    lines += ["", f"Issue 47's targets (14's for co-location): {sum(x['met'] is True for x in t.values())} of {len(t)} met.", "",
              "| target | measured | wanted | |", "|---|---|---|---|"]
    lines += [f"| {x['what']} | {_short(x['measured'])} | {x['target']} | {met[x['met']]} |" for x in t.values()]
    for name, r in s["steps"].items():
        shown = [(k, r[k]) for k in MD_FIGURES.get(name, ()) if r.get(k) is not None]
        if shown:
            lines += ["", f"## {name}: {r['title']}", ""] + [f"- {k}: {_short(v)}" for k, v in shown]
    return "\n".join(lines) + "\n"


def merge(dirs: list[Path], out: Path) -> int:
    """One summary of several runs' summaries (a step run twice: the later run's)."""
    runs = sorted((read_json(d / "gpu_accept.json") for d in dirs), key=lambda r: r.get("started", ""))
    devices = {r.get("device") for r in runs}
    if len(devices) != 1:
        print(f"gpu_accept: runs on different devices: {sorted(map(str, devices))}", file=sys.stderr)
        return 2
    s = {**runs[-1], "steps": {}, "merged_from": [d.name for d in dirs]}
    for r in runs:
        s["steps"].update(r.get("steps", {}))
    s["steps"] = {k: s["steps"][k] for k in STEPS if k in s["steps"]}
    s["seconds"] = round(sum(r["seconds"] for r in s["steps"].values()), 1)
    s["passed"] = all(r["outcome"] in ("passed", "skipped") for r in s["steps"].values())
    write_summary(out, s)
    print(json.dumps({"passed": s["passed"], "steps": {k: r["outcome"] for k, r in s["steps"].items()}}))
    return 0 if s["passed"] else 1


# -- make gpu-wheels ----------------------------------------------------------------------------------

def wheels(dest: Path) -> int:
    """Download bench/gpu/gpu-wheels.txt's wheels into dest (one version of each: the folder is emptied
    first) and the data sets step a reads; print them and the total."""
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("*.whl"):
        old.unlink()
    platforms = [a for p in PLATFORMS for a in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(dest),
                    "-r", str(ROOT / "bench" / "gpu" / "gpu-wheels.txt")], check=True)
    data = Path(os.environ.get("FUSIONRAG_DATA", ROOT.parent / "shared" / "data"))
    for name in DATA_SETS:
        shutil.copytree(data / name, dest / "data" / name, dirs_exist_ok=True)
    found = sorted(dest.glob("*.whl"))
    total = sum(w.stat().st_size for w in found)
    for w in found:
        print(f"{w.stat().st_size / 2**20:8.2f} MiB  {w.name}")
    data_bytes = sum(f.stat().st_size for f in (dest / "data").rglob("*") if f.is_file())
    print(f"{len(found)} wheels, {total / 2**20:.1f} MiB (at most {WHEELS_MAX >> 20}); "
          f"data sets {data_bytes / 2**20:.1f} MiB; in {dest}")
    return 0 if total <= WHEELS_MAX else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="where gpu_accept.json, .md and the files go")
    ap.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated, of {','.join(STEPS)}")
    ap.add_argument("--deadline", type=float, default=1500.0, help="seconds the whole run may take")
    ap.add_argument("--colocate-seconds", type=int, default=45,
                    help="seconds each phase of step d measures on a GPU (its warm-up a quarter of that)")
    ap.add_argument("--merge", nargs="+", type=Path, help="summarize these runs' OUT folders into --out")
    ap.add_argument("--wheels", type=Path, help="download the GPU machine's wheels here, and stop")
    args = ap.parse_args(argv)
    if args.wheels:
        return wheels(args.wheels)
    if not args.out:
        ap.error("--out is required")
    out = Path(args.out)
    if args.merge:
        return merge(args.merge, out)
    steps = [s.strip() for s in args.steps.split(",") if s.strip()]
    unknown = [s for s in steps if s not in RUNNERS]
    if unknown:
        ap.error(f"unknown steps {unknown}; known: {','.join(STEPS)}")
    run = Run(out, args.deadline, args.colocate_seconds)
    try:
        for step in steps:
            print(f"gpu_accept: step {step}: {TITLES[step]}", flush=True)
            RUNNERS[step](run)
            print(f"gpu_accept: step {step}: {run.summary['steps'][step]['outcome']}", flush=True)
    finally:
        run.write()
        shutil.rmtree(run.files, ignore_errors=True)
    print(json.dumps({"device": run.summary["device"], "passed": run.summary["passed"],
                      "steps": {k: r["outcome"] for k, r in run.summary["steps"].items()}}))
    return 0 if run.summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
