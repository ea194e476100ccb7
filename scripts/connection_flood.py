"""Slowloris at scale on loopback: `systemone serve` at its default connection flags, then N connections that each
send half a request line and hold it. Reports what the server did with them (displaced by newer ones past the
cap, or held until the header timeout), its open descriptors, whether `/health` and a real request were answered during the
flood and after the header timeout, and how many lines it logged. The client needs N descriptors of its own
(`ulimit -n`). With `--per-client K` the server caps each client address at K connections
(`--max-connections-per-client`) and the flood comes from 127.0.0.2 while the probes come from 127.0.0.1.

    python scripts/connection_flood.py ARTIFACT [--connections 19000] [--per-client K] [--out F]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from systemone.local_server import free_port, serve_command, start_server

HEADER_TIMEOUT_S = 10.0  # serve's default --header-timeout
GOOD = {"state": "printer on fire", "questions": {"q": {"type": "noul", "instructions": "Is it urgent?"}}}


def descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def closed_by_server(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def probe(base: str) -> dict:
    """/health and one real request from a fresh client: status and seconds, or the error."""
    out = {}
    for name, call in (("health", lambda c: c.get(f"{base}/health")),
                       ("request", lambda c: c.post(f"{base}/v1/systemone", json=GOOD))):
        start = time.monotonic()
        try:
            with httpx.Client(timeout=30) as client:
                out[name] = {"status": call(client).status_code, "seconds": round(time.monotonic() - start, 3)}
        except httpx.HTTPError as exc:
            out[name] = {"error": f"{type(exc).__name__}: {exc}", "seconds": round(time.monotonic() - start, 3)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact")
    parser.add_argument("--connections", type=int, default=19_000)
    parser.add_argument("--per-client", type=int, default=0, help="serve's --max-connections-per-client")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    command = serve_command(args.artifact, port,
                            *(["--max-connections-per-client", str(args.per_client)] if args.per_client else []))
    source = ("127.0.0.2", 0) if args.per_client else None  # Linux routes all of 127/8 to the loopback device
    output = tempfile.TemporaryFile()  # not a pipe: one nobody reads during the flood fills and blocks the server
    server = start_server(command, base, 300, stdout=output, stderr=subprocess.STDOUT)
    flags = f" --per-client {args.per_client}" if args.per_client else ""
    report: dict = {"command": f"python scripts/connection_flood.py ARTIFACT --connections {args.connections}{flags}",
                    "serve": " ".join(command[1:]), "descriptors_before": descriptors(server.pid)}
    sockets, failed = [], 0
    start = time.monotonic()
    try:
        for _ in range(args.connections):
            try:
                sock = socket.create_connection(("127.0.0.1", port), timeout=5, source_address=source)
                sock.sendall(b"GET /heal")
                sockets.append(sock)
            except OSError:
                failed += 1
        report["flood"] = {"connections": args.connections, "opened": len(sockets), "failed_to_open": failed,
                           "seconds": round(time.monotonic() - start, 1)}
        time.sleep(1)
        report["during_flood"] = {"server_descriptors": descriptors(server.pid),
                                  "closed_by_server": sum(closed_by_server(s) for s in sockets), **probe(base)}
        time.sleep(HEADER_TIMEOUT_S + 1)
        report["after_header_timeout"] = {"server_descriptors": descriptors(server.pid),
                                          "closed_by_server": sum(closed_by_server(s) for s in sockets),
                                          **probe(base)}
    finally:
        for sock in sockets:
            sock.close()
        server.terminate()
        server.wait(timeout=60)
    output.seek(0)
    log = output.read().decode(errors="replace").splitlines()
    report["server_log"] = {"lines": len(log), "tracebacks": sum("Traceback" in line for line in log),
                            "last": log[-5:]}
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
