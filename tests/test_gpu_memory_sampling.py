"""`systemone bench --serve --gpu-memory-peaks`: the most GPU memory the device and each server process held during
each load run, from nvidia-smi (here its output is given; no GPU on this machine)."""

from __future__ import annotations

import itertools
import time

from systemone.gpu_memory import PeakSampler, parse_process_mib


def test_process_memory_is_read_by_pid_and_unfilled_lines_are_left_out():
    out = "4242, 7316\n4343, 15120\n4444, [N/A]\n4242, 100\n"
    assert parse_process_mib(out) == {4242: 7416, 4343: 15120}
    assert parse_process_mib("") == {}


def test_the_sampler_keeps_each_value_s_peak_including_the_last_moment():
    readings = itertools.chain([{"device": 9000, "server": 7000}, {"device": 9500, "server": 6900}],
                               itertools.repeat({"device": 8000}))
    with PeakSampler(lambda: next(readings), interval=0.001) as sampler:
        time.sleep(0.05)
    assert sampler.peaks == {"device": 9500, "server": 7000}


def test_a_machine_without_nvidia_smi_reports_no_peaks():
    with PeakSampler(lambda: {}, interval=0.001) as sampler:
        pass
    assert sampler.peaks == {}
