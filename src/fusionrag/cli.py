"""The `fusionrag` command: build, search, info, and serve (the HTTP service of the server package)."""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from fusionrag.retriever.engine.config import (METRICS, BuildConfig, EngineConfig, SearchParams, add_flags, flags_of,
                                               knobs)
from fusionrag.retriever.errors import ConfigError, FusionRAGError
from fusionrag.retriever.sharded.parts import PLACEMENTS


def pq_bytes(manifest: dict) -> int:
    """A build's PQ bytes a vector: its sub-spaces, half of them (rounded up) for 4-bit codes."""
    from fusionrag.retriever.engine.pq import KSUB, KSUB4, code_bytes

    pq = manifest["pq"]
    return code_bytes(int(pq["m"]), KSUB4 if pq.get("bits", 8) == 4 else KSUB)


def _cmd_build(args) -> int:
    from fusionrag.retriever.engine.build import build_index

    given = flags_of(args, BuildConfig)
    if args.embedding and "metric" not in given:
        given["metric"] = "cosine"  # as a collection made with a model is, unless told otherwise
    config = BuildConfig().with_overrides(**given)
    if args.shards:
        return _build_sharded(args, config)
    if args.documents or args.embedding:
        raise ConfigError("--documents and --embedding are a sharded build's (with --shards); a collection takes its "
                          "documents by import (fusionrag import, or POST /v1/collections/NAME/import)")
    from fusionrag.retriever.engine.vectors import open_vectors

    sample = open_vectors(args.sample_queries)[:] if args.sample_queries else None
    m = build_index(args.source, args.index_dir, config, progress=False if args.quiet else None,
                    overwrite=args.overwrite, sample_queries=sample, resume=args.resume)
    print(json.dumps({"index": args.index_dir, "count": m["count"], "dim": m["dim"], "metric": m["metric"],
                      "resumed_after": m.get("build_resumed", []),
                      "centroids": m["centroids"], "postings": m["postings"], "pq_m": pq_bytes(m),
                      "pq_bits": m["pq"].get("bits", 8), "pq_bits_why": (m.get("pq_choice") or {}).get("why"),
                      "blocks": m["pages"]["num_blocks"], "build_seconds": round(m["build_timings"]["total_s"], 3),
                      "timings": {k: round(v, 3) for k, v in m["build_timings"].items()}}))
    return 0


def _connect_ray(address: str | None) -> None:
    if address:
        from fusionrag.retriever.sharded.actors import require_ray

        ray = require_ray()
        if not ray.is_initialized():
            ray.init(address=address, log_to_driver=False)


def _build_sharded(args, config: BuildConfig) -> int:
    from fusionrag.retriever.engine.vectors import open_vectors
    from fusionrag.retriever.sharded.build import build_sharded

    _connect_ray(args.ray)
    sample = open_vectors(args.sample_queries)[:] if args.sample_queries else None
    source, documents = args.source, args.documents
    if source.endswith((".jsonl", ".ndjson")):  # documents, their vectors in their lines or made from their texts
        if documents:
            raise ConfigError(f"{source} is a JSON-lines file of documents, the build's source: --documents then "
                              "names nothing more")
        source, documents = None, args.source
    m = build_sharded(source, args.index_dir, args.shards, config, args.placement, args.replicate, sample,
                      use_ray=bool(args.ray), progress=False if args.quiet else None, overwrite=args.overwrite,
                      probe_model=args.probe_model is not False, documents=documents, embedding=args.embedding)
    print(json.dumps({"index": args.index_dir, "count": m["count"], "dim": m["dim"], "metric": m["metric"],
                      "centroids": m["centroids"], "postings": m["postings"], "pq_m": pq_bytes(m),
                      "pq_bits": m["pq"].get("bits", 8),
                      "shards": m["shards"], "placement": m["placement"], "embedding": m.get("embedding"),
                      "parts": {name: {"count": p["count"], "lists": p["lists"]} for name, p in m["parts"].items()},
                      "build_seconds": round(m["build_timings"]["total_s"], 3),
                      "timings": {k: round(v, 3) for k, v in m["build_timings"].items()}}))
    return 0


