"""GPU memory as nvidia-smi reports it, for benchmarks: the device in all, or each process (a server beside its
reference server on one GPU), sampled while a load runs. Never used while serving."""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Callable

# nvidia-smi's own query: every process with a CUDA context, and the device memory it holds (MiB).
PROCESS_QUERY = ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]
DEVICE_QUERY = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"]


def _smi(command: list[str]) -> str | None:
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def device_used_mib() -> int | None:
    """The first device's used memory, or None without an NVIDIA GPU."""
    out = _smi(DEVICE_QUERY)
    return int(out.split()[0]) if out and out.split() else None


def parse_process_mib(out: str) -> dict[int, int]:
    """`pid, MiB` lines of PROCESS_QUERY by pid (a process on several GPUs: its sum); lines nvidia-smi cannot fill
    ("[N/A]", in some containers) are left out."""
    held: dict[int, int] = {}
    for line in out.splitlines():
        pid, _, mib = (part.strip() for part in line.partition(","))
        if pid.isdigit() and mib.isdigit():
            held[int(pid)] = held.get(int(pid), 0) + int(mib)
    return held


def process_used_mib() -> dict[int, int] | None:
    """The device memory each process holds, by pid; None without nvidia-smi."""
    out = _smi(PROCESS_QUERY)
    return None if out is None else parse_process_mib(out)


def held_mib(pids: dict[str, int]) -> dict[str, int]:
    """What each named process holds now, and the device in all ("device"; other processes included); empty
    without nvidia-smi. A name is missing where nvidia-smi does not list its pid (another pid namespace)."""
    device = device_used_mib()
    if device is None:
        return {}
    by_pid = process_used_mib() or {}
    return {"device": device, **{name: by_pid[pid] for name, pid in pids.items() if pid in by_pid}}


class PeakSampler:
    """The most of each value `query` returns (MiB by name) while the sampler runs (a `with` block), polled every
    `interval` seconds from a thread."""

    def __init__(self, query: Callable[[], dict[str, int]], interval: float = 0.5):
        self.query = query
        self.interval = interval
        self.peaks: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="gpu-memory-sampler", daemon=True)

    def _sample(self) -> None:
        for name, mib in self.query().items():
            self.peaks[name] = max(self.peaks.get(name, 0), mib)

    def _poll(self) -> None:
        while True:
            self._sample()
            if self._stop.wait(self.interval):
                return

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()  # the load's last moment too
