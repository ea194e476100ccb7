"""Concurrency on CPU (docs/operations.md): `systemone serve` at its default flags on an artifact, then one
client and 16 clients in a closed loop (systemone/loadgen.py, the seeds' mix) side by side in rounds, and a sample
of the 16-client answers sent again one at a time. Reports requests/s at each count, their ratio (median over the
rounds) and the largest probability difference, and writes the JSON report.

    python scripts/concurrency_check.py ARTIFACT [--seconds 10] [--rounds 2] [--kinds text,json,choice40]
        [--sample 100] [--out scripts/results/concurrency_cpu_d3_tiny.json] [-- extra serve flags]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from statistics import median
from typing import Any

from systemone.loadgen import KINDS, HttpClient, RequestMix, closed_loop
from systemone.local_server import free_port, serve_command, start_server


def probabilities(payload: bytes) -> dict[tuple[str, str], float]:
    answers = json.loads(payload)["answers"]
    return {(q, k): p for q, a in answers.items() for k, p in a["probabilities"].items()}


async def one_at_a_time(url: str, kept: list[tuple[dict[str, Any], bytes]]) -> float:
    """Each kept body sent again alone; the largest |probability difference| from its answer under load."""
    client = HttpClient(url)
    worst = 0.0
    try:
        for body, loaded in kept:
            status, alone = await client.post(json.dumps(body).encode())
            if status != 200:
                raise RuntimeError(f"one-at-a-time resend got {status}: {alone[:200]!r}")
            want, got = probabilities(alone), probabilities(loaded)
            if want.keys() != got.keys():
                raise RuntimeError("the same body got different questions or options")
            worst = max(worst, max(abs(want[k] - got[k]) for k in want))
    finally:
        await client.close()
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact")
    parser.add_argument("--family", default="d3")
    parser.add_argument("--seconds", type=float, default=10.0, help="each phase's closed loop")
    parser.add_argument("--rounds", type=int, default=2, help="1-client and 16-client phases, alternated")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--kinds", default="text,json,choice40", help=f"of {','.join(KINDS)}")
    parser.add_argument("--sample", type=int, default=100, help="16-client answers checked one at a time")
    parser.add_argument("--out", default=None)
    args, serve_flags = parser.parse_known_args()
    kinds = tuple(args.kinds.split(","))

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    command = serve_command(args.artifact, port, "--log-level", "warning", *[f for f in serve_flags if f != "--"])
    # The server's output to a file, not a pipe: a pipe nobody reads while the load runs fills, and the server (or
    # its worker processes) then blocks writing to it.
    output = tempfile.TemporaryFile("w+")
    server = start_server(command, base, 300, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=output,
                          stderr=subprocess.STDOUT)
    url = base + "/v1/systemone"
    runs: list[dict[str, Any]] = []
    kept: list[tuple[dict[str, Any], bytes]] = []

    def keep(body: dict[str, Any], payload: bytes) -> None:
        if len(kept) < args.sample:
            kept.append((body, payload))

    try:
        for round_ in range(args.rounds):
            for clients in (1, args.clients):
                mix = RequestMix(args.family, round_, kinds)
                result = asyncio.run(closed_loop(url, mix, clients, args.seconds,
                                                 keep=keep if clients > 1 else None))
                runs.append({"round": round_, "clients": clients, **result.summary()})
                print(json.dumps(runs[-1]), flush=True)
        worst = asyncio.run(one_at_a_time(url, kept))
        print(json.dumps({"answers_checked": len(kept), "max_abs_prob_diff": worst}), flush=True)
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            print("the server did not stop within 30 s of SIGTERM: killed", file=sys.stderr, flush=True)
            server.kill()
            server.wait()
    output.seek(0)
    startup = output.read()
    rps = {n: median(r["requests_per_s"] for r in runs if r["clients"] == n) for n in (1, args.clients)}
    report = {
        "command": " ".join(["python", *sys.argv]),
        "serve": " ".join(command[2:]),
        "startup": [line for line in startup.splitlines() if line.startswith("systemone serve:")],
        "kinds": list(kinds), "seconds_each": args.seconds, "rounds": args.rounds,
        "requests_per_s": {str(n): v for n, v in rps.items()},
        "ratio": rps[args.clients] / rps[1],
        "answers_checked": len(kept), "max_abs_prob_diff": worst,
        "non_200": sum(sum(r["non_200"].values()) for r in runs),
        "runs": runs,
    }
    print(json.dumps({k: report[k] for k in ("requests_per_s", "ratio", "answers_checked", "max_abs_prob_diff",
                                             "non_200")}, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
