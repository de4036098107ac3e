"""The malloc policy of processes fusionrag owns (retriever/process.py)."""

import subprocess
import sys

# The module is loaded from its file alone: importing the package first would change the heap the
# probe measures (its imports allocate and free on their own).
PROBE = """
import importlib.util, sys, numpy as np
spec = importlib.util.spec_from_file_location('process', sys.argv[2])
process = importlib.util.module_from_spec(spec); spec.loader.exec_module(process)
def rss_mib():
    for line in open('/proc/self/status'):
        if line.startswith('VmRSS'):
            return int(line.split()[1]) >> 10
if sys.argv[1] == 'policy':
    assert process.return_freed_memory()
a = np.ones(1 << 19); del a            # freeing a 4 MiB mapped block raises glibc's mmap threshold
base = rss_mib()
keep, big = [], []
for _ in range(32):                    # 32 x 2 MiB, each followed by a small block that stays live
    big.append(np.ones(1 << 18)); keep.append(np.ones(600))
del big
print(rss_mib() - base)
"""


def retained_mib(mode: str) -> int:
    from fusionrag.retriever import process

    out = subprocess.run([sys.executable, "-c", PROBE, mode, process.__file__], capture_output=True, text=True,
                         check=True)
    return int(out.stdout.strip())


def test_freed_batches_go_back_to_the_kernel():
    assert retained_mib("default") >= 32  # glibc's own policy keeps them: what the setting is for
    assert retained_mib("policy") <= 8
