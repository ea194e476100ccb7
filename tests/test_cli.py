"""The `systemone` command as a user meets it: every mistake is one line on stderr and a non-zero exit (a traceback
only with --debug), every flag says what it does and its default, `serve` says what it serves."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from systemone import cli

REQUEST = Path(__file__).resolve().parent.parent / "scripts" / "demo_request.json"


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code: int, err: str, *fragments: str) -> None:
    assert code != 0
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.startswith("systemone 0.")


def commands() -> dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser()
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def test_every_flag_has_help():
    assert set(commands()) >= {"export", "serve", "ask", "render"}
    for name, command in commands().items():
        for action in command._actions:
            assert action.help, f"{name} {action.option_strings or action.dest} has no help"


def test_serve_help_states_the_defaults():
    help_text = " ".join(commands()["serve"].format_help().split())
    for default in ("127.0.0.1", "8000", "16", "60.0", "auto", "info"):
        assert f"(default: {default})" in help_text


def test_a_missing_artifact_is_one_line(capsys, tmp_path):
    code, _, err = run(capsys, "serve", str(tmp_path / "nope"))
    assert_one_line_error(code, err, "is not an exported artifact", "manifest.json")


def test_a_missing_request_file_is_one_line(capsys, tmp_path):
    code, _, err = run(capsys, "ask", str(tmp_path), "--request", str(tmp_path / "request.json"))
    assert_one_line_error(code, err, "request file", "does not exist")


def test_bad_request_json_is_one_line(capsys, tmp_path):
    (tmp_path / "request.json").write_text("{not json")
    code, _, err = run(capsys, "ask", str(tmp_path), "--request", str(tmp_path / "request.json"))
    assert_one_line_error(code, err, "is not valid JSON", "line 1 column 2")


def test_an_offline_hub_id_is_one_line(capsys, tmp_path, monkeypatch):
    import huggingface_hub.constants as constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    code, _, err = run(capsys, "export", "nobody/no-model", "--out", str(tmp_path / "out"))
    assert_one_line_error(code, err, "could not fetch checkpoint 'nobody/no-model'")


@pytest.mark.parametrize("flag", [["--forms", "cuda-fused"], ["--add-forms"]])
def test_portable_only_refuses_a_flag_that_asks_for_forms(capsys, tmp_path, flag):
    """Neither silently ignored nor, with --add-forms, a removal of the artifact's forms."""
    code, _, err = run(capsys, "export", "nobody/no-model", "--out", str(tmp_path / "out"), "--portable-only", *flag)
    assert_one_line_error(code, err, f"--portable-only writes no half-precision form; it cannot go with {flag[0]}")


def test_debug_shows_the_traceback(tmp_path):
    with pytest.raises(Exception, match="is not an exported artifact"):
        cli.main(["serve", str(tmp_path), "--debug"])


def test_an_unavailable_device_is_one_line(capsys, d3_artifact):
    code, _, err = run(capsys, "serve", str(d3_artifact), "--device", "cuda")
    assert_one_line_error(code, err, "device 'cuda' needs CUDAExecutionProvider")


def test_serve_prints_what_it_serves(capsys, d3_artifact, monkeypatch):
    import uvicorn

    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: None)
    code, out, _ = run(capsys, "serve", str(d3_artifact), "--device", "cpu", "--port", "8123")
    assert code == 0
    summary = dict(line.removeprefix("systemone serve: ").split(None, 1) for line in out.splitlines()
                   if not line.startswith("systemone serve: max"))
    assert summary["model"] == "d3-tiny (also answers to jev-latest)"
    assert summary["artifact"] == f"{d3_artifact} (family d3, source d3-tiny)"
    assert summary["provider"] == "CPUExecutionProvider (--device cpu)"
    assert summary["precision"] == "portable form (float32)"
    assert summary["address"] == "http://127.0.0.1:8123/v1/systemone"


