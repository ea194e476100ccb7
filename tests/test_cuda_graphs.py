"""CUDA graphs for small text-graph runs (docs/decisions/cuda-graph-buckets.md): a run of a few short rows is padded
up to a captured (batch, length) bucket, and the padding changes no row's logits. The capture itself is onnxruntime's
and needs the CUDA provider (scripts/gpu/gpu_bench.sh checks it there); what is ours, the buckets and the padding,
is checked here on the CPU."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from systemone.runtime.artifact import Artifact
from systemone.runtime.batch import BatchBudget, TextRow
from systemone.runtime.cuda_graphs import GRAPH_ID, CaptureBuckets, CapturedRuns, uncaptured
from systemone.runtime.d1.label_reads import LABEL_SLOTS, LabelLogprobs, label_logprobs
from systemone.runtime.d1.state import layout_of
from systemone.runtime.d3.code_logits import CodeLogits, code_logits, row_feeds, text_positions
from systemone.runtime.session import GraphSession
from systemone.runtime.text_runner import TextRunner

READS = LabelLogprobs.fetch


def d3_runner(session: GraphSession, fields: dict, layout=None) -> TextRunner:
    return TextRunner(session, BatchBudget(), CodeLogits(int(fields["hidden_size"])), layout)


def d1_runner(session: GraphSession, fields: dict) -> TextRunner:
    return TextRunner(session, BatchBudget(), LabelLogprobs(int(fields["hidden_size"])), layout_of(fields))


def d1_reads(runner: TextRunner, prompts: list[list[int]], labels: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Whole prompts read in one call: the label log-probabilities and greedy tokens."""
    return label_logprobs(runner.run_batch([TextRow(p, label_ids=tuple(labels)) for p in prompts]), labels)


def test_a_run_pads_to_the_smallest_bucket_that_holds_it():
    buckets = CaptureBuckets(batches=(1, 2, 4, 8), lengths=(64, 128, 256), max_tokens=1024)
    assert buckets.bucket(1, 1) == (1, 64)
    assert buckets.bucket(3, 64) == (4, 64)
    assert buckets.bucket(3, 65) == (4, 128)
    assert buckets.bucket(8, 128) == (8, 128)
    assert buckets.bucket(8, 129) is None  # 8 x 256 tokens: past the bucket budget, runs uncaptured
    assert buckets.bucket(9, 10) is None and buckets.bucket(1, 257) is None
    assert (8, 256) not in buckets.shapes() and (4, 256) in buckets.shapes()


def test_the_default_buckets_are_fine_where_prompts_are_short():
    buckets = CaptureBuckets()
    assert buckets.bucket(1, 136) == (1, 160)  # a one-question request pads by 24 tokens, not to 256
    assert buckets.bucket(32, 120) == (32, 128)  # 64 clients' one-question text requests, two calls
    # Larger calls are bound by arithmetic, where padding costs more than the launches it saves.
    assert buckets.bucket(32, 200) is None and buckets.bucket(64, 100) is None
    assert buckets.bucket(8, 500) == (8, 512)


class RecordingSession(GraphSession):
    """A CPU session that pads as a capturing one does (no capture on the CPU: `run_captured` runs plainly)."""

    def __init__(self, path, buckets: CaptureBuckets):
        super().__init__(path, "cpu", capture=buckets)
        assert self.captured is None and self.describe_capture() == "off"  # the CPU provider captures nothing
        self.buckets = buckets
        self.captured_shapes: list[tuple[int, ...]] = []
        self.label_slots: list[tuple[int, ...] | None] = []

    def run_captured(self, feeds, fetch=None):
        self.captured_shapes.append(feeds["input_ids"].shape)
        self.label_slots.append(feeds["label_ids"].shape if "label_ids" in feeds else None)
        return super().run_captured(feeds, fetch)


