"""GPU memory under a budget: everything a filter tier holds is taken from a `DeviceBudget` at
start-up, and queries run in fixed working blocks, so the tier never grows while serving. One
budget serves several tiers (one per open index) through a `BudgetAccount` each, which names
their parts and gives them back when the tier closes.

A process's own budget (`measured`) also holds what the process really holds on the device
beside the parts: the CUDA context, loaded kernel modules and the allocator's rounding, as the
driver counts them (`process_gpu_bytes`, nvidia-smi's per-process figure), trued up whenever a
tier opens (`true_up`).

A `WorkingBlock` is one in-flight batch's memory: a device arena and a host staging arena
(pinned on CUDA, so copies are asynchronous) carved into typed views per call, and its own CUDA
stream, so batches in different blocks copy and compute at the same time. `BlockPool` hands
blocks out; take and give are a deque's pop and append, atomic under the GIL, so the hot path
takes no lock. Only a caller finding every block busy waits.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections import deque

import torch

ALIGN = 256  # bytes: every view starts aligned for any dtype and for coalesced access
OVERHEAD = "CUDA context, kernels and allocator"  # a measured budget's part beside its holders' parts


class BudgetError(ValueError):
    """The budget cannot hold what was asked of it."""


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class _Reserving:
    """Tensors taken from a budget: `reserve` counts their bytes first, so nothing is allocated
    that the budget cannot hold."""

    device: torch.device

    def reserve(self, what: str, nbytes: int) -> None:
        raise NotImplementedError

    def empty(self, what: str, shape, dtype: torch.dtype) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype, device="meta")
        self.reserve(what, _aligned(t.numel() * t.element_size()))
        return torch.empty(shape, dtype=dtype, device=self.device)

    def upload(self, what: str, src: torch.Tensor) -> torch.Tensor:
        """A copy of a host tensor, inside the budget."""
        out = self.empty(what, src.shape, src.dtype)
        out.copy_(src)
        return out


class DeviceBudget(_Reserving):
    """Bytes of one device this process may hold, and the running and peak totals. Several
    holders share it through accounts (`account`), each giving its bytes back on `release`.
    measured: on CUDA, the budget also holds what the driver counts for the process beyond the
    parts (`true_up`); the process's one budget per device is, a budget made for a test is not."""

    def __init__(self, device: torch.device, budget_bytes: int, measured: bool = False):
        if budget_bytes <= 0:
            raise BudgetError(f"a GPU memory budget must be positive, got {budget_bytes} bytes")
        self.device, self.budget = torch.device(device), int(budget_bytes)
        self.measured = measured and self.device.type == "cuda"
        self.used = self.peak = 0
        self.parts: dict[str, int] = {}
        self.owners: set[str] = set()
        self._lock = threading.Lock()  # holders open, reserve and release from any thread
        self.opening = threading.Lock()  # held by a holder sizing its share from what is left
        self._process = (0.0, None)  # (when, process_gpu_bytes) last read, for `process_bytes`

    @property
    def left(self) -> int:
        return self.budget - self.used

    def resize(self, budget_bytes: int) -> None:
        """A new size for a budget no one holds an account in; the peak stays the process's."""
        with self._lock:
            if self.owners:
                raise BudgetError(f"a GPU memory budget held by {', '.join(sorted(self.owners))} cannot be resized")
            if budget_bytes <= 0:
                raise BudgetError(f"a GPU memory budget must be positive, got {budget_bytes} bytes")
            self.budget = int(budget_bytes)

    def reserve(self, what: str, nbytes: int) -> None:
        with self._lock:
            if self.used + nbytes > self.budget:
                raise BudgetError(
                    f"GPU memory budget of {self.budget} bytes is too small: {what} needs {nbytes} bytes and "
                    f"{self.budget - self.used} are left after {self._held()}")
            self.used += nbytes
            self.peak = max(self.peak, self.used)
            self.parts[what] = self.parts.get(what, 0) + nbytes

    def release(self, what: str) -> None:
        """Give back every byte reserved as `what`."""
        with self._lock:
            self.used -= self.parts.pop(what, 0)

    def true_up(self) -> None:
        """Set the OVERHEAD part to what the process holds on the device beyond the other parts
        (the CUDA context, kernel modules, the allocator's rounding), as the driver counts it; where
        the driver gives no per-process figure, to what torch's allocator holds beyond them. A
        measured budget's holder calls this when it opens, before sizing its share from what is
        left and after allocating it; BudgetError when the budget cannot hold it."""
        if not self.measured:
            return
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # freed blocks are torch's cache, not anyone's memory
        held = process_gpu_bytes(self.device, nvidia_smi=True)
        if held is None:
            held = torch.cuda.memory_reserved(self.device)
        with self._lock:
            booked = self.used - self.parts.get(OVERHEAD, 0)
            overhead = _aligned(max(0, held - booked))
            if booked + overhead > self.budget:
                raise BudgetError(
                    f"GPU memory budget of {self.budget} bytes is too small: this process holds {held} bytes on "
                    f"{self.device}, {overhead} of them beyond {self._held()} (the CUDA context, kernels, the "
                    "allocator's rounding)")
            self.parts[OVERHEAD] = overhead
            self.used = booked + overhead
            self.peak = max(self.peak, self.used)

    def process_bytes(self) -> int | None:
        """process_gpu_bytes from NVML, read at most once a second: searches report it."""
        if self.device.type != "cuda":
            return None
        when, value = self._process
        if time.monotonic() - when > 1.0:
            value = process_gpu_bytes(self.device)
            self._process = (time.monotonic(), value)
        return value

    def account(self, owner: str) -> "BudgetAccount":
        """A holder's share of this budget; its parts are named `owner: part` here (the owner gets a
        suffix when another open account has its name)."""
        with self._lock:
            name, n = owner, 1
            while name in self.owners:
                n += 1
                name = f"{owner} #{n}"
            self.owners.add(name)
        return BudgetAccount(self, name)

    def _close_account(self, owner: str) -> None:
        with self._lock:
            self.owners.discard(owner)

    def _held(self) -> str:
        """What is held, and by whom: parts named `owner: part` are grouped by owner."""
        groups: dict[str, dict[str, int]] = {}
        for key, n in self.parts.items():
            owner, _, what = key.rpartition(": ")
            groups.setdefault(owner, {})[what] = n
        said = []
        for owner, parts in groups.items():
            listed = ", ".join(f"{what} ({n} bytes)" for what, n in parts.items())
            said.append(f"{owner} holds {sum(parts.values())} bytes: {listed}" if owner else listed)
        return "; ".join(said) or "nothing"


