"""Shared fixtures: tiny random d1 and d3 checkpoints in the released on-disk formats, exported once per test run."""

from __future__ import annotations

import fcntl
import hashlib
import os
import pickle
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.d1_checkpoint import build_d1_checkpoint
from tests.d3_checkpoint import build_d3_checkpoint
from systemone.export.pipeline import export_checkpoint
from systemone.runtime.artifact import Artifact
from systemone.runtime.engine import EngineOptions
from systemone.runtime.pixel_workers import PixelWorkers
from systemone.runtime.service import DecisionService


# The portable graphs and the CUDA forms' ladder, gated here on the CPU: the tests read both (a CPU export writes the
# portable graphs only unless asked).
EVERY_FORM = ["portable", "cuda-fused-fp16", "cuda-fused-mixed", "cuda-fused", "cuda-fp16", "cuda-mixed",
              "cuda-fp16-matmuls"]

# The artifacts the run exports once and every worker reads (fixture: path in the run's directory), in the order the
# workers make them.
SHARED_ARTIFACTS = {"d3_artifact": "art/d3-tiny", "d1_artifact": "art/d1-tiny",
                    "d3_causal_artifact": "art/d3-tiny-causal"}


if os.environ.get("PYTEST_XDIST_WORKER"):
    # One core a worker: onnxruntime's and torch's thread pools otherwise each take every core, and two workers'
    # pools spin against each other.
    import torch

    from systemone.runtime.session import GraphSession

    torch.set_num_threads(1)
    _open = GraphSession._open
    GraphSession._open = staticmethod(lambda path, providers, threads, *rest, **named: _open(
        path, providers, threads or 1, *rest, **named))


def pytest_deselected(items) -> None:
    """The tests a run leaves out as `alone`, by id, in $SYSTEMONE_ALONE_TESTS: scripts/test.sh's second pass runs
    them by id instead of collecting the whole suite again to find them."""
    listed = os.environ.get("SYSTEMONE_ALONE_TESTS")
    if listed:
        with open(listed, "a") as out:
            out.writelines(f"{item.nodeid}\n" for item in items if item.get_closest_marker("alone"))


@pytest.fixture(scope="session")
def run_directory(tmp_path_factory) -> Path:
    """The directory every pytest-xdist worker of this run shares (the session's own without workers), or
    $SYSTEMONE_TEST_RUN_DIR: scripts/test.sh's two passes share one."""
    base = tmp_path_factory.getbasetemp()
    shared = os.environ.get("SYSTEMONE_TEST_RUN_DIR")
    root = Path(shared) if shared else base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    (root / "made-once").mkdir(parents=True, exist_ok=True)
    return root / "made-once"