def test_rows_padded_to_a_bucket_get_the_logits_they_get_alone(d3_artifact):
    fields = Artifact.load(d3_artifact).manifest.model
    plain = d3_runner(GraphSession(d3_artifact / "text.onnx", "cpu"), fields)
    padded_session = RecordingSession(d3_artifact / "text.onnx", CaptureBuckets(batches=(4,), lengths=(64,)))
    padded = d3_runner(padded_session, fields)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 5000, n).tolist() for n in (5, 17, 40)]
    rows = [TextRow(p, text_positions(len(p))) for p in prompts]
    got = code_logits(padded.run_batch(rows))
    assert padded_session.captured_shapes == [(4, 64)]  # one filler row, every row padded to 64 tokens
    for row, logits in zip(rows, got, strict=True):
        assert np.abs(logits - code_logits(plain.run_batch([row]))[0]).max() <= 1e-5
    # Past the buckets the run is the plain one.
    long_row = TextRow(rng.integers(0, 5000, 80).tolist())
    assert np.abs(code_logits(padded.run_batch([long_row])) - code_logits(plain.run_batch([long_row]))).max() == 0
    assert padded_session.captured_shapes == [(4, 64)]


def test_d1_prompts_padded_to_a_bucket_read_what_they_read_alone(d1_artifact):
    """d1's whole prompts from an empty state (one-question requests' rows) pad to a bucket as d3's do, and their
    labels to LABEL_SLOTS: each row's label log-probabilities and greedy token are the ones it gets alone. A call
    with more labels than the slots, or past the buckets, is the plain one."""
    fields = Artifact.load(d1_artifact).manifest.model
    plain = d1_runner(GraphSession(d1_artifact / "text.onnx", "cpu"), fields)
    session = RecordingSession(d1_artifact / "text.onnx", CaptureBuckets(batches=(4,), lengths=(64,)))
    padded = d1_runner(session, fields)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 5000, n).tolist() for n in (5, 17, 40)]
    labels = [5, 17, 300]
    logprobs, argmax = d1_reads(padded, prompts, labels)
    assert session.captured_shapes == [(4, 64)] and session.label_slots == [(LABEL_SLOTS,)]
    assert logprobs.shape == (3, 3) and argmax.shape == (3,)
    for prompt, got, top in zip(prompts, logprobs, argmax, strict=True):
        want, want_top = d1_reads(plain, [prompt], labels)
        assert np.abs(got - want[0]).max() <= 1e-5 and top == want_top[0]
    many = list(range(LABEL_SLOTS + 1))
    assert np.array_equal(d1_reads(padded, prompts[:1], many)[0], d1_reads(plain, prompts[:1], many)[0])
    assert np.array_equal(d1_reads(padded, [[7] * 80], labels)[0], d1_reads(plain, [[7] * 80], labels)[0])
    assert session.captured_shapes == [(4, 64)]


def test_the_state_no_one_reads_goes_to_one_scratch_buffer_shared_by_every_shape(d1_artifact):
    """A captured d1 shape gives back only the reads; the state its rows add goes to one buffer per output, shared by
    every shape, so the shapes hold their reads and inputs only (at d1-3B's size their state was 2.3 GB), and the
    zero state every shape reads is one copy. The largest shape captured first makes the buffer once; a larger
    shape later makes a new one, and the shapes bound to the old keep it. The bindings are onnxruntime's IO
    binding, here on the CPU's memory (CUDA's on a GPU)."""
    fields = Artifact.load(d1_artifact).manifest.model
    session = GraphSession(d1_artifact / "text.onnx", "cpu")
    runner = d1_runner(session, fields)
    runs = CapturedRuns(session.session, device="cpu")
    reads = [session.output_names.index(name) for name in READS]
    rng = np.random.default_rng(0)

    def feeds(batch: int, width: int) -> dict:
        rows = [TextRow(rng.integers(0, 5000, rng.integers(1, width + 1)).tolist(), label_ids=(5, 17, 300))
                for _ in range(batch)]
        return {**runner.reads.feeds(rows, width), **runner.empty}

    def check(shape_feeds: dict) -> None:
        got = runs.run(shape_feeds, reads)
        want = session.run(shape_feeds, fetch=READS)
        assert all(np.abs(g - w).max() <= 1e-6 for g, w in zip(got, want, strict=True))

    large, small = feeds(4, 64), feeds(2, 32)
    check(large)
    check(small)
    state = len(session.output_names) - len(READS)
    assert len(runs.scratch.buffers) == state
    first, second = runs.bindings.values()
    assert [id(b) for b in first.held] == [id(b) for b in second.held]  # one buffer per output, shared
    zeros = sum(value.nbytes for value in runner.empty.values())
    assert runs.nbytes() == first.nbytes + second.nbytes + sum(b.shape()[0] for b in first.held) + zeros
    with pytest.raises(RuntimeError, match="scratch"):
        runs.run(small, None)  # a shape bound for its reads cannot give back its state
    larger = feeds(8, 64)
    check(larger)
    assert all(id(new) != id(old) for new, old in zip(runs.bindings[runs._key(larger)].held, first.held))
    check(small)  # still on the buffer it was bound to
    check(large)


