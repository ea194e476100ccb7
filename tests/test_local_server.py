"""The scripts' and tests' server start-up: a server that exits, or never answers /health, is a clear error (the
URL, the deadline, the server's last words), not a silent wait. The server that does answer is in test_connections."""

from __future__ import annotations

import subprocess
import sys

import pytest

from systemone.local_server import ServerDidNotStart, free_port, start_server


def test_a_server_that_exits_is_named_with_its_output(tmp_path):
    base = f"http://127.0.0.1:{free_port()}"
    command = [sys.executable, "-c", "import sys; print('serving'); sys.exit('error: no artifact here')"]
    with open(tmp_path / "server.log", "wb") as log, pytest.raises(ServerDidNotStart) as caught:
        start_server(command, base, 30, stdout=subprocess.PIPE, stderr=log)  # a PIPE and a file: both read
    message = str(caught.value)
    assert f"exited with 1 before {base}/health answered (deadline 30 s)" in message
    assert message.endswith("serving\nerror: no artifact here\n")


def test_a_server_that_never_answers_is_stopped_at_the_deadline():
    base = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ServerDidNotStart, match=f"{base}/health did not answer within 0.5 s"):
        start_server([sys.executable, "-c", "import time; time.sleep(60)"], base, 0.5)