def _search_sharded(args, engine: dict, given: dict, queries: np.ndarray) -> tuple[np.ndarray, dict]:
    from fusionrag.retriever.sharded.router import ShardedIndex

    _connect_ray(args.ray)
    index = ShardedIndex.open(args.index_dir, EngineConfig().with_overrides(**engine), ray=bool(args.ray))
    try:
        params = index.params.with_overrides(**given)  # over the router's calibrated defaults
        t = time.perf_counter()
        res = index.search(queries, args.k, params)
        seconds = time.perf_counter() - t
    finally:
        index.close()
    work = res.per_shard["work"]
    return res.ids, {
        "queries": len(queries), "k": args.k, "seconds": round(seconds, 6), "qps": round(len(queries) / seconds, 2),
        "params": params.to_dict(), "shards": index.n_shards,
        "mode": "ray" if args.ray else "local",
        "per_query": {key: round(float(v.mean()), 4) for key, v in res.stats.items()},
        "per_shard": {key: v.tolist() for key, v in res.per_shard.items()},
        "work_imbalance": round(float(work.max() / work.mean()), 4) if work.mean() > 0 else 1.0,
    }


def _read_ids(path: str) -> np.ndarray:
    from fusionrag.retriever.engine.vectors import open_vectors

    return np.asarray(open_vectors(path)[:], dtype=np.int64)


def _cmd_search(args) -> int:
    from fusionrag.retriever import Index, open_vectors

    engine = flags_of(args, EngineConfig, skip=("buffer_bytes",))
    if args.buffer_mb is not None:
        engine["buffer_bytes"] = int(args.buffer_mb * (1 << 20))
    given = flags_of(args, SearchParams)  # over the index's own defaults (what its build's calibration chose)
    params = SearchParams().with_overrides(**given)  # checked before anything opens
    from fusionrag.retriever.directory import is_sharded

    sharded = is_sharded(args.index_dir)
    if args.ray and not sharded:
        raise FusionRAGError(f"{args.index_dir}: --ray searches a sharded index (build it with --shards)")
    if not sharded:
        index = Index.open(args.index_dir, EngineConfig().with_overrides(**engine))
        params = index.params.with_overrides(**given)
    queries = open_vectors(args.queries)[:]
    if args.limit:
        queries = queries[: args.limit]
    if sharded:
        result_ids, report = _search_sharded(args, engine, given, queries)
    else:
        t = time.perf_counter()
        res = index.search(queries, args.k, params)
        seconds = time.perf_counter() - t
        result_ids = res.ids
        stats = {key: (round(float(v.sum()), 6) if key.endswith("_s") else int(v.sum())) for key, v in res.stats.items()}
        report = {
            "queries": len(queries), "k": args.k, "seconds": round(seconds, 6), "qps": round(len(queries) / seconds, 2),
            "params": params.to_dict(), "threads": index.nav.threads, **res.info,
            "stats": stats,
            "per_query": {key: round(v / len(queries), 4) for key, v in stats.items()},
            "memory": index.memory(),
        }
    np.save(args.out, result_ids)
    if args.groundtruth:
        gt = _read_ids(args.groundtruth)[: len(queries), : args.k]
        if gt.shape != (len(queries), args.k):
            raise FusionRAGError(f"{args.groundtruth}: ground truth has shape {gt.shape}, need ({len(queries)}, >= {args.k})")
        hits = sum(len(np.intersect1d(a, b)) for a, b in zip(result_ids, gt))
        report[f"recall@{args.k}"] = round(hits / gt.size, 5)
    print(json.dumps(report))
    return 0


def _cmd_info(args) -> int:
    from fusionrag.retriever import Index
    from fusionrag.retriever.directory import is_sharded
    from fusionrag.retriever.sharded.router import ShardedIndex

    if is_sharded(args.index_dir):  # the router's manifest, and what each shard (opened here) holds in memory
        engine = EngineConfig().with_overrides(verify=not args.no_verify, filter_tier=args.filter_tier)
        index = ShardedIndex.open(args.index_dir, engine)
        try:
            m = {key: v for key, v in index.manifest.items() if key != "files"}
            memory = {"router_graph_bytes": index.nav.memory_bytes(),
                      "shards": [s.index.memory() for s in index.shards]}
            params = index.params.to_dict()
        finally:
            index.close()
        print(json.dumps({**m, "search_params": params, "memory": memory}, indent=1))
        return 0
    index = Index.open(args.index_dir, verify=not args.no_verify, filter_tier=args.filter_tier)
    m = dict(index.manifest)
    m.pop("files", None)
    # search_params: the settings a search of it opened so takes (search_defaults_ram where its raw vectors are in RAM)
    print(json.dumps({**m, "search_params": index.params.to_dict(), "memory": index.memory()}, indent=1))
    return 0


def _cmd_calibrate(args) -> int:
    from fusionrag.retriever.directory import recalibrate
    from fusionrag.retriever.engine.vectors import open_vectors

    log = open_vectors(args.sample_queries)[:] if args.sample_queries else None
    cal = recalibrate(args.index_dir, log, args.calibrate_queries, args.target_recall, args.threads)
    print(json.dumps({"index": args.index_dir, **cal}))
    return 0