def test_a_bound_d3_shape_gives_back_every_output_as_a_plain_run_does(d3_artifact):
    """d3's captured shapes read all their outputs (the code logits): bound once, run twice with new feeds, each
    run's outputs are the plain run's, and nothing goes to the scratch."""
    hidden = int(Artifact.load(d3_artifact).manifest.model["hidden_size"])
    session = GraphSession(d3_artifact / "text.onnx", "cpu")
    runs = CapturedRuns(session.session, device="cpu")
    rng = np.random.default_rng(0)
    for lengths in ((5, 17, 40, 1), (9, 2, 33, 60)):
        rows = [TextRow(rng.integers(0, 5000, n).tolist()) for n in lengths]
        feeds = row_feeds(rows, hidden, 64)
        got, want = runs.run(feeds), session.run(feeds)
        assert len(got) == len(want) and all(np.array_equal(g, w) for g, w in zip(got, want, strict=True))
    assert len(runs.bindings) == 1 and not runs.scratch.buffers


def test_a_capturing_session_runs_the_rest_uncaptured():
    """A run outside the buckets sets onnxruntime's graph id -1: neither captured nor replaying bucket 0."""
    options = uncaptured(None)
    assert options.get_run_config_entry(GRAPH_ID) == "-1"
    assert uncaptured(options) is options and options.get_run_config_entry(GRAPH_ID) == "-1"


def test_the_service_says_what_it_captured(d3_service):
    """`serve` and `bench` read it from the service: on the CPU nothing is captured."""
    assert d3_service.captures is False and d3_service.cuda_graphs == "off"


def test_only_the_thread_that_captured_replays_and_nothing_captures_after_warm_up():
    """onnxruntime keeps captured graphs in the capturing thread's context and captures a shape on its third run
    there: so the warm-up's thread alone replays, only the shapes it captured, and every other run is plain."""
    runs = CapturedRuns(session=None)
    small, other = ({"input_ids": np.zeros((batch, 32), np.int64)} for batch in (1, 2))
    assert not runs.replays(small)  # before any warm-up nobody replays
    with runs.capturing_here():
        assert runs.replays(small) and runs.replays(other)  # the warm-up's runs capture
        runs.bindings[runs._key(small)] = object()  # what a capture leaves: the shape's bound buffers
    assert runs.replays(small) and not runs.replays(other)  # a shape not captured at warm-up runs plainly
    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(runs.replays, small).result() is False  # another thread's runs are plain


