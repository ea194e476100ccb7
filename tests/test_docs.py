"""The documentation's examples run as written: every command line of the README's and docs/'s `bash` blocks, and
every JSON block, against the tiny d3 artifact (the one `bash scripts/demo.sh` builds, served as `d3-tiny`).

docs/spec.md is left out: it quotes vLLM's behaviour in fragments, not commands to run."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from systemone import cli
from systemone.runtime.artifact import Artifact
from systemone.runtime.engine import EngineOptions
from systemone.runtime.service import DecisionService
from systemone.server.app import create_app
from tests.live_server import live_server

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "spec.md")]
# The artifact names the docs use, all played by the tiny d3 artifact.
ARTIFACT_NAMES = (".cache/demo/d3-tiny-onnx", "d3-edge-onnx")
DEMO_URL = "http://127.0.0.1:8000"


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


def test_the_docs_have_examples():
    assert len(command_lines()) >= 10 and len(blocks("json")) >= 6


@pytest.fixture(scope="module")
def service(d3_artifact) -> DecisionService:
    # Default names, as `systemone serve` gives them: the checkpoint directory's name, d3-tiny.
    return DecisionService(Artifact.load(d3_artifact), EngineOptions(device="cpu"))


def argv_of(line: str, artifact: Path) -> list[str]:
    words = shlex.split(line, comments=True)
    return [str(artifact) if word in ARTIFACT_NAMES else word for word in words]


@pytest.mark.parametrize("where, line", command_lines())
def test_every_command_line_runs(where, line, d3_artifact, service, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    words = argv_of(line, d3_artifact)
    program = words[0]
    if program in ("systemone", ".venv/bin/systemone"):
        args = cli.build_parser().parse_args(words[1:])  # every line parses as written
        if args.command == "export":
            assert args.source == "vllm-sr/d3-edge"  # a hub id: export itself is tested in test_export.py
            return
        import uvicorn

        monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: None)
        assert cli.main(words[1:]) == 0, capsys.readouterr()
        out = capsys.readouterr().out
        if args.command == "ask":
            assert json.loads(out)["model"] == "d3-tiny"
    elif program == "curl":
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


@pytest.mark.parametrize("command, table", [("serve", "## Server flags"), ("export", "## Export flags")])
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
