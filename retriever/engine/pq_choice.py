"""The build's choice of PQ code width (BuildConfig.pq_bits 0, 'auto', the default): 8-bit codes, or 4-bit codes
in the same bytes (twice the sub-spaces, 16 centroids each), scanned 32 at a time with the table in registers
(native/scan4.h), kept only where calibration measures them as good and faster on this index.

Why by measurement: at the same bytes 4-bit codes ranked as well as 8-bit after the re-rank on MiniLM and GloVe
and scanned 1.3-3x as fast, but not on Fashion-MNIST's pixels (recall@10 0.929 against 0.965 at nprobe 24,
rerank 40; bench/results/peers/fastscan.md, pq4_search.md): no rule of dimension or metric told them apart.

How: a calibrated build trains 4-bit codebooks on a sample as the 8-bit ones were, encodes every row, and lays
them beside the index as a trial directory (the index's other files linked in). Calibration, once it has chosen
the search settings on the 8-bit index, searches both at those settings (the SSD path's, and RAM's at beta 0)
on the same sampled queries: the 4-bit codes are kept where at both their recall@10 lies within SLACK of the
8-bit codes' and its lower bound still reaches the target (or the 8-bit bound, where that falls short), and
their filter stage (tables and scan, the stages the codes change) takes at most GAIN of the 8-bit codes' time,
the best of ROUNDS alternated searches each. Otherwise the 8-bit codes stay; the manifest's calibration says
which and why ("pq_bits").

Where a GPU tier could serve the index (a CUDA device, or Triton's interpreter) 'auto' keeps 8-bit codes: the
lists tier (gpu_tier.py, where the device tier does not fit its budget) scans 8-bit codes only, and the device
tier's 4-bit scan (kernels/adc_stream.py) has been checked against its reference under the interpreter but not
yet measured on a GPU. So do builds that do not calibrate (calibrate off, fewer than
calibrate.MIN_ROWS rows), sharded builds, and codes of more than 128 bytes (256 sub-spaces at most).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np

from fusionrag.retriever.engine.config import BuildConfig
from fusionrag.retriever.engine.manifest import MANIFEST, rewrite_manifest, sha256_file
from fusionrag.retriever.engine.pq import KSUB4, ProductQuantizer

SLACK = 0.005  # recall@10 the 4-bit codes may lose against the 8-bit codes, at each setting measured
GAIN = 0.9  # the 4-bit codes' filter stage must take at most this share of the 8-bit codes' time
ROUNDS = 3  # alternated timed searches of each code at RAM's settings; the best of each counts
TRIAL = "pq4-trial"  # the trial directory, inside the index being written
CODE_FILES = ("pq_codes.npy", "pq_codebooks.npy")
TRAIN_SEED = 5  # the 4-bit codebooks' sample: config.seed + this (the build's own generator is left as it was)


def gpu_could_serve() -> bool:
    """Whether a GPU filter tier could serve an index opened here: a CUDA device, or Triton's CPU interpreter."""
    from fusionrag.kernels import interpreted
    from fusionrag.retriever.engine.tiers import cuda_available

    return interpreted() or cuda_available()


def why_eight(config: BuildConfig, n: int, pq_m: int, sample_queries, min_rows: int) -> str | None:
    """Why a build with these settings keeps 8-bit codes without measuring, or None where 'auto' measures.
    min_rows: the fewest rows calibration measures (calibrate.MIN_ROWS)."""
    if config.pq_bits:
        return f"pq_bits {config.pq_bits} asked for"
    if not config.calibrate:
        return "calibration off: nothing measures 4-bit codes"
    if sample_queries is None and n < min_rows:
        return f"fewer than {min_rows} rows: not calibrated"
    if 2 * pq_m > 256:
        return f"{pq_m}-byte codes: 4-bit codes have at most 256 sub-spaces (128 bytes)"
    if gpu_could_serve():
        return ("a GPU tier could serve this index (CUDA, or Triton's interpreter): 8-bit codes, which every GPU "
                "tier scans")
    return None