def _cmd_snapshot(args) -> int:
    from fusionrag.retriever.directory import catalog as open_catalog

    catalog = open_catalog(args.data_dir)
    try:
        print(json.dumps(catalog.get(args.collection).snapshot(args.out)))
    finally:
        catalog.close()
    return 0


def _cmd_restore(args) -> int:
    from fusionrag.retriever.directory import catalog as open_catalog

    catalog = open_catalog(args.data_dir)
    try:
        with open(args.archive, "rb") as f:
            print(json.dumps(catalog.restore(args.collection, f).info()))
    finally:
        catalog.close()
    return 0


def _cmd_import(args) -> int:
    from fusionrag.retriever.directory import catalog as open_catalog
    from fusionrag.retriever.errors import InputError

    catalog = open_catalog(args.data_dir)
    try:
        if args.collection in catalog.names():
            col = catalog.get(args.collection)
        else:  # made for the import: its dimension from the vector file, the model, or --dimension
            dim = args.dimension
            if dim is None and args.vectors:
                from fusionrag.retriever.engine.vectors import open_vectors

                dim = open_vectors(args.vectors).dim
            if dim is None and args.embedding:
                from fusionrag.retriever.collection.embedding import get_embedder

                dim = get_embedder(args.embedding).dim
            if dim is None and args.documents:  # the first line's vector (InputError naming the line if none)
                from fusionrag.retriever.collection.importer import first_vector_dim

                dim = first_vector_dim(args.documents)
            if dim is None:
                raise InputError(f"collection {args.collection!r} does not exist: give --vectors, --embedding or "
                                 "--dimension to make it")
            col = catalog.create(args.collection, dim, args.metric, args.embedding, shards=args.shards)
        print(json.dumps(col.import_files(args.documents, args.vectors, progress=False if args.quiet else None)))
    finally:
        catalog.close()
    return 0


def _cmd_serve(args) -> int:
    from fusionrag.server.config import flags_of, load_config

    config = load_config(args.config, flags_of(args))
    if args.ray:
        if not args.index:
            raise ConfigError("serve --ray needs --index, the sharded index directory every node sees")
        try:
            from fusionrag.server.ray_serve import serve as serve_on_ray
        except ImportError as e:
            raise FusionRAGError(f"serve --ray needs the ray and server extras (pip install "
                                 f"'fusionrag[ray,server]'): {e}") from e
        from fusionrag.server.auth import KeyRing

        serve_on_ray(args.ray, args.index, host=config.host, port=config.port, name=args.name,
                     keys=KeyRing.from_config(config.api_keys, config.api_keys_file), routers=args.routers,
                     proxy_location=args.proxy_location, config=config)
        return 0
    if args.index or args.name or args.routers != 1 or args.proxy_location != "HeadOnly":
        raise ConfigError("--index, --name, --routers and --proxy-location go with --ray (serving a sharded index); "
                          "the service serves the collections of --data-dir")
    try:
        from fusionrag.server.main import serve
    except ImportError as e:
        raise FusionRAGError(f"the service needs the server extras (pip install 'fusionrag[server]'): {e}") from e
    serve(config)
    return 0


