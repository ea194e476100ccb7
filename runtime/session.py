"""onnxruntime sessions: execution-provider choice and a thin run wrapper (no torch at serve time)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Mapping, MutableMapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import os

import numpy as np
import onnxruntime as ort

from ..models.errors import DeviceMemoryExhausted
from .cuda_graphs import RUNS_TO_CAPTURE, CaptureBuckets, CapturedRuns, uncaptured
from .devices import CPU, DEVICES, ProviderUnavailable, device_of, pick_providers
from .linked_weights import make_weights, read_links

__all__ = ["DEVICES", "GraphSession", "ProviderUnavailable", "resolve_device", "resolve_providers"]
CUDA = "CUDAExecutionProvider"


def resolve_providers(device: str) -> list[str]:
    """The providers for `device` in this onnxruntime (see devices.pick_providers)."""
    return pick_providers(device, ort.get_available_providers())


def resolve_device(device: str) -> str:
    """The device (cuda, rocm, cpu) that `device` ("auto" included) runs on in this onnxruntime."""
    return device_of(resolve_providers(device)[0])


def provider_options(provider: str, gpu_memory: int | None, capture: bool = False) -> dict[str, str]:
    if provider != CUDA:
        return {}
    # fp32 graphs stay fp32 on NVIDIA GPUs: no TF32 matmuls, whose 10-bit mantissa would move probabilities.
    # The arena grows by what a run asks, not by doubling, and never past --gpu-memory: the default doubling kept
    # what the longest batch once took, and more (44 GB for a 1.9B-parameter model).
    options = {"use_tf32": "0", "arena_extend_strategy": "kSameAsRequested"}
    if gpu_memory:
        options["gpu_mem_limit"] = str(gpu_memory)
    if capture:
        options["enable_cuda_graph"] = "1"
    return options


# onnxruntime's CUDA provider reads this once a process, at its first fp16 matrix product; bit 0x02 forbids cuBLAS to
# reduce split-K partial sums in fp16. Left to cuBLAS, the reduction's precision follows the product's shape, so a
# question's answer moved with the rows it shared a call with (docs/decisions/form-gate-batching.md).
GEMM_OPTIONS = "ORT_CUDA_GEMM_OPTIONS"
FP32_REDUCTIONS = "2"


def reduce_products_in_fp32(environ: MutableMapping[str, str] = os.environ) -> None:
    """Before the first CUDA session: fp16 products reduce in fp32, unless the user set the variable."""
    environ.setdefault(GEMM_OPTIONS, FP32_REDUCTIONS)


# How onnxruntime words an arena that cannot grow (the BFC arena at --gpu-memory, or the device itself).
_MEMORY_ERRORS = ("Available memory of", "Failed to allocate memory", "out of memory")


@contextmanager
def memory_errors() -> Iterator[None]:
    """onnxruntime's allocation failures as `DeviceMemoryExhausted` (the caller may split the batch, or the client
    retry); every other error as it is."""
    try:
        yield
    except Exception as exc:
        if not any(marker in str(exc) for marker in _MEMORY_ERRORS):
            raise
        raise DeviceMemoryExhausted("the device memory the graph may use (--gpu-memory) cannot hold this run now; "
                                    "retry later") from exc


class GraphSession:
    """One ONNX graph on one device; with `capture` on the CUDA provider, its small runs as CUDA graphs
    (runtime/cuda_graphs.py) where onnxruntime can capture the graph (`capture_refused` says why not)."""

    def __init__(self, path: str | Path, device: str = "auto", threads: int | None = None,
                 gpu_memory: int | None = None, capture: CaptureBuckets | None = None, in_graph_order: bool = False):
        providers = resolve_providers(device)
        if providers[0] != CPU and hasattr(ort, "preload_dlls"):
            ort.preload_dlls()
        if providers[0] == CUDA:
            reduce_products_in_fp32()
        self.buckets: CaptureBuckets | None = None
        self.capture_refused: str | None = None
        self.captured: CapturedRuns | None = None
        # Weights linked to the checkpoint's files (runtime/linked_weights.py): made once, here, for whichever
        # session opens. onnxruntime reads them from these arrays while the session lives, so this object keeps them
        # (its Python binding takes only host buffers the caller owns, not values put on the GPU).
        links = read_links(Path(path))
        self.linked_weights = make_weights(links, Path(path).parent)
        linked = dict(zip((link.name for link in links), self.linked_weights))
        if capture is not None and providers[0] == CUDA:
            try:
                self.session = self._open(path, providers, threads, gpu_memory, linked, in_graph_order, capture=True)
                self.buckets, self.captured = capture, CapturedRuns(self.session)
            except Exception as exc:  # onnxruntime refuses capture at load: control flow, nodes off CUDA
                self.capture_refused = str(exc).splitlines()[0][:300]
        if self.captured is None:
            self.session = self._open(path, providers, threads, gpu_memory, linked, in_graph_order, capture=False)
        self.provider = self.session.get_providers()[0]
        if self.provider != providers[0]:
            raise ProviderUnavailable(f"onnxruntime could not start {providers[0]} for {Path(path).name} "
                                      f"(it started {self.provider})")
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.output_names = [o.name for o in self.session.get_outputs()]
        # Where the outputs a run does not fetch are left, and where `device_values` puts a run's inputs: the GPU's
        # memory on CUDA; elsewhere host memory (no device copies to save).
        self.device_type = "cuda" if self.provider == CUDA else "cpu"
        self.runs = 0

    @staticmethod
    def _open(path: str | Path, providers: list[str], threads: int | None, gpu_memory: int | None,
              linked: Mapping[str, np.ndarray], in_graph_order: bool, capture: bool) -> ort.InferenceSession:
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if in_graph_order:
            # A graph that casts each weight as a run reaches it (export/half_precision.py) must run in its own
            # order: onnxruntime's default order runs every cast first, every fp32 weight alive at once. Priority
            # order follows node indices, and the optimizer's rewritten nodes take new ones (d3 (27B) still ran out
            # of memory in a cast 20 layers ahead): no rewrites (docs/decisions/cuda-form-ladder.md). Its weights are
            # overridable initializers, which onnxruntime warns about one by one: errors only.
            options.execution_order = ort.ExecutionOrder.PRIORITY_BASED
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
            options.log_severity_level = 3
        if threads:
            options.intra_op_num_threads = threads
        # Without the CPU arena a run's memory goes back when it ends: with it, each new prompt length grew the
        # arena, and two long d3 prompts held twice the attention budget.
        options.enable_cpu_mem_arena = False
        # Nor memory patterns: with them a run takes its intermediates as one block sized for its input shapes, and
        # serving meets a new (rows, length, past) every few requests; glibc's heap kept 19-29 MB after 900 such
        # blocks on tiny d1 in some processes (none in others). Without, per-tensor allocations kept under 1 MB.
        options.enable_mem_pattern = False
        if linked:  # handed over by name, as views of the arrays (no copies)
            options.add_external_initializers(list(linked), [ort.OrtValue.ortvalue_from_numpy(array)
                                                             for array in linked.values()])
        return ort.InferenceSession(
            str(path), sess_options=options,
            providers=[(name, provider_options(name, gpu_memory, capture)) for name in providers])

    def capture_buckets(self, run: Callable[[int, int], object]) -> None:
        """Every bucket's CUDA graph captured now, in this thread, which alone replays them (runtime/cuda_graphs.py:
        call it on the thread that will run the graph, before any other thread runs one): `run(batch, length)`
        makes one run at that shape, RUNS_TO_CAPTURE times a bucket. Where a capture fails the session runs
        uncaptured and says why; a bucket the arena (--gpu-memory) cannot hold is left uncaptured."""
        if self.captured is None:
            return
        with self.captured.capturing_here():
            # The largest first: the scratch for unread outputs is allocated once, at its largest (cuda_graphs.py).
            for batch, length in sorted(self.buckets.shapes(), key=lambda s: (s[0] * s[1], s[0]), reverse=True):
                try:
                    for _ in range(RUNS_TO_CAPTURE):
                        run(batch, length)
                except DeviceMemoryExhausted:
                    continue
                except Exception as exc:  # onnxruntime's error, e.g. a kernel that cannot run inside a capture
                    self.stop_capturing(f"capturing failed: {str(exc).splitlines()[0][:300]}")
                    return

    def stop_capturing(self, reason: str) -> None:
        """Run everything uncaptured from now on (a capture that failed at start-up says why)."""
        self.buckets, self.captured, self.capture_refused = None, None, reason

    def describe_capture(self) -> str:
        if self.captured is not None:
            buckets = self.buckets
            left = (f"; {len(self.captured.too_large)} left uncaptured, too large for --gpu-memory"
                    if self.captured.too_large else "")
            done = (f"{len(self.captured.bindings)} (batch, length) buckets captured, their buffers "
                    f"{self.captured.nbytes() / 2**20:.0f} MiB" if self.captured.thread
                    else f"{len(buckets.shapes())} (batch, length) buckets to capture at warm-up")
            return (f"on: {done}, up to batch {max(buckets.batches)} and {max(buckets.lengths)} tokens "
                    f"({buckets.max_tokens} in all){left}")
        return f"off: capture refused ({self.capture_refused})" if self.capture_refused else "off"

    @property
    def captured_rows(self) -> int | None:
        """The most rows a captured call holds (None where nothing is captured): a call of more runs uncaptured."""
        return max(self.buckets.batches) if self.buckets is not None else None

    def capture_shape(self, batch: int, length: int) -> tuple[int, int] | None:
        """The captured (batch, length) bucket a run of `batch` rows of up to `length` tokens pads to, if any:
        none on a thread that does not replay (its runs are plain, and padding would only cost)."""
        if self.buckets is None or (self.captured is not None and not self.captured.on_this_thread()):
            return None
        return self.buckets.bucket(batch, length)

    def device_values(self, arrays: Sequence[np.ndarray | ort.OrtValue]) -> tuple[ort.OrtValue, ...]:
        """`arrays` copied to the session's device once (values already there kept), to feed several bound runs
        (a prefix's state read by every batch of its questions) without copying them again each time."""
        return tuple(a if isinstance(a, ort.OrtValue)
                     else ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(a), self.device_type, 0)
                     for a in arrays)

    def held(self, values: Sequence[ort.OrtValue]) -> tuple[ort.OrtValue, ...]:
        """`run_bound`'s device outputs made safe to keep past this session's next run (a prefix's state read by
        later calls). Where the session replays CUDA graphs they are copied, through the host, out of its arena: a
        captured graph writes its intermediates where it captured them, memory the arena counts free between runs
        and may have given to these outputs (docs/decisions/cuda-graph-buckets.md)."""
        if self.captured is None:
            return tuple(values)
        return self.device_values([value.numpy() for value in values])

    def run(self, feeds: Mapping[str, np.ndarray | ort.OrtValue], run_options: ort.RunOptions | None = None,
            fetch: Sequence[str] | None = None) -> list[np.ndarray]:
        """Run the graph; `run_options.terminate = True` from another thread stops a run in flight. A run its
        arena cannot hold (--gpu-memory) raises `DeviceMemoryExhausted`.

        Without `fetch`, every output comes back. With it, only the outputs it names, in its order: the others
        stay where the graph made them and are dropped (on a GPU, a d1 read's new state is hundreds of MB that
        copying back to the host took half the run), and `feeds` may hold `device_values`."""
        if fetch is None:
            self.runs += 1
            with memory_errors():
                return self.session.run(None, feeds, run_options if self.captured is None else uncaptured(run_options))
        outputs = self.run_bound(feeds, run_options, on_host=fetch)
        return [outputs[name].numpy() for name in fetch]

    def run_bound(self, feeds: Mapping[str, np.ndarray | ort.OrtValue], run_options: ort.RunOptions | None = None,
                  on_host: Collection[str] = ()) -> dict[str, ort.OrtValue]:
        """Run the graph with IO binding: every output by name, those in `on_host` copied to the host and the
        others left on the session's device until the next run (`held` keeps them longer: a prefix's state, fed
        to its questions' reads from there); `feeds` may hold `device_values`."""
        self.runs += 1
        if self.captured is not None:
            run_options = uncaptured(run_options)
        with memory_errors():
            binding = self.session.io_binding()
            held = []  # the host arrays the binding reads, alive until the run has copied them
            for name, value in feeds.items():
                if isinstance(value, ort.OrtValue):
                    binding.bind_ortvalue_input(name, value)
                else:
                    held.append(np.ascontiguousarray(value))
                    binding.bind_cpu_input(name, held[-1])
            for name in self.output_names:
                binding.bind_output(name, "cpu" if name in on_host else self.device_type)
            self.session.run_with_iobinding(binding, run_options)
            return dict(zip(self.output_names, binding.get_outputs(), strict=True))

    def run_captured(self, feeds: dict[str, np.ndarray], fetch: Sequence[str] | None = None) -> list[np.ndarray]:
        """Run feeds padded to a `capture_shape` bucket as that bucket's CUDA graph (a replay is too short to need
        stopping); the plain run where the session does not capture, or the bucket did not fit the arena. `fetch`
        as `run` takes it."""
        if self.captured is None or self.captured.refused(feeds) or not self.captured.replays(feeds):
            return self.run(feeds, fetch=fetch)
        self.runs += 1
        with memory_errors():
            return self.captured.run(feeds, None if fetch is None else [self.output_names.index(n) for n in fetch])