def train_trial(index_dir: Path, rows, n: int, pq_m: int, config: BuildConfig, chunk: int) -> Path:
    """4-bit codebooks of 2 * pq_m sub-spaces trained as the 8-bit ones were (config.pq_train_size rows), every row's
    codes (rows(ids), chunk rows at a time), both saved in index_dir/TRIAL (a directory made afresh). Returns it."""
    trial = Path(index_dir) / TRIAL
    shutil.rmtree(trial, ignore_errors=True)
    trial.mkdir()
    rng = np.random.default_rng(config.seed + TRAIN_SEED)
    sample = np.sort(rng.choice(n, min(n, config.pq_train_size), replace=False))
    pq = ProductQuantizer.train(rows(sample), 2 * pq_m, config.kmeans_iters, rng, ksub=KSUB4)
    np.save(trial / CODE_FILES[1], pq.codebooks, allow_pickle=False)
    codes = np.lib.format.open_memmap(trial / CODE_FILES[0], "w+", np.uint8, (n, pq.code_bytes))
    for s in range(0, n, chunk):
        ids = np.arange(s, min(n, s + chunk))
        codes[ids] = pq.encode(rows(ids))
    codes.flush()
    del codes
    return trial


def stage_trial(index_dir: Path, trial: Path) -> None:
    """The trial directory made an index: the staged index's other files linked in (copied where the file system
    links none), and its manifest with the 4-bit codes' shape and file sizes."""
    index_dir = Path(index_dir)
    manifest = json.loads((index_dir / MANIFEST).read_text())
    for name in manifest["files"]:
        if name in CODE_FILES:
            continue
        target = trial / name
        target.unlink(missing_ok=True)
        try:
            os.link(index_dir / name, target)
        except OSError:
            shutil.copyfile(index_dir / name, target)
    books = np.load(trial / CODE_FILES[1], mmap_mode="r", allow_pickle=False)
    manifest["pq"] = {"m": int(books.shape[0]), "dsub": int(books.shape[2]), "bits": 4}
    manifest["files"] = {**manifest["files"], **{name: {"bytes": (trial / name).stat().st_size,
                                                        "sha256": sha256_file(trial / name)} for name in CODE_FILES}}
    rewrite_manifest(trial, manifest, sync_dir=False)


def filter_seconds(res) -> float:
    """A search's seconds in the stages whose work the codes' width changes: the tables and the scan."""
    return float(np.sum(res.stats["lut_s"]) + np.sum(res.stats["scan_s"]))


def verdict(measured: dict, target: float) -> tuple[int, str]:
    """(bits kept, why) from compare's measurements: {8: {...}, 4: {...}}, each with "ssd" and "ram" (recall,
    recall_low) and "filter_s"."""
    for name in ("ssd", "ram"):
        eight, four = measured[8][name], measured[4][name]
        if four["recall"] < eight["recall"] - SLACK:
            return 8, (f"4-bit codes lost recall at the {name} settings: {four['recall']:.4f} against "
                       f"{eight['recall']:.4f} (at most {SLACK} allowed)")
        if four["recall_low"] < min(target, eight["recall_low"]):
            return 8, (f"4-bit codes' recall at the {name} settings has its lower bound {four['recall_low']:.4f} "
                       f"below the target {target}")
    t8, t4 = measured[8]["filter_s"], measured[4]["filter_s"]
    if t4 > GAIN * t8:
        return 8, f"4-bit codes' tables and scan took {t4 / max(t8, 1e-12):.2f}x the 8-bit codes' time (at most {GAIN})"
    return 4, (f"4-bit codes held recall (ram {measured[4]['ram']['recall']:.4f} against "
               f"{measured[8]['ram']['recall']:.4f}) and their tables and scan took {t4 / max(t8, 1e-12):.2f}x "
               "the time")


def adopt(w, manifest: dict) -> None:
    """Where the build's choice (manifest["pq_choice"]) kept 4-bit codes: the trial's codebooks and codes made the
    index's (w: the IndexWriter writing it; their entries recorded with the hashes stage_trial took) and the
    manifest's "pq" entry the trial's. The trial directory is removed either way."""
    trial = w.path(TRIAL)
    try:
        if (manifest.get("pq_choice") or {}).get("bits") == 4:
            staged = json.loads((trial / MANIFEST).read_text())
            for name in CODE_FILES:
                os.replace(trial / name, w.path(name))
                w.add_file(name, sha256=staged["files"][name]["sha256"])
            manifest["pq"] = staged["pq"]
    finally:
        shutil.rmtree(trial, ignore_errors=True)

