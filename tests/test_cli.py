"""The `systemone` command as a user meets it: every mistake is one line on stderr and a non-zero exit (a traceback
only with --debug), every flag says what it does and its default, `serve` says what it serves."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from systemone import cli
from systemone.local_server import free_port
from systemone.server import lifecycle

REQUEST = Path(__file__).resolve().parent.parent / "scripts" / "demo_request.json"


def run(capsys, *argv: str) -> tuple[int, str, str]:
    if argv[0] == "serve" and "--port" not in argv:
        argv = (*argv, "--port", "0")  # any free port: a fixed one may be held by another server on the machine
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
    assert_one_line_error(code, err, "does not exist: give an exported artifact (a directory with manifest.json), "
                                     "a checkpoint directory or a hub id")


def test_a_directory_that_is_neither_artifact_nor_checkpoint_is_one_line(capsys, tmp_path):
    code, _, err = run(capsys, "serve", str(tmp_path))
    assert_one_line_error(code, err, "is not an exported artifact (it has no manifest.json) nor a checkpoint "
                                     "directory (it has no config.json)")


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
        cli.main(["serve", str(tmp_path), "--debug", "--port", "0"])


def test_an_unavailable_device_is_one_line(capsys, d3_artifact):
    code, _, err = run(capsys, "serve", str(d3_artifact), "--device", "cuda")
    assert_one_line_error(code, err, "device 'cuda' needs CUDAExecutionProvider")


def test_serve_prints_what_it_serves(capsys, d3_artifact, monkeypatch):
    monkeypatch.setattr(lifecycle, "run_server", lambda app, listener, stop, **kwargs: None)
    port = free_port()
    code, out, _ = run(capsys, "serve", str(d3_artifact), "--device", "cpu", "--port", str(port))
    assert code == 0
    summary = dict(line.removeprefix("systemone serve: ").split(None, 1) for line in out.splitlines()
                   if not line.startswith("systemone serve: max"))
    assert summary["model"] == "d3-tiny (also answers to jev-latest)"
    assert summary["artifact"] == f"{d3_artifact} (family d3, source d3-tiny)"
    assert summary["provider"] == "CPUExecutionProvider (--device cpu)"
    assert summary["precision"] == "portable form (float32)"
    assert summary["address"] == f"http://127.0.0.1:{port}/v1/systemone"


@pytest.mark.parametrize(("environ", "flags", "said"), [
    ({}, (), "none: media URLs are fetched directly"),
    ({"HTTPS_PROXY": "http://user:pw@proxy.example:3128", "no_proxy": "localhost"}, (),
     "media fetches through http://proxy.example:3128 (https URLs), not for localhost"),
    ({"all_proxy": "socks5://proxy.example:1080"}, ("--no-media-proxy",),
     "none: media URLs are fetched directly (--no-media-proxy)")])
def test_serve_says_which_proxy_media_fetches_take_never_its_password(capsys, d3_artifact, monkeypatch, environ,
                                                                      flags, said):
    for name in ("http_proxy", "https_proxy", "all_proxy", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(lifecycle, "run_server", lambda app, listener, stop, **kwargs: None)
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
    given = {}
    monkeypatch.setattr(lifecycle, "run_server", lambda app, listener, stop, **kwargs: given.update(kwargs))
    code, _, _ = run(capsys, "serve", str(d3_artifact), "--device", "cpu", *flags)
    assert code == 0
    assert given["access_log"] is access_log


@pytest.mark.parametrize(("flags", "parser", "loop"), [((), "httptools", "uvloop"),
                                                        (("--http", "h11", "--loop", "asyncio"), "h11", "asyncio")])
def test_serve_runs_the_c_parser_and_uvloop_unless_told_otherwise_and_says_which(capsys, d3_artifact, monkeypatch,
                                                                                   flags, parser, loop):
    given = {}
    monkeypatch.setattr(lifecycle, "run_server", lambda app, listener, stop, **kwargs: given.update(kwargs))
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

    monkeypatch.setitem(sys.modules, missing, None)  # an import of it fails, as when it is not installed
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == missing else find_spec(name, *a))
    monkeypatch.setattr(cli, "_service", lambda args: pytest.fail("the model was loaded"))
    monkeypatch.setattr(lifecycle, "run_server", lambda *args, **kwargs: pytest.fail("the server ran"))
    code, _, err = run(capsys, "serve", str(d3_artifact), "--device", "cpu", *flags)
    assert code == 2
    assert message in err


@pytest.mark.parametrize(("flag", "held"), [("4096", "4096"), ("512", "1024")])
def test_max_batch_tokens_bounds_a_text_graph_call_but_never_below_the_longest_d3_prompt(capsys, d3_artifact,
                                                                                          monkeypatch, flag, held):
    monkeypatch.setattr(lifecycle, "run_server", lambda app, listener, stop, **kwargs: None)
    code, out, _ = run(capsys, "serve", str(d3_artifact), "--device", "cpu", "--max-model-len", "1024",
                       "--max-batch-tokens", flag)
    assert code == 0
    assert f"systemone serve: batch tokens  {held} padded tokens a call at most" in out.splitlines()


@pytest.mark.parametrize(("artifact", "flags", "said"), [
    ("d3_artifact", [], "none: the text graph carries no state"),
    ("d3_causal_artifact", [], "on: a request's shared prefix read once where it saves more than a call"),
    ("d3_causal_artifact", ["--no-prefix-reuse"], "off (--no-prefix-reuse): every whole prompt is read")])
def test_serve_says_whether_a_requests_shared_prefix_is_read_once(capsys, monkeypatch, request, artifact, flags, said):
    monkeypatch.setattr(lifecycle, "run_server", lambda app, listener, stop, **kwargs: None)
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


def without(module: str, *argv: str) -> subprocess.CompletedProcess:
    """`systemone ARGV` run from the checkout's root in a Python where `module` does not import (as when the extra
    that brings it is not installed)."""
    script = (f"import sys; sys.modules[{module!r}] = None\n"
              f"from systemone.cli import main\nsys.exit(main({list(argv)!r}))")
    return subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_an_install_without_onnxruntime_names_the_extra_as_this_checkout_installs_it(d3_artifact):
    """The base install has no onnxruntime (one flavour comes from an extra); serving says which to install, with
    the command that installs it here: this is a source checkout."""
    done = without("onnxruntime", "serve", str(d3_artifact), "--port", "0")
    assert_one_line_error(done.returncode, done.stderr, "onnxruntime is not installed",
                          "pip install -e '.[cpu]' (CPU), pip install -e '.[gpu]' (NVIDIA, CUDA) or "
                          "pip install -e '.[rocm]' (AMD)")


def test_export_without_its_extra_names_the_extra(d3_checkpoint, tmp_path):
    done = without("torch", "export", str(d3_checkpoint), "--out", str(tmp_path / "out"))
    assert_one_line_error(done.returncode, done.stderr, "`systemone export` needs the [export] extra (torch is not "
                          "installed): pip install -e '.[export,cpu]'")


def test_an_installed_package_is_told_to_install_from_the_package_index(monkeypatch):
    from systemone import install

    monkeypatch.setattr(install, "source_checkout", lambda: None)
    assert install.missing_module_hint("onnxruntime", "serve").startswith(
        "onnxruntime is not installed: install exactly one flavour, pip install 'systemone-onnx[cpu]' (CPU)")
    assert install.missing_module_hint("transformers.models", "serve").endswith(
        "(transformers is not installed): pip install 'systemone-onnx[export,cpu]'")


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


def test_the_top_help_says_what_each_command_does_for_a_user(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    text = capsys.readouterr().out
    assert "systemone serve MODEL" in text and "systemone doctor [ARTIFACT]" in text
    for command in ("export", "serve", "doctor", "bench", "ask", "render"):
        assert f"\n    {command} " in text, command
    assert "export/" not in text and "runtime/" not in text  # what it does, not where its code lives


@pytest.mark.parametrize("port", ["99999", "-1", "65536", "http"])
def test_a_port_out_of_range_is_one_line_when_the_arguments_are_parsed(capsys, port, monkeypatch):
    monkeypatch.setattr(cli, "_service", lambda args: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit) as exit_:
        cli.main(["serve", "any-model", "--port", port])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert_one_line_error(2, err, "argument --port: a port is a number from 1 to 65535 (0: any free port)")


def test_port_0_takes_a_free_port_and_the_address_line_names_it(capsys, d3_artifact, monkeypatch):
    bound = {}
    monkeypatch.setattr(lifecycle, "run_server",
                        lambda app, listener, stop, **kwargs: bound.update(port=listener.getsockname()[1]))
    code, out, _ = run(capsys, "serve", str(d3_artifact), "--device", "cpu", "--port", "0")
    assert code == 0 and bound["port"] != 0
    assert f"systemone serve: address       http://127.0.0.1:{bound['port']}/v1/systemone" in out.splitlines()


def test_a_busy_port_is_one_line_before_the_model_loads(capsys, d3_artifact, monkeypatch):
    import socket

    monkeypatch.setattr(cli, "_service", lambda args: pytest.fail("the model was loaded"))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, out, err = run(capsys, "serve", str(d3_artifact), "--device", "cpu", "--port", str(port))
    assert code == 2 and out == ""
    assert err == (f"systemone serve: port {port} on 127.0.0.1 is in use: stop what holds it, or pick another with "
                   "--port (--port 0: any free port)\n")


def test_render_needs_no_model_name(capsys, d3_artifact, tmp_path):
    request = tmp_path / "request.json"
    request.write_text(json.dumps({**json.loads(REQUEST.read_text()), "model": "some-other-served-name"}))
    code, out, _ = run(capsys, "render", str(d3_artifact), "--request", str(request), "--device", "cpu",
                       "--format", "json")
    assert code == 0 and [q["id"] for q in json.loads(out)["questions"]] == ["urgent", "team", "anger"]


def test_the_sample_request_names_no_model_so_any_served_model_answers_it(capsys, d1_artifact):
    assert "model" not in json.loads(REQUEST.read_text())
    code, out, _ = run(capsys, "ask", str(d1_artifact), "--request", str(REQUEST), "--device", "cpu")
    assert code == 0 and json.loads(out)["model"] == "d1-tiny"


def serve_process(artifact, *flags: str) -> tuple[subprocess.Popen, str, list[str]]:
    """`systemone serve ARTIFACT` on a free port in a subprocess, once /health answers: the process, its base URL
    and the lines of its output so far (a thread keeps reading them)."""
    import re
    import threading
    import time
    import urllib.request

    server = subprocess.Popen([sys.executable, "-m", "systemone.cli", "serve", str(artifact), "--device", "cpu",
                               "--port", "0", *flags], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
    lines: list[str] = []
    base = None
    while base is None:
        line = server.stdout.readline()
        assert line, "".join(lines)
        lines.append(line)
        found = re.search(r"address +(http://127\.0\.0\.1:\d+)/v1/systemone", line)
        base = found.group(1) if found else None
    threading.Thread(target=lambda: lines.extend(server.stdout), daemon=True).start()
    # The address is printed once the port is bound, a moment before it accepts: a refused try is retried (600
    # immediate tries ran out within that moment on a loaded two-core host).
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(base + "/health", timeout=1)
            break
        except OSError:
            assert server.poll() is None, "".join(lines)
            assert time.monotonic() < deadline, "/health did not answer within 60 s:\n" + "".join(lines)
            time.sleep(0.05)
    return server, base, lines


def post(base: str, body: dict) -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    request = urllib.request.Request(base + "/v1/systemone", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_the_pure_python_parser_and_loop_serve_and_stop_without_a_traceback(d3_artifact):
    import signal

    server, base, lines = serve_process(d3_artifact, "--http", "h11", "--loop", "asyncio", "--max-batch-rows", "8")
    try:
        status, answer = post(base, json.loads(REQUEST.read_text()))
        assert status == 200 and answer["model"] == "d3-tiny"
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(timeout=60)
    assert server.returncode == 0
    assert "systemone serve: http          h11 parser, asyncio event loop\n" in lines
    assert not any("Traceback" in line or "Error" in line for line in lines), "".join(lines)


def test_a_second_ctrl_c_answers_the_requests_in_flight_503_and_logs_one_line(d3_artifact):
    """The first Ctrl-C waits for the requests in flight; the second answers them 503 with Retry-After (not a 500,
    not 75 lines of CancelledError) and the server stops."""
    import signal
    import threading
    import time
    import urllib.request

    server, base, lines = serve_process(d3_artifact, "--max-batch-rows", "8", "--request-timeout", "300")
    slow = {"state": {"ticket": "word " * 3000},  # 64 questions of about 3,000 tokens: seconds on two cores
            "questions": {f"q{i}": {"type": "noul", "instructions": f"Question {i}?"} for i in range(64)}}
    answers: list[tuple[int, dict]] = []
    try:
        clients = [threading.Thread(target=lambda: answers.append(post(base, slow))) for _ in range(2)]
        for client in clients:
            client.start()
        for _ in range(600):  # until both are admitted: in flight
            assert server.poll() is None, "".join(lines)
            if json.loads(urllib.request.urlopen(base + "/ready", timeout=5).read())["running"] == 2:
                break
            time.sleep(0.05)
        server.send_signal(signal.SIGINT)
        time.sleep(0.5)
        server.send_signal(signal.SIGINT)
        for client in clients:
            client.join(timeout=60)
        server.wait(timeout=60)
    finally:
        server.kill()
    assert [status for status, _ in answers] == [503, 503]
    assert all(body["error"]["message"].startswith("the server is stopping (Ctrl-C twice)") for _, body in answers)
    output = "".join(lines)
    assert "Traceback" not in output and "CancelledError" not in output, output
    assert [line for line in lines if "second Ctrl-C" in line] == [
        line for line in lines if line.endswith("WARNING systemone.server: second Ctrl-C: 2 request(s) in flight "
                                                "answered 503; stopping\n")]
    assert sum("second Ctrl-C" in line for line in lines) == 1


def test_five_starts_of_one_artifact_choose_the_same_rows_a_call(capsys, d3_artifact, monkeypatch, tmp_path):
    """The first start measures the rows a call and keeps the choice for this artifact on this machine; the next
    four take it, whatever the host's load at their start (docs/decisions/batch-rows.md)."""
    monkeypatch.setattr(lifecycle, "run_server", lambda app, listener, stop, **kwargs: None)
    said = []
    for _ in range(5):
        code, out, _ = run(capsys, "serve", str(d3_artifact), "--device", "cpu", "--cache-dir", str(tmp_path))
        assert code == 0
        said.append(next(line for line in out.splitlines() if line.startswith("systemone serve: batch rows")))
    assert len({line.split(" (")[0] for line in said}) == 1
    assert "measured now, kept in" in said[0] and all("kept from an earlier start" in line for line in said[1:])
