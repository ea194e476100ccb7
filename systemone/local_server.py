"""`systemone serve` in a subprocess on a loopback port, returned once `GET /health` answers: how the load, soak
and concurrency scripts and the tests that need a real server process start one (and read its RSS). Standard library only, as
`loadgen.py` (the lent GPU machine has no httpx).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

TAIL_CHARS = 2000


class ServerDidNotStart(RuntimeError):
    """The server exited, or its /health did not answer in time; the message ends with its output's tail."""


def free_port() -> int:
    """A loopback port that is free now (nothing holds it for the server: bind it soon)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int | str = "self") -> float:
    """The resident memory of process `pid` (this one by default), in MiB."""
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def resident_by_mapping(pid: int) -> dict[str, float]:
    """Process `pid`'s resident memory in MiB by the kind of mapping holding it (/proc/PID/smaps), read from outside
    so that the sampling allocates nothing in the server: glibc's main heap, anonymous mappings (glibc's other
    arenas, buffers it maps, Python's object arenas, thread stacks), the graphs' weight files, shared libraries."""
    kinds: Counter[str] = Counter()
    kind = "anonymous"
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            first = line.split(None, 1)[0]
            if not first.endswith(":"):  # a mapping's header: address range, perms, offset, device, inode, path
                fields = line.split()
                path = fields[5] if len(fields) > 5 else ""
                kind = ("heap" if path == "[heap]" else "anonymous" if not path or path.startswith("[anon")
                        else "stack and kernel" if path.startswith("[")
                        else "graph files" if ".onnx" in path else "libraries" if ".so" in path else "other files")
            elif first == "Rss:":
                kinds[kind] += int(line.split()[1]) / 1024
    return {k: round(v, 1) for k, v in sorted(kinds.items())}


def serve_command(artifact: str | Path, port: int, *flags: str) -> list[str]:
    """`systemone serve ARTIFACT` on the CPU at loopback `port`, with `flags`, run by this Python."""
    return [sys.executable, "-m", "systemone.cli", "serve", str(artifact), "--device", "cpu", "--port", str(port),
            *flags]


def start_server(command: Sequence[str], base: str, within_s: float, **popen: Any) -> subprocess.Popen:
    """Start `command` (a server listening at `base`, e.g. http://127.0.0.1:PORT) with `popen` as Popen's keyword
    arguments; return the process once `GET base/health` answers 2xx. If the process exits first, or `within_s`
    seconds pass, it is killed and ServerDidNotStart names the URL and the deadline, with the tail of the output
    it wrote to a PIPE or an open file (output left on the terminal is there already)."""
    server = subprocess.Popen(list(command), **popen)
    health = base + "/health"
    deadline = time.monotonic() + within_s
    while server.poll() is None and time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(health, timeout=1):
                return server
        except OSError:  # refused while it starts; a non-2xx (HTTPError) is an OSError too
            time.sleep(0.2)
    code = server.poll()
    server.kill()
    if code is None:
        why = f"{health} did not answer within {within_s:g} s (the server was stopped)"
    else:
        why = f"the server exited with {code} before {health} answered (deadline {within_s:g} s)"
    tail = _output_tail(server, popen)
    raise ServerDidNotStart(f"{why}: {' '.join(command)}" + (f"\n... its output ends:\n{tail}" if tail else ""))


def _output_tail(server: subprocess.Popen, popen: dict[str, Any]) -> str:
    """The end of what the ended `server` wrote to its PIPE streams, or to the files it was given."""
    texts = []
    for captured, given in zip(server.communicate(), (popen.get("stdout"), popen.get("stderr"))):
        name = getattr(given, "name", None)
        if captured:
            texts.append(captured if isinstance(captured, str) else captured.decode(errors="replace"))
        elif isinstance(name, str):  # an open file (a temporary file's name is its descriptor: skipped)
            texts.append(Path(name).read_bytes()[-TAIL_CHARS:].decode(errors="replace"))
    return "".join(texts)[-TAIL_CHARS:]