def test_every_shape_reads_one_device_copy_of_causal_d3s_zero_state(d3_causal_artifact):
    """A causal d3 graph's whole prompts start from a zero state (d3-nano's recurrent states are 18 MB): every
    captured shape is bound to one device copy of it, never copied again, and the shapes' memory counts it once. A
    shape's key names that array, so another array (even of the same zeros) is not replayed on it."""
    from systemone.runtime.d3 import state as d3_state

    fields = Artifact.load(d3_causal_artifact).manifest.model
    session = GraphSession(d3_causal_artifact / "text.onnx", "cpu")
    runner = d3_runner(session, fields, d3_state.layout_of(fields))
    runs = CapturedRuns(session.session, device="cpu")
    rng = np.random.default_rng(0)

    def feeds(batch: int, width: int) -> dict:
        rows = [TextRow(rng.integers(0, 5000, n).tolist()) for n in rng.integers(1, width + 1, batch)]
        return {**runner.reads.feeds(rows, width), **runner.empty}

    shapes = [feeds(4, 64), feeds(2, 32)]
    for shape in shapes:
        (got,) = runs.run(shape, [0])
        (want,) = session.run(shape, fetch=["code_logits"])
        assert np.abs(got - want).max() <= 1e-6
    first, second = runs.bindings.values()
    assert all(first.inputs[name] is second.inputs[name] for name in runner.empty)
    zeros = sum(value.nbytes for value in runner.empty.values())
    assert zeros > 0 and runs.nbytes() == (first.nbytes + second.nbytes + zeros
                                           + sum(b.shape()[0] for b in {id(b): b for b in first.held}.values()))
    copies = {name: value.copy() for name, value in runner.empty.items()}
    for value in copies.values():
        value.flags.writeable = False
    again = {**shapes[1], **copies}
    runs.capturing, runs.thread = False, threading.get_ident()  # as after warm-up, on the thread that captured
    assert runs.replays(shapes[1]) and not runs.replays(again)


class CapturingOnCpu(GraphSession):
    """A CPU session marked as one that replays CUDA graphs (the CPU captures nothing), keeping every run_bound
    output it gave back."""

    def __init__(self, path):
        super().__init__(path, "cpu")
        self.captured = CapturedRuns(self.session, device="cpu")
        self.given: list = []

    def run_bound(self, feeds, run_options=None, on_host=()):
        out = super().run_bound(feeds, run_options, on_host)
        self.given += out.values()
        return out


def test_a_prefix_state_kept_past_its_run_leaves_a_capturing_sessions_arena(d1_artifact, d3_causal_artifact):
    """A captured graph writes its intermediates where it captured them, memory the session's arena counts free
    between runs: a d1-3B image request's prefix state, kept on the device while other requests' captured calls
    replayed, came back as NaN (9 of 252 answers a 500 at 8 clients, H100). So a prefix's state that outlives its
    run is copied out of a capturing session's memory, and kept as it is where the session captures nothing; the
    questions read the same either way."""
    from systemone.runtime.d3 import state as d3_state

    rng = np.random.default_rng(0)
    ids = rng.integers(0, 5000, 40).tolist()
    fields = Artifact.load(d1_artifact).manifest.model
    plain = d1_runner(GraphSession(d1_artifact / "text.onnx", "cpu"), fields)
    session = CapturingOnCpu(d1_artifact / "text.onnx")
    capturing = d1_runner(session, fields)
    kept, want = capturing.prefill(capturing.start(), TextRow(ids)), plain.prefill(plain.start(), TextRow(ids))
    assert session.given and not any(state is given for state in kept.states.values() for given in session.given)
    assert all(np.array_equal(np.asarray(k.numpy()), np.asarray(w.numpy() if hasattr(w, "numpy") else w))
               for k, w in zip(kept.states.values(), want.states.values(), strict=True))
    suffixes = [TextRow(rng.integers(0, 5000, 3).tolist(), label_ids=(5, 17))]
    assert capturing.read_suffixes(kept, suffixes) == plain.read_suffixes(want, suffixes)

    fields = Artifact.load(d3_causal_artifact).manifest.model
    d3_layout = d3_state.layout_of(fields)
    session = CapturingOnCpu(d3_causal_artifact / "text.onnx")
    row = TextRow(ids, text_positions(len(ids)))
    runner = d3_runner(session, fields, d3_layout)
    prefix = runner.prefill(runner.start(), row)
    plain = d3_runner(GraphSession(d3_causal_artifact / "text.onnx", "cpu"), fields, d3_layout)
    want = plain.prefill(plain.start(), row)
    assert session.given and not any(state is given for state in prefix.states.values() for given in session.given)
    assert all(np.array_equal(prefix.states[name].numpy(), want.states[name].numpy()) for name in want.states)
