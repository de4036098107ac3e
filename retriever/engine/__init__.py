"""One index (docs/design.md): built offline from vectors into a directory (build, kmeans, pq, layout, manifest,
learned_probe, calibrate), opened for search as three tiers (tiers; the GPU's in gpu_tier and device_tier, chosen
per call by tier_choice) behind one pipeline (index, pipeline, overlap, queries, filtering), and grown by merge.
config declares every knob. Nothing here imports the collection or sharded layers.
"""

from fusionrag.lazy import face

__all__ = ["BuildConfig", "EngineConfig", "Index", "SearchParams", "SearchResult", "build_index", "open_vectors"]
__getattr__, __dir__ = face(__name__, {
    **dict.fromkeys(["BuildConfig", "EngineConfig", "SearchParams"], "config"),
    **dict.fromkeys(["Index", "SearchResult"], "index"),
    "build_index": "build",
    "open_vectors": "vectors",
})
