"""The C++ core (nanobind): navigation graph, CPU PQ scan, SSD page file, re-ranking, and query vectors of JSON.

Every entry point releases the GIL and runs on a persistent worker pool.
"""

from fusionrag.native._native import *  # noqa: F401,F403
