"""Media pixel work in worker processes (--media-processes; runtime/pixel_workers.py): the same rows as in threads,
ended with its request, and never lost to a full shared memory or a dead process."""

from __future__ import annotations

import os
import threading
import time
from functools import partial

import numpy as np
import pytest

from systemone.models.errors import TimedOut
from systemone.runtime.d1.image_processor import Lfm2ImageConfig, lfm2_image
from systemone.runtime.deadline import Deadline
from systemone.runtime.image_transform import qwen_image
from systemone.runtime.pixel_workers import PixelWorkers

MEAN = STD = (0.5, 0.5, 0.5)


def add_part(inputs, out, part, stopped):
    """Rows [first, last) of `out` = the input's rows plus one."""
    first, last = part
    out[first:last] = inputs[0][first:last] + 1


def slow_part(inputs, out, part, stopped, seconds=30.0):
    """Works for `seconds` unless stopped first (a part of a long video)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end and not stopped():
        time.sleep(0.01)


def failing_part(inputs, out, part, stopped):
    raise ValueError("absolute aspect ratio must be smaller than 200")


def dying_part(inputs, out, part, stopped, parent):
    """Kills the worker process it runs in (an out-of-memory kill, say); in the parent it does the work."""
    if os.getpid() != parent:
        os._exit(1)
    add_part(inputs, out, part, stopped)


@pytest.fixture
def one_process(tmp_path):
    workers = PixelWorkers(processes=1, threads=2, directory=str(tmp_path), lone_images_here=False)
    workers.start()
    yield workers
    workers.close()


def fill_add(workers, source, fill=add_part, deadline=None):
    parts = [(0, 3), (3, len(source))]
    return workers.fill(fill, [source], source.shape, parts, deadline or Deadline())


def test_processes_threads_and_inline_give_the_same_image_rows(one_process):
    image = np.random.default_rng(0).integers(0, 256, (300, 500, 3), dtype=np.uint8)
    inline = qwen_image(image, 16, 2, 2, MEAN, STD, 65_536, 1_638_400)
    threads = qwen_image(image, 16, 2, 2, MEAN, STD, 65_536, 1_638_400, PixelWorkers(0))
    processes = qwen_image(image, 16, 2, 2, MEAN, STD, 65_536, 1_638_400, one_process)
    assert inline[1] == threads[1] == processes[1]
    assert np.array_equal(inline[0], threads[0]) and np.array_equal(inline[0], processes[0])
    assert one_process.fallbacks == 0 and one_process.in_processes == 1


@pytest.mark.parametrize("size", [(960, 1280), (300, 500)])  # tiles and a thumbnail, in parts; one crop
def test_d1_crops_are_the_same_in_processes_threads_and_inline(one_process, size):
    """d1's processor (LFM2-VL) in the pixel workers: the same crops, grids and patches wherever it ran."""
    image = np.random.default_rng(0).integers(0, 256, (*size, 3), dtype=np.uint8)
    config = Lfm2ImageConfig()
    ways = [lfm2_image(image, config), lfm2_image(image, config, PixelWorkers(0)),
            lfm2_image(image, config, one_process)]
    inline = ways[0]
    assert len(inline.crops) == (7 if size == (960, 1280) else 1)
    for other in ways[1:]:
        assert (other.rows, other.cols, other.image_tokens) == (inline.rows, inline.cols, inline.image_tokens)
        assert [c.grid for c in other.crops] == [c.grid for c in inline.crops]
        assert all(np.array_equal(a.patches, b.patches) for a, b in zip(inline.crops, other.crops, strict=True))
    assert one_process.in_processes == 1 and one_process.fallbacks == 0


def test_an_image_alone_runs_here_and_one_among_others_in_the_processes(tmp_path):
    """With no other job running the GIL costs nothing and threads here are quicker than shared memory."""
    workers = PixelWorkers(processes=2, directory=str(tmp_path))
    image = np.random.default_rng(1).integers(0, 256, (300, 500, 3), dtype=np.uint8)
    slow = Deadline(60)

    def busy() -> None:  # one part (of a two-input job: never run here), in one of the two processes until cancelled
        with pytest.raises(TimedOut):
            workers.fill(slow_part, [np.zeros(4), np.zeros(4)], (4,), [None], slow)

    try:
        qwen_image(image, 16, 2, 2, MEAN, STD, 65_536, 1_638_400, workers)
        assert workers.in_processes == 0
        other = threading.Thread(target=busy)
        other.start()
        while not os.listdir(tmp_path):  # the slow job's shared memory is made: it is running
            time.sleep(0.01)
        alone = qwen_image(image, 16, 2, 2, MEAN, STD, 65_536, 1_638_400)
        among = qwen_image(image, 16, 2, 2, MEAN, STD, 65_536, 1_638_400, workers)
        assert np.array_equal(alone[0], among[0])
        assert workers.in_processes == 1
        slow.cancel()
        other.join()
    finally:
        workers.close()


