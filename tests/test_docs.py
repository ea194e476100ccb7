"""The documentation's examples run as written: every command line of the README's and docs/'s `bash` blocks, every
JSON block and every `python` block, against the tiny d3 artifact (the one `bash scripts/demo.sh` builds, served as
`d3-tiny`): `systemone serve` lines serve it (until `/health` answers), `curl` lines and Python clients run against
a live server at the demo's address. And every relative link of the README and of docs/ resolves.

docs/spec.md is left out of the examples: it quotes vLLM's behaviour in fragments, not commands to run."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from systemone import cli
from systemone.server import lifecycle
from systemone.server.app import ServerOptions
from systemone.runtime.artifact import Artifact
from systemone.runtime.engine import EngineOptions
from systemone.runtime.service import DecisionService
from systemone.server.app import create_app
from tests.live_server import live_server

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "spec.md")]
# The artifact names the docs use, all played by the tiny d3 artifact; the hub id given to `serve` is played by the
# tiny d3 checkpoint (no hub can be reached here).
ARTIFACT_NAMES = (".cache/demo/d3-tiny-onnx", "d3-edge-onnx")
CHECKPOINT_NAMES = ("vllm-sr/d3-edge",)
DEMO_URL = "http://127.0.0.1:8765"  # where `bash scripts/demo.sh` serves: every example's server
LINKED = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]  # every page whose links must resolve


def blocks(language: str) -> list[tuple[str, str]]:
    found = []
    for path in DOCS:
        for block in re.findall(rf"```{language}\n(.*?)```", path.read_text(encoding="utf-8"), re.S):
            found.append((path.name, block))
    return found


def command_lines() -> list[tuple[str, str]]:
    lines = []
    for name, block in blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            if line.strip():
                lines.append((name, line.strip()))
    return lines


def relative_links(markdown: str) -> list[str]:
    """The targets of a page's inline links and images that are neither URLs nor anchors of the page itself; code
    blocks and code spans are not links."""
    prose = re.sub(r"`[^`\n]*`", "", re.sub(r"```.*?```", "", markdown, flags=re.S))
    return [target for target in re.findall(r"\]\(([^)\s]+)\)", prose)
            if not re.match(r"[a-z][a-z0-9+.-]*:|#", target)]


@pytest.mark.parametrize("page", LINKED, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_relative_link_points_at_a_file(page):
    """Every relative link of the README and of docs/ (docs/decisions/ too) names a file of the checkout, read from the
    page's own folder; its #anchor aside."""
    targets = relative_links(page.read_text(encoding="utf-8"))
    assert [target for target in targets if not (page.parent / target.split("#")[0]).is_file()] == []


def test_the_docs_have_examples():
    assert len(command_lines()) >= 10 and len(blocks("json")) >= 6 and len(blocks("python")) >= 2


@pytest.fixture(scope="module")
def service(d3_artifact) -> DecisionService:
    # Default names, as `systemone serve` gives them: the checkpoint directory's name, d3-tiny.
    return DecisionService(Artifact.load(d3_artifact), EngineOptions(device="cpu"))


def argv_of(line: str, artifact: Path, checkpoint: Path) -> list[str]:
    words = shlex.split(line, comments=True)
    if words[:2] == ["systemone", "export"]:
        return words  # parsed only: export itself is tested in test_export.py
    return [str(artifact) if word in ARTIFACT_NAMES else str(checkpoint) if word in CHECKPOINT_NAMES else word
            for word in words]


def serve_briefly(app, listener, stop, **settings) -> None:
    """`run_server` for a docs line: serve on the line's socket until `/health` and `/docs` answer, then stop."""
    import uvicorn

    host, port = listener.getsockname()[:2]
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, **settings))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        for path in ("/health", "/docs"):
            with urllib.request.urlopen(f"http://{host}:{port}{path}", timeout=30) as response:
                assert response.status == 200
    finally:
        server.should_exit = True
        thread.join(timeout=60)