def _cmd_plan(args) -> int:
    from fusionrag.retriever.engine.plan import markdown, plan

    sizes = [int(float(x)) for x in args.n]
    devices = ["h100", "h200"] if args.device == "both" else [args.device]
    plans = [plan(n, args.dim, args.pq_m, device, device_bytes=None if args.device_gb is None else
                  int(args.device_gb * 1e9), budget_bytes=None if args.budget_gb is None else int(args.budget_gb * 1e9),
                  centroid_ratio=args.centroid_ratio, metric=args.metric, cpus=args.cpus,
                  build_budget_bytes=int(args.build_budget_gb * 1e9))
             for device in devices for n in sizes]
    if args.json:
        print(json.dumps([p.to_dict() for p in plans]))
    else:
        print(markdown(plans))
        for p in plans:
            for note in p.notes:
                print(f"- {p.n:,} on {p.device}: {note}")
    return 0 if all(p.fits for p in plans) else 3


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fusionrag", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    b = sub.add_parser("build", help="build an index from a vector file")
    b.add_argument("source", help="vector file: .fvecs .bvecs .fbin .u8bin .i8bin .npy; with --shards also a JSON-lines "
                   "file of documents (.jsonl, .ndjson: id, text, metadata, and a vector or a text to embed)")
    b.add_argument("index_dir")
    b.add_argument("--overwrite", action="store_true", help="replace an existing index (atomically)")
    b.add_argument("--quiet", action="store_true", help="no progress bars (they are drawn when stderr is a terminal)")
    b.add_argument("--resume", action=argparse.BooleanOptionalAction, default=True,
                   help="go on from the last finished step of a build of the same source and settings into this "
                   "index_dir that was killed (its .NAME.partial directory beside it; the default); --no-resume "
                   "starts over")
    b.add_argument("--shards", type=int, default=0, help="build a sharded index of this many shard parts "
                   "(docs/sharded.md)")
    b.add_argument("--placement", default="hotness", choices=list(PLACEMENTS),
                   help="with --shards: lists placed by expected work (hotness, SmartANNS), by region of "
                   "centroid space with work balanced (locality), or round-robin")
    b.add_argument("--replicate", type=float, default=0.02,
                   help="with --shards: fraction of lists, hottest first, given a replica on a second shard")
    b.add_argument("--sample-queries", help="a query file (a query log): the probe model is trained on it, "
                   "calibration measures it, and with --shards list hotness is measured with it (default: rows of "
                   "the source)")
    b.add_argument("--ray", metavar="ADDRESS", help="with --shards: run the build's tasks on this Ray cluster")
    b.add_argument("--documents", help="with --shards: a JSON-lines file, line i describing vector i (id, text, "
                   "metadata): the built vectors are those documents (docs/sharded.md, Documents)")
    b.add_argument("--embedding", help="with --shards: the embedding model that made the vectors, or that embeds "
                   "the texts of a JSON-lines source; the sharded collection then embeds texts written or searched "
                   "without a vector (the metric defaults to cosine then)")
    add_flags(b, BuildConfig)
    b.set_defaults(run=_cmd_build)

    s = sub.add_parser("search", help="search an index with a query file; prints one JSON line")
    s.add_argument("index_dir")
    s.add_argument("queries", help="query vector file")
    s.add_argument("--k", type=int, default=10)
    s.add_argument("--out", required=True, help="where to write the int64 (queries x k) ids, .npy")
    s.add_argument("--groundtruth", help="ground-truth ids (.ivecs, .ibin or .npy) to report recall@k")
    s.add_argument("--limit", type=int, default=0, help="use only the first N queries")
    s.add_argument("--buffer-mb", type=float, default=None, help="DRAM page buffer, MiB (default 64, at most an eighth of the memory the process may use)")
    s.add_argument("--ray", metavar="ADDRESS", help="a sharded index: its shards as actors on this Ray cluster "
                   "(default: in this process)")
    add_flags(s, SearchParams)
    add_flags(s, EngineConfig, skip=("buffer_bytes",))
    s.set_defaults(run=_cmd_search)

    i = sub.add_parser("info", help="print an index's manifest and memory per tier")
    i.add_argument("index_dir")
    i.add_argument("--no-verify", action="store_true", help="skip the checksum pass")
    tier = knobs(EngineConfig)["filter_tier"]
    i.add_argument("--filter-tier", default=None, metavar="{" + ",".join(tier.choices) + "}", help=tier.help)
    i.set_defaults(run=_cmd_info)

    c = sub.add_parser("calibrate", help="measure an index's default search settings again (on a query log, or "
                       "its rows) and write them into its manifest (a sharded index's: its router's)")
    c.add_argument("index_dir")
    c.add_argument("--sample-queries", help="a query file (a query log) to calibrate on (default: rows of the index)")
    c.add_argument("--calibrate-queries", type=int, help="queries to measure (default: the build's, 500)")
    c.add_argument("--target-recall", type=float, help="recall@10 to reach (default: the build's, 0.95)")
    c.add_argument("--threads", type=int, default=0, help="threads (0: all cores)")
    c.set_defaults(run=_cmd_calibrate)

    pl = sub.add_parser("plan", help="a capacity plan: what an index of N vectors puts on the GPU, in host RAM and "
                        "on the SSD, its build's memory and time, and the q/s the cost model predicts (docs/gpu.md)")
    pl.add_argument("--n", nargs="+", default=["1e9"], help="vectors (one or more; 1e9 style allowed)")
    pl.add_argument("--dim", type=int, default=128)
    pl.add_argument("--pq-m", type=int, default=0, help="PQ bytes a vector (0: the build's choice, dim/2 at most 64)")
    pl.add_argument("--device", default="h100", help="h100 (80 GB), h200 (141 GB), both, or a name with --device-gb")
    pl.add_argument("--device-gb", type=float, help="the device's memory, GB (for a device not named)")
    pl.add_argument("--budget-gb", type=float, help="GPU memory the process may take, GB (default: the device's)")
    pl.add_argument("--centroid-ratio", type=float, default=None,
                    help="posting-list centroids per vector (default: the build's 0.1 below 100M vectors, 0.01 from "
                         "100M: plan.default_ratio)")
    pl.add_argument("--metric", default="l2", choices=list(METRICS))
    pl.add_argument("--cpus", type=int, default=16, help="the serving machine's CPUs (the host re-rank's bound)")
    pl.add_argument("--build-budget-gb", type=float, default=0.0,
                    help="the build's working memory (memory_budget_bytes), GB: added to its peak")
    pl.add_argument("--json", action="store_true", help="every figure as JSON")
    pl.set_defaults(run=_cmd_plan)

    offline = "Works on a data directory no service has open (a running service has the same over HTTP)."
    sn = sub.add_parser("snapshot", help="write a snapshot of a collection to one archive", description=offline)
    sn.add_argument("data_dir", help="the service's data directory")
    sn.add_argument("collection")
    sn.add_argument("out", help="the archive to write (.tar)")
    sn.set_defaults(run=_cmd_snapshot)

    rs = sub.add_parser("restore", help="a new collection from a snapshot archive", description=offline)
    rs.add_argument("data_dir", help="the service's data directory")
    rs.add_argument("archive")
    rs.add_argument("--collection", required=True, help="the name of the collection to make")
    rs.set_defaults(run=_cmd_restore)

    im = sub.add_parser("import", help="bulk-import documents into a new or empty collection", description=offline +
                        " Documents: JSON lines of {id, text, metadata, vector} (a line without a vector is embedded by "
                        "the collection's model), or a vector file with those lines (without vectors) as a sidecar.")
    im.add_argument("data_dir", help="the service's data directory")
    im.add_argument("--collection", required=True)
    im.add_argument("--documents", help="JSON-lines file of documents")
    im.add_argument("--vectors", help="vector file: .fvecs .bvecs .fbin .u8bin .i8bin .npy (row i: line i of --documents)")
    im.add_argument("--dimension", type=int, help="for a collection made by the import (default: from the vectors, "
                                                  "the model, or the first line's vector)")
    im.add_argument("--metric", default="cosine", choices=METRICS, help="for a collection made by the import")
    im.add_argument("--embedding", help="embedding model, for a collection made by the import")
    im.add_argument("--shards", type=int, help="make it a sharded collection of this many shards (docs/sharded.md; "
                                               "default: a collection)")
    im.add_argument("--quiet", action="store_true", help="no progress bars (they are drawn when stderr is a terminal)")
    im.set_defaults(run=_cmd_import)

    v = sub.add_parser("serve", help="run the retrieval service (HTTP), with a demo collection on a first start",
                       description="Settings come from flags, then FUSIONRAG_* environment variables, then the "
                                   "TOML file of --config, then defaults.")
    from fusionrag.server.config import add_arguments

    add_arguments(v)
    ray = v.add_argument_group("sharded mode (docs/sharded.md)")
    ray.add_argument("--ray", metavar="ADDRESS", help="serve a sharded index from the Ray cluster at ADDRESS "
                     "(host:port of its head): the router as a Ray Serve deployment, the shards as Ray actors")
    ray.add_argument("--index", metavar="DIR", help="with --ray: the sharded index directory, on storage every "
                     "node sees")
    ray.add_argument("--name", help="with --ray: the collection's name (default: the directory's)")
    ray.add_argument("--routers", type=int, default=1, metavar="N",
                     help="with --ray: replicas of the router (default 1); more than one: vector searches on every "
                          "replica, writes on one that leads")
    ray.add_argument("--proxy-location", choices=("HeadOnly", "EveryNode"), default="HeadOnly",
                     help="with --ray: Ray Serve's HTTP proxies: on the head node only (default), or one on every "
                          "node (each node's clients then reach its own router replica)")
    v.set_defaults(run=_cmd_serve)

    from fusionrag.loadtests.runner import add_arguments as add_loadtest_arguments

    add_loadtest_arguments(sub.add_parser("loadtest", help="run a Locust load test against the service; write a report"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.run in (_cmd_build, _cmd_search, _cmd_serve, _cmd_import, _cmd_calibrate):
        from fusionrag.retriever.process import return_freed_memory

        return_freed_memory()
    try:
        return args.run(args)
    except (FusionRAGError, FileExistsError) as e:
        print(f"fusionrag: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"fusionrag: error: {e}", file=sys.stderr)
        return 1
