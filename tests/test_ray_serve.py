"""`systemone serve --replicas N` (systemone/ray_serve.py): replicas of the server on a local Ray instance, two of
the tiny d3 artifact on CPUs, started as a user starts them, through the command. Through the front the HTTP
contract is the server's own (answers, errors, limits); a replica killed under load loses nothing: every request is
answered 200 or 503 with Retry-After, none hangs, and Ray starts a replica in its place; Ctrl-C stops the command
and its Ray. One command serves the module's tests, in order: a Ray instance and its replicas are most of their
time (docs/decisions/test-suite-time.md)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import pytest
import ray
from ray import serve

from systemone.ray_serve import REPLICA_HEADER

BODY = {"state": "The parcel arrived crushed.",
        "questions": {"refund": {"type": "noul", "instructions": "Should we refund?"},
                      "how": {"type": "choice", "criteria": {"refund": None, "replace": None, "reject": None}}}}
MAX_BODY = 1 << 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: bytes, timeout: float = 60.0) -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(url, body, {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def replicas() -> list[str]:
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith("SERVE_REPLICA::systemone#Replica")]


@dataclass
class Command:
    process: subprocess.Popen
    url: str = ""
    lines: list[str] = field(default_factory=list)

    def output(self) -> str:
        return "".join(self.lines)[-2000:]


@pytest.fixture(scope="module")
def replicated(d3_artifact):
    """`systemone serve ARTIFACT --replicas 2` started with SIGINT ignored, as a script's background job is (it ran
    on through Ctrl-C, and a suite started so hung); this process joins its Ray as a second driver, to see and kill
    its replicas."""
    port = free_port()
    command = ["/bin/sh", "-c", "trap '' INT; exec \"$0\" \"$@\"",  # SIGINT ignored, kept across the exec
               sys.executable, "-m", "systemone.cli", "serve", str(d3_artifact), "--device", "cpu", "--replicas",
               "2", "--port", str(port), "--max-batch-rows", "8", "--max-body-bytes", str(MAX_BODY),
               "--media-processes", "0"]
    # Its Ray without token authentication, so that this process joins it by the address it names (a driver given
    # an address reads no token): two workers' commands may run at once, and "auto" would pick either.
    server = Command(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      env={**os.environ, "RAY_ADDRESS": "", "RAY_AUTH_MODE": "disabled"}))
    address = f"http://127.0.0.1:{port}/v1/systemone"
    cluster: list[str] = []
    up = threading.Event()

    def read() -> None:
        for line in server.process.stdout:
            server.lines.append(line)
            cluster.extend(re.findall(r"\(cluster (\S+)\)", line))
            if address in line:
                up.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert up.wait(240), server.output()
        server.url = f"http://127.0.0.1:{port}"
        ray.init(address=cluster[0], log_to_driver=False)
        yield server
    finally:
        if ray.is_initialized():
            ray.shutdown()  # before its Ray stops: a driver whose cluster is gone ends its process
        if server.process.poll() is None:
            server.process.send_signal(signal.SIGINT)
            try:
                server.process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                server.process.kill()
        reader.join(timeout=10)


def test_the_api_through_the_replicas_is_the_servers(replicated, d3_service):
    """Each request answered through the front as one server answers it: the answers (to 1e-6), and for bad
    requests the same status and body; the replica that answered is named."""
    from fastapi.testclient import TestClient

    from systemone.server.app import ServerOptions, create_app

    status, headers, payload = post(replicated.url + "/v1/systemone", json.dumps(BODY).encode())
    assert status == 200, payload
    want = d3_service.answer(d3_service.prepare(BODY))["answers"]
    got = json.loads(payload)["answers"]
    for qid, answer in want.items():
        assert max(abs(got[qid]["probabilities"][k] - p) for k, p in answer["probabilities"].items()) <= 1e-6
    assert REPLICA_HEADER.decode() in {k.lower() for k in headers}

    with TestClient(create_app(d3_service, ServerOptions(max_body_bytes=MAX_BODY, max_batch_rows=8))) as server:
        for body in (b"{not json", json.dumps({"state": "x", "questions": {}}).encode(),
                     json.dumps({"state": "x", "questions": {"q": {"type": "rank"}}}).encode(),
                     b"{" + b" " * MAX_BODY + b"}"):
            status, _, payload = post(replicated.url + "/v1/systemone", body)
            direct = server.post("/v1/systemone", content=body, headers={"content-type": "application/json"})
            assert (status, json.loads(payload)) == (direct.status_code, direct.json()), body[:40]
            assert 400 <= status < 500
    for path in ("/health", "/v1/models", "/ready", "/metrics"):
        with urllib.request.urlopen(replicated.url + path, timeout=30) as response:
            assert response.status == 200


def test_a_replica_killed_under_load_loses_no_request(replicated):
    """Four clients in a closed loop for 8 s; one replica killed 2 s in. Every response is 200, or 503 with
    Retry-After (a request whose tries all met lost replicas); none is another status, none times out; requests
    are answered after the kill; and Ray brings the replicas back to two."""
    assert len(replicas()) == 2
    body = json.dumps(BODY).encode()
    deadline = time.monotonic() + 8

    def client(_: int) -> list[tuple[int, float, dict[str, str]]]:
        out = []
        while time.monotonic() < deadline:
            status, headers, _ = post(replicated.url + "/v1/systemone", body, timeout=30)
            out.append((status, time.monotonic(), headers))
        return out

    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(client, i) for i in range(4)]
        time.sleep(2)
        killed_at = time.monotonic()
        ray.kill(ray.get_actor(replicas()[0], namespace="serve"), no_restart=True)
        results: list[Any] = [r for f in futures for r in f.result()]
    statuses = {status for status, _, _ in results}
    assert statuses <= {200, 503}, statuses
    assert all("retry-after" in {k.lower() for k in headers} for status, _, headers in results if status == 503)
    assert any(status == 200 and at > killed_at + 1 for status, at, _ in results)
    for _ in range(120):
        if len(replicas()) == 2 and serve.status().applications["systemone"].status == "RUNNING":
            break
        time.sleep(0.5)
    assert len(replicas()) == 2
    status, _, _ = post(replicated.url + "/v1/systemone", body)
    assert status == 200


def test_ctrl_c_stops_the_command_and_its_ray(replicated):
    """The module's last test: Ctrl-C ends the command (exit 0), started with SIGINT ignored, and the Ray it
    started with it."""
    cluster = ray.get_runtime_context().gcs_address
    ray.shutdown()
    replicated.process.send_signal(signal.SIGINT)
    replicated.process.wait(timeout=120)
    assert replicated.process.returncode == 0, replicated.output()
    host, port = cluster.rsplit(":", 1)
    with pytest.raises(OSError):
        socket.create_connection((host, int(port)), timeout=5).close()