@pytest.mark.parametrize(("environ", "flags", "said"), [
    ({}, (), "none: media URLs are fetched directly"),
    ({"HTTPS_PROXY": "http://user:pw@proxy.example:3128", "no_proxy": "localhost"}, (),
     "media fetches through http://proxy.example:3128 (https URLs), not for localhost"),
    ({"all_proxy": "socks5://proxy.example:1080"}, ("--no-media-proxy",),
     "none: media URLs are fetched directly (--no-media-proxy)")])
def test_serve_says_which_proxy_media_fetches_take_never_its_password(capsys, d3_artifact, monkeypatch, environ,
                                                                      flags, said):
    import uvicorn

    for name in ("http_proxy", "https_proxy", "all_proxy", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: None)
    code, out, _ = run(capsys, "serve", str(d3_artifact), "--device", "cpu", *flags)
    assert code == 0
    assert f"systemone serve: proxy         {said}\n" in out and "pw" not in out


def test_a_proxy_serve_cannot_use_stops_it_naming_the_variable_and_the_way_out(capsys, d3_artifact, monkeypatch):
    monkeypatch.setenv("all_proxy", "socks5://proxy.example:1080")
    code, _, err = run(capsys, "serve", str(d3_artifact), "--device", "cpu")
    assert_one_line_error(code, err, "all_proxy: a socks5:// proxy is not supported for media fetches, only http:// "
                                     "(or pass --no-media-proxy)")


@pytest.mark.parametrize(("flags", "access_log"), [((), False), (("--access-log",), True)])
def test_uvicorns_access_log_is_off_unless_asked(capsys, d3_artifact, monkeypatch, flags, access_log):
    """Each decision request is logged once, by the server; uvicorn's access line repeated it on the event loop."""
    import uvicorn

    given = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: given.update(kwargs))
    code, _, _ = run(capsys, "serve", str(d3_artifact), "--device", "cpu", *flags)
    assert code == 0
    assert given["access_log"] is access_log


@pytest.mark.parametrize(("flags", "parser", "loop"), [((), "httptools", "uvloop"),
                                                        (("--http", "h11", "--loop", "asyncio"), "h11", "asyncio")])
def test_serve_runs_the_c_parser_and_uvloop_unless_told_otherwise_and_says_which(capsys, d3_artifact, monkeypatch,
                                                                                   flags, parser, loop):
    import uvicorn

    given = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: given.update(kwargs))
    code, out, _ = run(capsys, "serve", str(d3_artifact), "--device", "cpu", *flags)
    assert code == 0
    assert f"systemone serve: http          {parser} parser, {loop} event loop" in out.splitlines()
    assert given["loop"] == loop
    assert given["http"].__mro__[1].__module__ == f"uvicorn.protocols.http.{parser}_impl"


@pytest.mark.parametrize(("flags", "missing", "message"), [
    (("--http", "httptools"), "uvicorn.protocols.http.httptools_impl", "--http httptools: httptools is not installed"),
    (("--loop", "uvloop"), "uvloop", "--loop uvloop: uvloop is not installed")])
def test_a_parser_or_loop_named_but_not_installed_stops_serve_before_the_model_loads(capsys, d3_artifact, monkeypatch,
                                                                                     flags, missing, message):
    import importlib.util
    import sys

    import uvicorn

    from systemone import cli

    monkeypatch.setitem(sys.modules, missing, None)  # an import of it fails, as when it is not installed
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == missing else find_spec(name, *a))
    monkeypatch.setattr(cli, "_service", lambda args: pytest.fail("the model was loaded"))
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: pytest.fail("uvicorn ran"))
    code, _, err = run(capsys, "serve", str(d3_artifact), "--device", "cpu", *flags)
    assert code == 2
    assert message in err


@pytest.mark.parametrize(("flag", "held"), [("4096", "4096"), ("512", "1024")])
def test_max_batch_tokens_bounds_a_text_graph_call_but_never_below_the_longest_d3_prompt(capsys, d3_artifact,
                                                                                          monkeypatch, flag, held):
    import uvicorn

    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: None)
    code, out, _ = run(capsys, "serve", str(d3_artifact), "--device", "cpu", "--max-model-len", "1024",
                       "--max-batch-tokens", flag)
    assert code == 0
    assert f"systemone serve: batch tokens  {held} padded tokens a call at most" in out.splitlines()


