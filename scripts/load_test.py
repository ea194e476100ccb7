"""Bounded load test on loopback: `systemone serve` in a subprocess, then N concurrent clients, then 4x the
server's configured capacity (running + queued). Reports answered, 503/429, failed, and latency percentiles.

    python scripts/load_test.py ARTIFACT [--clients 64] [--requests-per-client 5] [--max-concurrency 64]
        [--max-queue 64] [--out report.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from collections import Counter
from pathlib import Path

import httpx
import numpy as np

from systemone.local_server import free_port, serve_command, start_server

REQUEST = json.loads((Path(__file__).parent / "demo_request.json").read_text())


async def phase(base: str, clients: int, per_client: int, timeout: float) -> dict:
    statuses: Counter[str] = Counter()
    latencies: list[float] = []
    body = json.dumps({**REQUEST, "model": None}).encode()

    async def client(http: httpx.AsyncClient) -> None:
        for _ in range(per_client):
            start = time.perf_counter()
            try:
                response = await http.post("/v1/systemone", content=body, headers={"Content-Type": "application/json"})
                response.json()
                statuses[str(response.status_code)] += 1
                if response.status_code == 200:
                    latencies.append(time.perf_counter() - start)
                elif response.status_code == 503 and "retry-after" not in response.headers:
                    statuses["503 without Retry-After"] += 1
            except Exception as exc:  # a hang (timeout), a reset, a non-JSON body
                statuses[f"failed: {type(exc).__name__}"] += 1

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=base, timeout=timeout, limits=limits) as http:
        start = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(clients)))
        wall = time.perf_counter() - start
    pct = {f"p{p}": float(np.percentile(latencies, p)) for p in (50, 90, 99)} if latencies else {}
    return {"clients": clients, "requests": clients * per_client, "answered": statuses.get("200", 0),
            "refused_503": statuses.get("503", 0), "refused_429": statuses.get("429", 0),
            "failed": sum(n for s, n in statuses.items() if not s.isdigit()),
            "other_5xx": sum(n for s, n in statuses.items() if s.isdigit() and s.startswith("5") and s != "503"),
            "statuses": dict(statuses), "wall_seconds": wall, "latency_seconds": pct}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--requests-per-client", type=int, default=5)
    parser.add_argument("--max-concurrency", type=int, default=64)
    parser.add_argument("--max-queue", type=int, default=64)
    parser.add_argument("--timeout", type=float, default=120.0, help="client timeout: a hang counts as failed")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = start_server(serve_command(args.artifact, port, "--max-concurrency", str(args.max_concurrency),
                                        "--max-queue", str(args.max_queue), "--log-level", "warning"),
                          base, 60, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        capacity = args.max_concurrency + args.max_queue
        report = {"server": {"max_concurrency": args.max_concurrency, "max_queue": args.max_queue,
                             "capacity": capacity}}
        report["concurrent_clients"] = asyncio.run(phase(base, args.clients, args.requests_per_client, args.timeout))
        report["four_times_capacity"] = asyncio.run(phase(base, 4 * capacity, args.requests_per_client, args.timeout))
        report["metrics"] = [line for line in httpx.get(base + "/metrics").text.splitlines()
                             if line.startswith("systemone_requests_total")]
    finally:
        server.terminate()
        server.wait(timeout=60)
    print(json.dumps(report, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