@pytest.mark.parametrize("where, line", command_lines())
def test_every_command_line_runs(where, line, d3_artifact, d3_checkpoint, service, monkeypatch, capsys, tmp_path):
    from systemone.export import pipeline

    monkeypatch.chdir(ROOT)
    words = argv_of(line, d3_artifact, d3_checkpoint)
    program = words[0]
    if program in ("systemone", ".venv/bin/systemone"):
        args = cli.build_parser().parse_args(words[1:])  # every line parses as written
        if args.command == "export":
            assert args.source == "vllm-sr/d3-edge"  # a hub id: export itself is tested in test_export.py
            return
        # A checkpoint served is exported on its first start; here the export is the session's artifact, copied.
        monkeypatch.setattr(pipeline, "export_checkpoint",
                            lambda source, out, revision=None: shutil.copytree(d3_artifact, out))
        monkeypatch.setenv("SYSTEMONE_CACHE_DIR", str(tmp_path))
        monkeypatch.setattr(lifecycle, "run_server", serve_briefly)
        if args.command == "serve":
            words += ["--port", "0"]  # the line's port may be held by another server on this machine
        assert cli.main(words[1:]) == 0, capsys.readouterr()
        out = capsys.readouterr().out
        if args.command == "ask":
            assert json.loads(out)["model"] == "d3-tiny"
    elif program == "curl":
        assert DEMO_URL + "/" in line, f"{where}: a curl example that is not at the demo's address: {line}"
        with live_server(service) as base:
            command = shlex.join(words).replace(DEMO_URL, base)
            done = subprocess.run(command, shell=True, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["object"] == "structured_decision"
    elif program == "pip":
        extras = re.findall(r"^([a-z]+) = \[", (ROOT / "pyproject.toml").read_text().split(
            "[project.optional-dependencies]")[1].split("\n[")[0], re.M)
        named = re.fullmatch(r"\.(?:\[(.*)\])?", words[-1])
        assert words[1:3] == ["install", "-e"] and named, line
        assert set((named.group(1) or "").split(",")) - {""} <= set(extras), line
    elif program == "bash":
        assert (ROOT / words[1]).is_file(), line
    else:
        pytest.fail(f"{where}: no rule runs this line: {line}")


def test_every_json_example_is_real(service):
    client = TestClient(create_app(service))
    real = client.post("/v1/systemone", json=json.loads((ROOT / "scripts" / "demo_request.json").read_text()))
    assert real.status_code == 200
    real_answers = {a["type"]: list(a) for a in real.json()["answers"].values()}
    for where, block in blocks("json"):
        example = json.loads(block)
        if "questions" in example:  # a request: the server takes it
            response = client.post("/v1/systemone", json=example)
            assert response.status_code == 200, (where, response.text)
        elif "answers" in example:  # a response: the real one's fields, in its order
            assert list(example) == list(real.json()), where
            for answer in example["answers"].values():
                assert list(answer) == real_answers[answer["type"]], where
        else:  # an error body: the real one for the same mistake
            assert example["error"]["code"] == 404 and list(example) == ["error", "detail"], where
            response = client.post("/v1/systemone", json={"model": "nope", "state": None,
                                                           "questions": {"q": {"type": "noul"}}})
            assert response.json() == example, where


@pytest.mark.parametrize("where, block", blocks("python"))
def test_every_python_example_runs_against_a_live_server(where, block, service):
    """As written but for the address: a block that reads SYSTEMONE_API_KEY runs against a server with that key,
    the others against a server without one."""
    assert DEMO_URL in block, f"{where}: a Python example not at the demo's address"
    key = "a-key-only-the-example-knows" if "SYSTEMONE_API_KEY" in block else None
    with live_server(service, ServerOptions(api_key=key)) as base:
        environ = {**os.environ, **({"SYSTEMONE_API_KEY": key} if key else {})}
        done = subprocess.run([sys.executable, "-c", block.replace(DEMO_URL, base)], cwd=ROOT, env=environ,
                              capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[0] == "d3-tiny", done.stdout


def test_a_python_example_with_a_key_fails_against_a_server_with_another(service):
    """The keyed example really depends on the key: with the wrong one, the SDK's authentication error."""
    (block,) = [block for _, block in blocks("python") if "SYSTEMONE_API_KEY" in block]
    with live_server(service, ServerOptions(api_key="the-servers-key")) as base:
        done = subprocess.run([sys.executable, "-c", block.replace(DEMO_URL, base)], cwd=ROOT,
                              env={**os.environ, "SYSTEMONE_API_KEY": "another-key"}, capture_output=True, text=True,
                              timeout=120)
    assert done.returncode != 0 and "TypeSafeAuthenticationError" in done.stderr


@pytest.mark.parametrize("command, table", [("serve", "## Server flags"), ("export", "## Export flags"),
                                            ("bench", "## Bench flags")])
def test_every_flag_has_a_row_in_docs_cli(command, table):
    """docs/cli.md's table of a command's flags names each of them, with the default the parser has (`--debug`, which
    every command takes, is said once at the top)."""
    parser = cli.build_parser()._subparsers._group_actions[0].choices[command]
    text = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    rows = text.split(table, 1)[1].split("\n## ", 1)[0]
    documented = {match.group(1).split()[0]: match.group(2).strip()
                  for match in re.finditer(r"^\| `(--[^`]+)` \| ([^|]*) \|", rows, re.M)}
    flags = {action.option_strings[-1]: action.default for action in parser._actions
             if action.option_strings and action.option_strings[-1] not in ("--help", "--debug")}
    assert sorted(set(flags) - set(documented)) == []
    for flag, default in flags.items():
        if isinstance(default, (int, float)) and not isinstance(default, bool):
            number = re.match(r"[0-9.]+", documented[flag])
            assert number and float(number.group()) == default, (flag, documented[flag], default)