def test_every_part_is_written_and_no_shared_file_is_left(one_process, tmp_path):
    source = np.arange(40, dtype=np.float32).reshape(8, 5)
    assert np.array_equal(fill_add(one_process, source), source + 1)
    assert os.listdir(tmp_path) == []


def test_a_passing_deadline_stops_the_part_in_its_process(one_process):
    """TimedOut at the deadline, and the process is free at once for the next job (the part stopped, it did not
    work on for 30 s)."""
    source = np.zeros((8, 5), dtype=np.float32)
    start = time.monotonic()
    with pytest.raises(TimedOut, match="--request-timeout"):
        fill_add(one_process, source, slow_part, Deadline(0.5))
    assert time.monotonic() - start < 5
    start = time.monotonic()
    assert np.array_equal(fill_add(one_process, source), source + 1)
    assert time.monotonic() - start < 5


def test_an_abandoned_request_stops_its_parts(one_process):
    """A cancel (the client went away, or another of the request's media failed) ends the wait and the work."""
    deadline = Deadline(60)
    threading.Timer(0.3, deadline.cancel).start()
    start = time.monotonic()
    with pytest.raises(TimedOut):
        fill_add(one_process, np.zeros((8, 5), dtype=np.float32), slow_part, deadline)
    assert time.monotonic() - start < 5
    source = np.ones((8, 5), dtype=np.float32)
    assert np.array_equal(fill_add(one_process, source), source + 1)


def test_a_part_error_reaches_the_caller_as_itself(one_process):
    with pytest.raises(ValueError, match="aspect ratio"):
        fill_add(one_process, np.zeros((8, 5), dtype=np.float32), failing_part)


def test_no_shared_memory_means_threads_here_not_a_failure():
    workers = PixelWorkers(processes=1, directory="/nonexistent/shared-memory", lone_images_here=False)
    source = np.arange(40, dtype=np.float32).reshape(8, 5)
    try:
        assert np.array_equal(fill_add(workers, source), source + 1)
        assert workers.fallbacks == 1
    finally:
        workers.close()


def test_a_dead_process_costs_its_job_a_rerun_here_and_the_pool_is_replaced(one_process):
    source = np.arange(40, dtype=np.float32).reshape(8, 5)
    assert np.array_equal(fill_add(one_process, source, partial(dying_part, parent=os.getpid())), source + 1)
    assert one_process.fallbacks == 1
    assert np.array_equal(fill_add(one_process, source), source + 1)  # in a new process
    assert one_process.fallbacks == 1


def test_blocks_left_by_a_killed_server_are_removed_at_start(tmp_path):
    """A server killed mid-job leaves its blocks behind; the next start deletes them, and nobody else's."""
    import subprocess
    import sys

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(gone.stdout)
    for name in (f"systemone-{dead_pid}-0", f"systemone-{os.getpid()}-7", "other-file"):
        (tmp_path / name).write_bytes(b"x")
    workers = PixelWorkers(processes=1, directory=str(tmp_path))
    try:
        workers.start()
        assert sorted(os.listdir(tmp_path)) == sorted([f"systemone-{os.getpid()}-7", "other-file"])
    finally:
        workers.close()


def test_worker_processes_leave_when_their_server_is_killed_outright(tmp_path):
    """A server killed with SIGKILL (or by the OOM killer) shuts nothing down: its worker processes go by themselves."""
    import signal
    import subprocess
    import sys

    server = subprocess.Popen([sys.executable, "-c", f"""
import os, time
from systemone.runtime.pixel_workers import PixelWorkers
workers = PixelWorkers(processes=2, directory={str(tmp_path)!r})
workers.start()
print(" ".join(str(p) for p in workers._executor()._processes), flush=True)
time.sleep(600)
"""], stdout=subprocess.PIPE, text=True)
    try:
        children = [int(pid) for pid in server.stdout.readline().split()]
        assert len(children) == 2 and all(_alive(pid) for pid in children)
    finally:
        server.send_signal(signal.SIGKILL)
        server.wait()
    end = time.monotonic() + 10
    while any(_alive(pid) for pid in children) and time.monotonic() < end:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in children)


def _alive(pid: int) -> bool:
    """`pid` runs (a zombie counts as gone: only its parent, gone too, could reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
