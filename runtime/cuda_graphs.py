"""CUDA graphs for a text graph's small runs (docs/decisions/cuda-graph-buckets.md): d3's rows, and d1's whole
prompts from an empty state (its one-question requests; a prefix and its suffix reads have a past of any length and
run uncaptured).

A batch of a few short prompts is bound by launches, not arithmetic: hundreds of small kernels, each with
onnxruntime's host-side work around it. onnxruntime's CUDA provider can capture a whole run as one CUDA graph and
replay it with one launch, at one set of shapes and buffer addresses. So a captured session runs each (batch,
length) bucket on its own device buffers, bound once (IO binding), under its own graph id; rows are padded up to the
bucket, which right padding makes exact (each row is read at its own last token; padded keys are masked).
Larger batches are bound by arithmetic and run as before, uncaptured.

onnxruntime refuses to capture a graph with control flow (the portable graph's Scan) or with nodes off the CUDA
provider; such a graph runs uncaptured, and the session says why.

Two facts of onnxruntime's CUDA provider (1.31) decide when and where capturing happens. It keeps a captured graph,
and the count of plain runs before capturing, in the calling thread's own context, and it captures on a graph id's
third run there (two plain runs first, for the arena to grow). And a capture runs in CUDA's global capture mode: a
synchronizing call from any other thread meanwhile (the vision graph's run, in the scheduler's media lane) fails,
and the capture with it. So every bucket is captured at warm-up, three runs each, on the thread that will replay it,
before any other thread runs a graph; afterwards that thread only replays, and other threads run uncaptured: no
capture ever happens while serving.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

GRAPH_ID = "gpu_graph_id"
UNCAPTURED = "-1"  # onnxruntime's graph id for a run that neither captures nor replays


@dataclass(frozen=True)
class CaptureBuckets:
    """The (batch, length) shapes captured: every batch and length bucket whose tokens fit `max_tokens`."""

    batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    # Finer where prompts are short (padding a 136-token prompt to 256 would cost it 88% more work).
    lengths: tuple[int, ...] = (32, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)
    # Past about 4096 tokens a run is bound by arithmetic: on the H200 (d3-nano, cuda-fused-mixed) batch 32 x 200
    # took 70.2 ms captured (padded to 224) and 66.2 ms uncaptured, while batch 8 x 200 gained (18.5 ms, 19.0 ms).
    max_tokens: int = 4096

    def bucket(self, batch: int, length: int) -> tuple[int, int] | None:
        """The smallest captured shape that holds `batch` rows of up to `length` tokens, if one does."""
        rows = next((b for b in self.batches if b >= batch), None)
        width = next((n for n in self.lengths if n >= length), None)
        if rows is None or width is None or rows * width > self.max_tokens:
            return None
        return rows, width

    def shapes(self) -> list[tuple[int, int]]:
        return [(b, n) for b in self.batches for n in self.lengths if b * n <= self.max_tokens]


def uncaptured(run_options: ort.RunOptions | None) -> ort.RunOptions:
    """`run_options` (or new ones) for a run of a capturing session that must not capture or replay. Options
    already marked are left as they are (a request's options serve all its calls: onnxruntime warns each time an
    entry is set again)."""
    run_options = run_options or ort.RunOptions()
    try:
        if run_options.get_run_config_entry(GRAPH_ID) == UNCAPTURED:
            return run_options
    except RuntimeError:  # no graph id set yet
        pass
    run_options.add_run_config_entry(GRAPH_ID, UNCAPTURED)
    return run_options


_ITEM_BYTES = {"tensor(float)": 4, "tensor(float16)": 2, "tensor(bfloat16)": 2, "tensor(int64)": 8, "tensor(int32)": 4,
               "tensor(bool)": 1, "tensor(double)": 8}


def _nbytes(value: ort.OrtValue) -> int:
    return int(np.prod(value.shape())) * _ITEM_BYTES[value.data_type()]


class _Scratch:
    """Device memory shared by every bucket. For the outputs no caller reads (the state d1's and causal d3's rows
    add from an empty state): one buffer per output; replays run one at a time, so one bucket's unread state may
    overwrite another's. A buffer too small for a new bucket is replaced by a larger one; the buckets captured on
    the old one keep it (a CUDA graph holds its buffers' addresses), so `capture_buckets` captures the largest
    buckets first. And for the read-only inputs every bucket is fed alike (causal d3's zero state, 18 MB at
    d3-nano: 60 buckets would hold a gigabyte of copies): one device copy each, never written."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.buffers: dict[str, ort.OrtValue] = {}
        self.constants: dict[int, tuple[np.ndarray, ort.OrtValue]] = {}  # by the array's id, the array kept alive

    def constant(self, value: np.ndarray) -> ort.OrtValue:
        held = self.constants.get(id(value))
        if held is None:
            held = self.constants[id(value)] = (value, ort.OrtValue.ortvalue_from_numpy(value, self.device, 0))
        return held[1]

    def buffer(self, name: str, nbytes: int) -> ort.OrtValue:
        held = self.buffers.get(name)
        if held is None or held.shape()[0] < nbytes:
            held = ort.OrtValue.ortvalue_from_shape_and_type([max(nbytes, 1)], np.uint8, self.device, 0)
            self.buffers[name] = held
        return held


class _Binding:
    """One captured shape: device buffers for its inputs and outputs, bound once, and its graph id. Outputs at
    `read` get buffers of their own; the others go into `scratch` (all outputs are read where `read` is None)."""

    def __init__(self, session: ort.InferenceSession, feeds: dict[str, np.ndarray], graph_id: int,
                 read: Sequence[int] | None, scratch: _Scratch):
        device = scratch.device
        # The outputs' shapes come from one uncaptured run at these shapes, its outputs left on the device (d1's
        # state at a large bucket is about 100 MB that a copy to the host would add to start-up).
        probe = session.io_binding()
        held = [np.ascontiguousarray(value) for value in feeds.values()]  # alive until the run has read them
        for name, value in zip(feeds, held, strict=True):
            probe.bind_cpu_input(name, value)
        for meta in session.get_outputs():
            probe.bind_output(meta.name, device, 0)
        session.run_with_iobinding(probe, uncaptured(None))
        outputs = probe.get_outputs()
        self.count = len(outputs)
        self.read = set(range(self.count) if read is None else read)
        # Read-only feeds (a causal d3 graph's zero state) are bound to the scratch's one copy and never copied
        # again: the same array (a shape's key names it) cannot have changed.
        self.constant = {name: value for name, value in feeds.items()
                         if isinstance(value, np.ndarray) and not value.flags.writeable}
        self.inputs = {name: (scratch.constant(value) if name in self.constant
                              else ort.OrtValue.ortvalue_from_numpy(value, device, 0))
                       for name, value in zip(feeds, held, strict=True)}
        self.binding = session.io_binding()
        for name, value in self.inputs.items():
            self.binding.bind_ortvalue_input(name, value)
        self.outputs: dict[int, ort.OrtValue] = {}
        # The device memory this shape holds on its own (its scratch is shared).
        self.nbytes = (sum(v.nbytes for name, v in zip(feeds, held, strict=True) if name not in self.constant)
                       + sum(_nbytes(outputs[i]) for i in self.read))
        self.held: list[ort.OrtValue] = []  # the scratch buffers this shape's graph writes to, alive while it is
        for i, (meta, out) in enumerate(zip(session.get_outputs(), outputs, strict=True)):
            if i in self.read:
                self.outputs[i] = ort.OrtValue.ortvalue_from_shape_and_type(out.shape(), out.element_type(), device, 0)
                self.binding.bind_ortvalue_output(meta.name, self.outputs[i])
            else:
                self.held.append(scratch.buffer(meta.name, _nbytes(out)))
                self.binding.bind_output(meta.name, device, 0, out.element_type(), out.shape(),
                                         self.held[-1].data_ptr())
        self.run_options = ort.RunOptions()
        self.run_options.add_run_config_entry(GRAPH_ID, str(graph_id))


# onnxruntime's CUDA provider captures a graph id on its third run in a thread (cuda_execution_provider.h:
# min_num_runs_before_cuda_graph_capture_ = 2 plain runs first).
RUNS_TO_CAPTURE = 3


class CapturedRuns:
    """A capturing session's runs at captured shapes: the feeds copied into the shape's buffers, the graph replayed,
    the outputs copied back. One run at a time: the buffers are shared. Only the thread that captured replays, and
    only the shapes it captured; a capture happens only inside `capturing_here`."""

    def __init__(self, session: ort.InferenceSession, device: str = "cuda"):
        self.session = session
        self.bindings: dict[tuple, _Binding] = {}
        self.scratch = _Scratch(device)  # the CPU only in tests: onnxruntime captures on CUDA alone
        self.too_large: set[tuple] = set()  # shapes whose plain run did not fit the arena: never captured
        self.lock = threading.Lock()
        self.thread: int | None = None  # the thread whose context holds the captured graphs
        self.capturing = False

    @contextmanager
    def capturing_here(self) -> Iterator[None]:
        """Runs in this block capture (on each shape's third run) in this thread, which replays them from now on."""
        self.thread, self.capturing = threading.get_ident(), True
        try:
            yield
        finally:
            self.capturing = False

    def on_this_thread(self) -> bool:
        """Whether this is the thread that captures and replays."""
        return threading.get_ident() == self.thread

    def replays(self, feeds: dict[str, np.ndarray]) -> bool:
        """Whether this run is a replay (or, at warm-up, a capture): the capturing thread, a captured shape."""
        return self.on_this_thread() and (self.capturing or self._key(feeds) in self.bindings)

    @staticmethod
    def _key(feeds: dict[str, np.ndarray]) -> tuple:
        """A shape's key: each feed's shape and type, and a read-only feed's identity (its one device copy)."""
        return tuple((name, value.shape, value.dtype.str, None if value.flags.writeable else id(value))
                     for name, value in sorted(feeds.items()))

    def refused(self, feeds: dict[str, np.ndarray]) -> bool:
        return self._key(feeds) in self.too_large

    def nbytes(self) -> int:
        """The device memory the captured shapes' buffers hold, their shared scratch included."""
        held = {id(buffer): buffer for binding in self.bindings.values() for buffer in binding.held}
        return (sum(b.nbytes for b in self.bindings.values()) + sum(b.shape()[0] for b in held.values())
                + sum(value.nbytes for value, _ in self.scratch.constants.values()))

    def run(self, feeds: dict[str, np.ndarray], outputs: Sequence[int] | None = None) -> list[np.ndarray]:
        """The replay's outputs copied back: all of them, or those at `outputs` (d1's reads; the state its rows add
        goes to the shared scratch). A shape's first run fixes which outputs it can give back."""
        key = self._key(feeds)
        with self.lock:
            binding = self.bindings.get(key)
            if binding is None:
                # Graph ids from 1: an unset id means 0, and a run that sets none must not replay a bucket. The
                # binding's plain run comes before any capture: a shape too large for the arena fails there, and
                # is not captured (a capture cut short would leave the stream capturing).
                try:
                    binding = _Binding(self.session, feeds, len(self.bindings) + 1, outputs, self.scratch)
                except Exception:
                    self.too_large.add(key)
                    raise
                self.bindings[key] = binding
            else:
                for name, value in binding.inputs.items():
                    if name not in binding.constant:
                        value.update_inplace(np.ascontiguousarray(feeds[name]))
            self.session.run_with_iobinding(binding.binding, binding.run_options)
            wanted = range(binding.count) if outputs is None else outputs
            if not binding.read.issuperset(wanted):
                raise RuntimeError(f"outputs {sorted(set(wanted) - binding.read)} of this captured shape go to scratch")
            return [binding.outputs[i].numpy() for i in wanted]