class BudgetAccount(_Reserving):
    """One holder's reservations in a shared DeviceBudget."""

    def __init__(self, budget: DeviceBudget, owner: str):
        self.budget, self.owner, self.device = budget, owner, budget.device
        self.parts: dict[str, int] = {}
        self.closed = False

    @property
    def used(self) -> int:
        return sum(self.parts.values())

    def reserve(self, what: str, nbytes: int) -> None:
        if self.closed:
            raise BudgetError(f"the GPU memory account of {self.owner} is closed")
        self.budget.reserve(f"{self.owner}: {what}", nbytes)
        self.parts[what] = self.parts.get(what, 0) + nbytes

    def release(self) -> None:
        """Give every part back to the budget and close the account (idempotent)."""
        for what in self.parts:
            self.budget.release(f"{self.owner}: {what}")
        self.parts.clear()
        if not self.closed:
            self.closed = True
            self.budget._close_account(self.owner)


class WorkingBlock:
    def __init__(self, budget: _Reserving, index: int, device_bytes: int, host_bytes: int):
        self.arena = budget.empty(f"working block {index}", (device_bytes,), torch.uint8)
        cuda = budget.device.type == "cuda"
        self.staging = torch.empty((host_bytes,), dtype=torch.uint8, pin_memory=cuda)
        self.stream = torch.cuda.Stream(budget.device) if cuda else None
        self._dev = self._host = 0

    @property
    def device_bytes(self) -> int:
        return self.arena.numel()

    @property
    def host_bytes(self) -> int:
        return self.staging.numel()

    def mark(self) -> int:
        """Device bytes carved so far: a later reset(mark) keeps those views."""
        return self._dev

    def reset(self, keep_device: int = 0) -> None:
        """Forget the views carved so far, except the first keep_device device bytes."""
        self._dev, self._host = keep_device, 0

    def device(self, shape, dtype: torch.dtype) -> torch.Tensor:
        t, self._dev = self._carve(self.arena, self._dev, shape, dtype)
        return t

    def host(self, shape, dtype: torch.dtype) -> torch.Tensor:
        t, self._host = self._carve(self.staging, self._host, shape, dtype)
        return t

    @staticmethod
    def _carve(arena: torch.Tensor, at: int, shape, dtype: torch.dtype):
        count = 1
        for s in (shape if isinstance(shape, (tuple, list)) else (shape,)):
            count *= int(s)
        nbytes = count * torch.empty((), dtype=dtype).element_size()
        end = at + _aligned(nbytes)
        if end > arena.numel():
            raise BudgetError(f"a working block of {arena.numel()} bytes cannot hold {end} bytes of views")
        return arena[at:at + nbytes].view(dtype).view(shape), end