@pytest.mark.parametrize(("artifact", "flags", "said"), [
    ("d3_artifact", [], "none: the text graph carries no state"),
    ("d3_causal_artifact", [], "on: a request's shared prefix read once where it saves more than a call"),
    ("d3_causal_artifact", ["--no-prefix-reuse"], "off (--no-prefix-reuse): every whole prompt is read")])
def test_serve_says_whether_a_requests_shared_prefix_is_read_once(capsys, monkeypatch, request, artifact, flags, said):
    import uvicorn

    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: None)
    code, out, _ = run(capsys, "serve", str(request.getfixturevalue(artifact)), "--device", "cpu", *flags)
    assert code == 0
    assert any(line.startswith(f"systemone serve: prefix reuse  {said}") for line in out.splitlines()), out


def test_ask_answers_the_sample_request(capsys, d3_artifact):
    code, out, _ = run(capsys, "ask", str(d3_artifact), "--request", str(REQUEST), "--device", "cpu")
    assert code == 0 and json.loads(out)["model"] == "d3-tiny"


@pytest.mark.parametrize("fmt", ["text", "ids", "json"])
def test_render_formats(capsys, d3_artifact, fmt):
    code, out, _ = run(capsys, "render", str(d3_artifact), "--request", str(REQUEST), "--device", "cpu",
                       "--format", fmt)
    assert code == 0
    ids = ["urgent", "team", "anger"]
    if fmt == "json":
        body = json.loads(out)
        assert len(out.splitlines()) == 1 and [q["id"] for q in body["questions"]] == ids
    elif fmt == "ids":
        lines = out.splitlines()
        assert [line.split(":")[0] for line in lines] == ids
        assert all(token.isdigit() for line in lines for token in line.split(":")[1].split())
    else:
        headers = [line for line in out.splitlines() if line.startswith("--- ")]
        assert [h.split()[1] for h in headers] == ids and "I was charged twice" in out


def test_an_install_without_onnxruntime_names_the_extra():
    """The base install has no onnxruntime (one flavour comes from an extra); serving says which to install."""
    import subprocess
    import sys

    script = ("import sys; sys.modules['onnxruntime'] = None\n"
              "from systemone.cli import main\nsys.exit(main(['serve', 'no-artifact']))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert_one_line_error(done.returncode, done.stderr, "onnxruntime is not installed", "systemone-onnx[cpu]",
                          "systemone-onnx[gpu]", "systemone-onnx[rocm]")


def test_third_party_warnings_are_silenced_only_while_a_command_runs(monkeypatch, recwarn):
    import os
    import warnings

    monkeypatch.delenv("TRANSFORMERS_VERBOSITY", raising=False)
    with cli._quiet_third_party():
        warnings.warn("torchvision is old", UserWarning)
        assert os.environ["TRANSFORMERS_VERBOSITY"] == "error"
    assert len(recwarn) == 0 and "TRANSFORMERS_VERBOSITY" not in os.environ
    warnings.warn("after", UserWarning)
    assert len(recwarn) == 1


ROOT = REQUEST.parent.parent


def test_export_scripts_run_without_an_activated_venv():
    """From the repository root with a PATH that has no venv (and no `systemone`): the script finds .venv."""
    import os
    import subprocess

    env = {**os.environ, "PATH": "/usr/bin:/bin"}
    env.pop("VIRTUAL_ENV", None)
    done = subprocess.run(["bash", "scripts/export_d3_edge.sh", "--help"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: systemone export")


def test_the_demo_refuses_a_busy_port_at_once():
    import os
    import socket
    import subprocess

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = subprocess.run(["bash", "scripts/demo.sh"], cwd=ROOT, env={**os.environ, "PORT": str(port)},
                              capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip() == (f"port {port} is in use; run the demo on another one: "
                                   "PORT=8766 bash scripts/demo.sh d3")