def once_in_the_run(path: Path, make: Callable[[Path], object]) -> None:
    """`make(path)`, unless a worker of this run did it already: the first does it under a lock, the others wait
    for it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(f"{path.name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = path.with_name(f"{path.name}.done")
        if not done.exists():
            if path.is_dir():
                shutil.rmtree(path)
            make(path)
            done.touch()


_CONTENTS: dict[tuple, str] = {}


def file_contents(path: Path) -> str:
    """A digest of the file as it is now (hashed again only when its size or time changes)."""
    stat = path.stat()
    stamp = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if stamp not in _CONTENTS:
        _CONTENTS[stamp] = hashlib.sha256(path.read_bytes()).hexdigest()
    return _CONTENTS[stamp]


def checkpoint_contents(root: Path) -> str:
    """A digest of the checkpoint's files as they are now, by relative path (each hashed again only when its size or
    time changes)."""
    root = Path(root)
    files = sorted(path for path in root.rglob("*") if path.is_file())
    return hashlib.sha256(repr([(str(path.relative_to(root)), file_contents(path)) for path in files]).encode()
                          ).hexdigest()


@pytest.fixture(scope="session", autouse=True)
def traces_made_once_per_checkpoint(run_directory) -> Iterator[None]:
    """A checkpoint's graphs traced once per test run, shared by the run's workers: many tests export the same tiny
    checkpoints (other forms, other gates, copies in a hub cache) and their graphs are the same each time. Keyed by
    the contents of the checkpoint's files as they are now. Traces in export's own worker processes (jobs > 1),
    tests that call `trace_graph` themselves and tests that watch it (patch it) still trace."""
    from systemone.export import graph_export

    traced: dict[tuple, graph_export.TracedGraph] = {}
    wait, trace_graph = graph_export.GraphExports.wait, graph_export.trace_graph

    def once(self, key, spec):
        if self.pool is not None or key in self.done or graph_export.trace_graph is not trace_graph:
            return wait(self, key, spec)
        memo = (self.config_class.__qualname__, checkpoint_contents(Path(self.checkpoint)), tuple(key), self.seed)
        if memo not in traced:
            path = run_directory / "traces" / hashlib.sha256(repr(memo).encode()).hexdigest()
            once_in_the_run(path, lambda path: path.write_bytes(pickle.dumps(wait(self, key, spec))))
            traced[memo] = pickle.loads(path.read_bytes())
        self.done[key] = traced[memo]
        return traced[memo]

    graph_export.GraphExports.wait = once
    yield
    graph_export.GraphExports.wait = wait


def _digest(value: object, into) -> None:
    """Feeds `value` (arrays, tensors, containers, scalars) into the hash `into`, its types and shapes included."""
    import numpy as np
    import torch

    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    if isinstance(value, np.ndarray):
        into.update(repr(("array", value.dtype.str, value.shape)).encode())
        into.update(np.ascontiguousarray(value).tobytes())
    elif isinstance(value, dict):
        into.update(b"{")
        for key in sorted(value):
            _digest(key, into)
            _digest(value[key], into)
        into.update(b"}")
    elif isinstance(value, (list, tuple)):
        into.update(f"{type(value).__name__}({len(value)}".encode())
        for item in value:
            _digest(item, into)
        into.update(b")")
    else:
        into.update(repr((type(value).__name__, value)).encode())


@pytest.fixture(scope="session", autouse=True)
def torch_references_computed_once_per_checkpoint(run_directory) -> Iterator[None]:
    """The torch reference's answer to a prompt computed once per test run, shared by the run's workers: the run's
    fourteen form gates read the same 210 prompts of the same tiny checkpoints, and d1's parity test reads the
    gate's. Keyed by the checkpoint's contents, the config's decision settings (a test switches the attention
    mode), the reference's device and every argument. A test that patches a reference method over this one still
    gets its patch (test_export's shifted reference fails its gate as before)."""
    import numpy as np

    from systemone.export.d1.config import D1ExportConfig
    from systemone.export.d3.config import D3ExportConfig

    methods = {D3ExportConfig: ("reference_logits", "reference_logits_with_media"),
               D1ExportConfig: ("reference_logprobs",)}
    originals = {(cls, name): getattr(cls, name) for cls, names in methods.items() for name in names}

    def once(cls, name, compute):
        def reference(self, *args, **named):
            key = hashlib.sha256()
            settings = getattr(self, "decision_config", None)
            _digest([cls.__qualname__, name, checkpoint_contents(self.checkpoint),
                     repr(sorted(vars(settings).items())) if settings is not None else None,
                     getattr(self, "reference_device", "cpu"), list(args), named], key)
            path = run_directory / "references" / f"{key.hexdigest()}.npy"
            if not path.exists():
                path.parent.mkdir(exist_ok=True)
                staging = path.with_name(f"{path.stem}.{os.getpid()}.npy")
                np.save(staging, compute(self, *args, **named))
                os.replace(staging, path)  # whole or absent, for a worker reading it meanwhile
            return np.load(path)
        return reference

    for (cls, name), compute in originals.items():
        setattr(cls, name, once(cls, name, compute))
    yield
    for (cls, name), compute in originals.items():
        setattr(cls, name, compute)


@pytest.fixture(scope="session", autouse=True)
def d3_runtime_files_made_once_per_checkpoint(run_directory) -> Iterator[None]:
    """d3's tokenizer, chat template and decision config as export writes them, made once per test run for each
    checkpoint's contents and shared by the workers: transformers rebuilds Qwen3.5's tokenizer in about 5 s, in
    each of a dozen exports of the same checkpoints."""
    import json

    from systemone.export.d3 import config

    write = config.write_runtime_files

    def once(checkpoint: Path, out: Path) -> dict:
        made = run_directory / "runtime-files" / checkpoint_contents(checkpoint)

        def make(path: Path) -> None:
            path.mkdir()
            returned = write(checkpoint, path)
            (path.parent / f"{path.name}.json").write_text(json.dumps(returned))

        once_in_the_run(made, make)
        for file in made.iterdir():
            shutil.copyfile(file, Path(out) / file.name)
        return json.loads((made.parent / f"{made.name}.json").read_text())

    config.write_runtime_files = once
    yield
    config.write_runtime_files = write


@pytest.fixture(scope="session", autouse=True)
def rows_a_call_measured_once_per_graph(run_directory) -> Iterator[None]:
    """A service's rows a call measured once per test run and shared by its workers, keyed by the text graph's files,
    the engine, provider, thread count and budget, as `serve` keeps a start's measurement for an artifact on the
    machine (systemone/batch_rows.py): the gates of a dozen exports and the tests' services measure the same few
    graphs, about 3 s each. An engine whose session or calls a test replaced still measures."""
    import json

    from systemone.runtime import service
    from systemone.runtime.batch_sizing import BatchSizing
    from systemone.runtime.d1.engine import D1Engine
    from systemone.runtime.d3.engine import D3Engine
    from systemone.runtime.linked_weights import links_path
    from systemone.runtime.session import GraphSession

    measure = service.measure_batch_rows

    def once(engine, *args, **named):
        runner = engine.runner
        if (args or named or type(engine) not in (D1Engine, D3Engine) or runner is None
                or type(runner.session) is not GraphSession or runner.session is not engine.session
                or {"run_rows", "probe_row"} & set(vars(engine))):
            return measure(engine, *args, **named)
        graph = Path(engine.artifact.graph_path("text"))
        files = [path for path in (graph, Path(f"{graph}.data"), links_path(graph)) if path.exists()]
        key = hashlib.sha256()
        _digest([type(engine).__qualname__, [file_contents(path) for path in files],
                 engine.session.provider, engine.session.session.get_session_options().intra_op_num_threads,
                 repr(engine.budget), engine.captured_rows, engine.max_model_len], key)
        path = run_directory / "rows-a-call" / f"{key.hexdigest()}.json"
        once_in_the_run(path, lambda path: path.write_text(json.dumps(measure(engine).to_dict())))
        return BatchSizing.from_dict(json.loads(path.read_text()))

    service.measure_batch_rows = once
    yield
    service.measure_batch_rows = measure


@pytest.fixture(scope="session")
def made_once(run_directory) -> Callable[[str, Callable[[Path], Path]], Path]:
    """`made_once(name, make)`: the path `make(path)` made, once for the whole run. With pytest-xdist every worker
    asks, the first makes it under a lock in the run's shared directory and the others wait for it and take it; the
    checkpoints and artifacts below are read-only for the tests."""

    def made(name: str, make: Callable[[Path], Path]) -> Path:
        path = run_directory / name
        once_in_the_run(path, make)
        return path

    return made


@pytest.fixture(scope="session", autouse=True)
def each_worker_starts_with_its_own_artifact(request, run_directory, traces_made_once_per_checkpoint,
                                              torch_references_computed_once_per_checkpoint,
                                              rows_a_call_measured_once_per_graph,
                                              d3_runtime_files_made_once_per_checkpoint, artifact_cache) -> None:
    """Under pytest-xdist, worker N first makes the N-th of the run's shared artifacts, then each one no worker has
    begun: the first tests of every worker need one, and a worker whose test needs an artifact another is exporting
    waits for it idle (74 s of a fresh clone's CI when both began with d3's; 30 s for the causal one, made late by
    the first test to need it). After the run's memos (autouse fixtures are set up in the order of their names), so
    that these exports fill them."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw"):
        return
    order = list(SHARED_ARTIFACTS)
    own = int(worker[2:])
    if own < len(order):
        request.getfixturevalue(order[own])
    for name in order[int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", len(order))):]:
        claim = run_directory / f"{SHARED_ARTIFACTS[name]}.claimed"
        claim.parent.mkdir(parents=True, exist_ok=True)
        try:  # one worker claims it, at once (its checkpoint is built before once_in_the_run's lock is taken)
            os.close(os.open(claim, os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            continue
        request.getfixturevalue(name)


@pytest.fixture(scope="session")
def d3_checkpoint(made_once) -> Path:
    return made_once("ckpt/d3-tiny", lambda path: build_d3_checkpoint(
        path, attention_mode="noncausal_full_attention"))


@pytest.fixture(scope="session")
def d3_causal_checkpoint(made_once) -> Path:
    return made_once("ckpt/d3-tiny-causal", lambda path: build_d3_checkpoint(
        path, attention_mode="causal", seed=1))


@pytest.fixture(scope="session")
def d3_artifact(d3_checkpoint, made_once) -> Path:
    return made_once(SHARED_ARTIFACTS["d3_artifact"],
                     lambda path: export_checkpoint(str(d3_checkpoint), path, forms=EVERY_FORM))


@pytest.fixture(scope="session")
def d3_causal_artifact(d3_causal_checkpoint, made_once) -> Path:
    return made_once(SHARED_ARTIFACTS["d3_causal_artifact"],
                     lambda path: export_checkpoint(str(d3_causal_checkpoint), path, forms=EVERY_FORM))


@pytest.fixture(scope="session")
def d3_service(d3_artifact) -> Iterator[DecisionService]:
    """As `systemone serve` runs it: pixel rows made in a worker process (--media-processes)."""
    service = DecisionService(Artifact.load(d3_artifact), EngineOptions(device="cpu"),
                              served_model_names=["vllm-sr/d3-tiny"], media_processes=1)
    yield service
    service.close()


@pytest.fixture(scope="session")
def pixel_processes() -> Iterator[PixelWorkers]:
    workers = PixelWorkers(processes=2)
    yield workers
    workers.close()


@pytest.fixture(scope="session")
def reference_tokenizer(d3_checkpoint):
    """What vLLM tokenizes with: transformers' AutoTokenizer on the checkpoint (Qwen3_5Tokenizer, spec 4.7)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(d3_checkpoint)


@pytest.fixture(scope="session")
def d1_checkpoint(made_once) -> Path:
    return made_once("ckpt/d1-tiny", build_d1_checkpoint)


@pytest.fixture(scope="session")
def d1_artifact(d1_checkpoint, made_once) -> Path:
    return made_once(SHARED_ARTIFACTS["d1_artifact"],
                     lambda path: export_checkpoint(str(d1_checkpoint), path, forms=EVERY_FORM))


@pytest.fixture(scope="session")
def d1_service(d1_artifact) -> DecisionService:
    return DecisionService(Artifact.load(d1_artifact), EngineOptions(device="cpu"),
                           served_model_names=["LiquidAI/d1-tiny"])


@pytest.fixture(scope="session")
def d1_reference_tokenizer(d1_checkpoint):
    """What vLLM renders and tokenizes d1 prompts with: transformers' AutoTokenizer on the checkpoint (spec 3.4)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(d1_checkpoint)


@pytest.fixture(scope="session", autouse=True)
def artifact_cache(tmp_path_factory) -> Iterator[Path]:
    """The cache `serve` exports checkpoints into and keeps its start-up choices in: the run's own, never the
    user's ~/.cache."""
    import os

    from systemone.artifact_cache import CACHE_ENV

    saved = os.environ.get(CACHE_ENV)
    os.environ[CACHE_ENV] = str(tmp_path_factory.mktemp("systemone-cache"))
    yield Path(os.environ[CACHE_ENV])
    if saved is None:
        os.environ.pop(CACHE_ENV, None)
    else:
        os.environ[CACHE_ENV] = saved
