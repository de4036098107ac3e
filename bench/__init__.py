"""The benchmarks: the harness they share (bench/harness) and the studies, grouped by topic. Run from the
repository root as modules, `python -m bench.<topic>.<study> --help`."""
