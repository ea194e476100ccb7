"""Soak test on loopback: `systemone serve` on an artifact, good requests mixed with every hostile input the
bounds of docs/operations.md cover, for a bounded time. Reports the server's RSS over time (each minute also by kind of
mapping), status counts per kind of request
(no 5xx expected: slow media end at their fetch deadline, 422) and the good requests' latency percentiles.

    python scripts/soak.py ARTIFACT [--minutes 20] [--attackers 3]

Everything stays on 127.0.0.1: the server, a media server that drips bytes, and the attack traffic.
"""

from __future__ import annotations

import argparse
import base64
import gzip
import io
import itertools
import json
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
from PIL import Image

from systemone.local_server import free_port, rss_mb, serve_command, start_server

NOUL = {"type": "noul", "instructions": "Is it urgent?"}
GOOD = {"state": {"ticket": "printer on fire", "priority": "high"},
        "questions": {"q": NOUL, "c": {"type": "choice", "instructions": "Which team?",
                                       "criteria": {"hardware": None, "software": None, "facilities": None}}}}
SAMPLE_S = 5  # between RSS samples
MAPPING_EVERY = 60 // SAMPLE_S  # RSS samples between two by-mapping samples: a minute


def saved(image: Image.Image, fmt: str, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


class Drip(BaseHTTPRequestHandler):
    """Declares 100 MB and sends a byte a second."""

    def do_GET(self):  # noqa: N802
        self.send_response(200)
        self.send_header("Content-Length", str(100 << 20))
        self.end_headers()
        try:
            for _ in range(600):
                self.wfile.write(b"\x89")
                self.wfile.flush()
                time.sleep(1)
        except OSError:
            pass

    def log_message(self, *args):
        pass


def raw(port: int, data: bytes, wait_s: float = 0.2) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(data)
        time.sleep(wait_s)


def attacks(port: int, media: Path, drip_url: str) -> dict[str, object]:
    """Each attack: a JSON body (posted), or a callable that speaks raw HTTP (no status)."""
    one_bit = Image.new("1", (13_000, 13_000))
    (media / "bomb.png").write_bytes(saved(one_bit, "PNG"))
    (media / "bomb.tiff").write_bytes(saved(one_bit, "TIFF", compression="group4"))
    del one_bit
    (media / "bomb.gif").write_bytes(saved(Image.new("P", (13_000, 13_000)), "GIF"))
    (media / "bomb.webp").write_bytes(saved(Image.new("L", (10_000, 10_000)), "WEBP", lossless=True))
    (media / "photo.png").write_bytes(saved(Image.new("RGB", (640, 480), (90, 120, 150)), "PNG"))
    frame = base64.b64encode(saved(Image.new("RGB", (64, 64), (10, 20, 30)), "JPEG")).decode()
    q = {"q": NOUL}
    return {
        "image_bombs": {"state": "x", "questions": q,
                        "images": [f"file://{media}/bomb.{ext}" for ext in ("png", "tiff", "gif", "webp")]},
        "slow_media": {"state": "x", "images": [f"{drip_url}/a.png", f"{drip_url}/b.png"], "questions": q},
        "bad_urls": {"state": "x", "images": ["http://[::1", "http://[zz]/", "http://[::7f00:1]/a.png",
                                             "http://[64:ff9b::7f00:1]/", f"file://{media}/a\u0000b.png",
                                             "file://" + str(media) + "/" + "n" * 5000], "questions": q},
        "jpeg_video_800": {"state": "x", "videos": ["data:video/jpeg;base64," + ",".join([frame] * 800)],
                           "questions": q},
        "big_state": {"state": "word " * 4_000_000, "questions": q},
        "many_questions": {"state": " ".join(f"w{i}" for i in range(60_000)),
                           "questions": {f"q{i}": NOUL for i in range(64)}},
        "huge_array": {"state": [0] * 3_000_000, "questions": q},
        # 800 KB; d1 would show it indented as 302 million characters
        "deep_lists": ('{"state": ' + "[" * 250 + ",".join(["[0]"] * 200_000) + "]" * 250
                       + ', "questions": {"q": {"type": "noul"}}}').encode(),
        "good_image": {"state": "x", "images": [f"file://{media}/photo.png"], "questions": q},
        "malformed": b'{"state": ',
        "gzip_trailing": ("gzip", gzip.compress(json.dumps(GOOD).encode()) + b"junk"),
        "aborted_upload": lambda: raw(port, b"POST /v1/systemone HTTP/1.1\r\nHost: x\r\nContent-Type: "
                                            b"application/json\r\nContent-Length: 100000\r\n\r\n{\"state\": "),
        "slowloris": lambda: raw(port, b"POST /v1/systemone HTTP/1.1\r\nHost: x\r\n", wait_s=2.0),
        "stalled_upload": lambda: raw(port, b"POST /v1/systemone HTTP/1.1\r\nHost: x\r\nContent-Type: "
                                            b"application/json\r\nContent-Length: 60000000\r\n\r\n{\"state\": \""
                                            + b"x" * (1 << 20), wait_s=5.0),
    }


def resident_by_mapping(pid: int) -> dict[str, float]:
    """The server's resident memory in MiB by the kind of mapping holding it (/proc/PID/smaps), read from outside
    so that the sampling allocates nothing in the server: glibc's main heap, anonymous mappings (glibc's other
    arenas, buffers it maps, Python's object arenas, thread stacks), the graphs' weight files, shared libraries."""
    kinds: Counter = Counter()
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


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))] if ordered else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact")
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--attackers", type=int, default=3, help="threads sending attacks")
    parser.add_argument("--good-interval", type=float, default=0.25, help="seconds between good requests")
    parser.add_argument("--out", default=None, help="write the report as JSON here")
    args = parser.parse_args()

    media = Path(tempfile.mkdtemp(prefix="soak-media-"))
    drip = ThreadingHTTPServer(("127.0.0.1", 0), Drip)
    drip.daemon_threads = True
    threading.Thread(target=drip.serve_forever, daemon=True).start()
    drip_url = f"http://127.0.0.1:{drip.server_address[1]}"
    port = free_port()
    kinds = attacks(port, media, drip_url)
    base = f"http://127.0.0.1:{port}"
    # Its media servers are on loopback: fetched directly, whatever proxy the environment names.
    server = start_server(serve_command(args.artifact, port, "--allow-private-media-hosts", "--no-media-proxy",
                                        "--allowed-local-media-path", str(media), "--log-level", "warning"),
                          base, 300, stdout=subprocess.DEVNULL, stderr=open(media / "server.log", "wb"))
    try:
        statuses: dict[str, Counter] = defaultdict(Counter)
        good_seconds: list[float] = []
        rss: list[tuple[float, float]] = []
        by_mapping: list[tuple[float, dict[str, float]]] = []
        samples: dict[str, str] = {}
        lock = threading.Lock()
        start = time.monotonic()
        end = start + args.minutes * 60
        post_headers = {"Content-Type": "application/json"}

        def send(kind: str, body: object, client: httpx.Client) -> None:
            if callable(body):
                body()
                with lock:
                    statuses[kind]["sent"] += 1
                return
            headers = dict(post_headers)
            if isinstance(body, tuple):
                headers["Content-Encoding"], content = body
            else:
                content = body if isinstance(body, bytes) else json.dumps(body).encode()
            t = time.monotonic()
            try:
                response = client.post(base + "/v1/systemone", content=content, headers=headers)
                status = response.status_code
                if status >= 500 or (kind == "good" and status != 200):
                    with lock:
                        samples.setdefault(f"{kind} {status}", response.text[:300])
            except httpx.HTTPError as exc:
                status = type(exc).__name__
            with lock:
                statuses[kind][status] += 1
                if kind == "good":
                    good_seconds.append(time.monotonic() - t)

        def attacker(seed: int) -> None:
            order = list(kinds)
            random.Random(seed).shuffle(order)
            with httpx.Client(timeout=120) as client:
                for kind in itertools.cycle(order):
                    if time.monotonic() >= end:
                        return
                    send(kind, kinds[kind], client)

        def good() -> None:
            with httpx.Client(timeout=120) as client:
                while time.monotonic() < end:
                    send("good", GOOD, client)
                    time.sleep(args.good_interval)

        threads = [threading.Thread(target=attacker, args=(i,)) for i in range(args.attackers)]
        threads.append(threading.Thread(target=good))
        for thread in threads:
            thread.start()
        while any(t.is_alive() for t in threads):
            rss.append((time.monotonic() - start, rss_mb(server.pid)))
            if len(rss) % MAPPING_EVERY == 1:
                by_mapping.append((round(rss[-1][0]), resident_by_mapping(server.pid)))
            time.sleep(SAMPLE_S)
        rss.append((time.monotonic() - start, rss_mb(server.pid)))
        by_mapping.append((round(rss[-1][0]), resident_by_mapping(server.pid)))
    finally:
        server.terminate()
        server.wait(timeout=60)
        drip.shutdown()

    five_xx = {k: {s: n for s, n in c.items() if isinstance(s, int) and s >= 500} for k, c in statuses.items()}
    warm = [m for t, m in rss if t >= min(60.0, args.minutes * 60 / 3)]
    report = {
        "minutes": args.minutes,
        "statuses": {k: {str(s): n for s, n in c.items()} for k, c in sorted(statuses.items())},
        "five_xx": {k: v for k, v in five_xx.items() if v},
        "good": {"count": len(good_seconds), "p50_s": percentile(good_seconds, 50),
                 "p99_s": percentile(good_seconds, 99), "max_s": max(good_seconds, default=float("nan"))},
        "rss_mb": {"start": rss[0][1] if rss else None, "peak": max((m for _, m in rss), default=None),
                   "after_warmup_min": min(warm, default=None), "after_warmup_max": max(warm, default=None),
                   "end": rss[-1][1] if rss else None},
        "unexpected_answers": samples,
        "rss_series": [(round(t), round(m)) for t, m in rss],
        "rss_mb_by_mapping": by_mapping,
        "server_log_lines": sum(1 for _ in open(media / "server.log", "rb")),
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 1 if report["five_xx"] else 0


if __name__ == "__main__":
    sys.exit(main())