class BlockPool:
    def __init__(self, budget: _Reserving, blocks: int, device_bytes: int, host_bytes: int):
        if blocks < 1:
            raise BudgetError(f"the pool needs at least one working block, got {blocks}")
        self.blocks = [WorkingBlock(budget, i, device_bytes, host_bytes) for i in range(blocks)]
        self._free = deque(self.blocks)
        self._returned = threading.Condition()
        self._waiting = 0

    def take(self) -> WorkingBlock:
        while True:
            try:
                return self._free.pop()
            except IndexError:
                with self._returned:  # every block is in flight: the one slow path
                    self._waiting += 1
                    # A give() between the pop and here notifies no one: the timeout bounds that.
                    self._returned.wait(timeout=0.005)
                    self._waiting -= 1

    def give(self, block: WorkingBlock) -> None:
        self._free.append(block)
        if self._waiting:
            with self._returned:
                self._returned.notify()


_nvml = None  # the pynvml module once initialised, False where it cannot be


def process_gpu_bytes(device: torch.device, nvidia_smi: bool = False) -> int | None:
    """What this process holds on a CUDA device as the driver counts it (nvidia-smi's per-process
    used memory): from NVML through the nvidia-ml-py package, else, when nvidia_smi (slow: a
    subprocess), from nvidia-smi itself; None where neither lists this process."""
    global _nvml
    try:
        index = torch.cuda._get_nvml_device_index(device)
    except Exception:  # CUDA_VISIBLE_DEVICES by UUID without NVML: the CUDA index
        index = torch.device(device).index or 0
    if _nvml is None:
        try:
            import pynvml

            pynvml.nvmlInit()
            _nvml = pynvml
        except Exception:
            _nvml = False
    if _nvml:
        try:
            handle = _nvml.nvmlDeviceGetHandleByIndex(index)
            for p in _nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if p.pid == os.getpid() and p.usedGpuMemory is not None:
                    return int(p.usedGpuMemory)
        except Exception:
            pass
    if nvidia_smi:
        try:
            out = subprocess.run(["nvidia-smi", "-i", str(index), "--query-compute-apps=pid,used_memory",
                                  "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            return None
        for line in out.splitlines():
            pid, _, mib = line.partition(",")
            if pid.strip() == str(os.getpid()) and mib.strip().isdigit():
                return int(mib) << 20
    return None
