"""Weights streamed from a checkpoint into a graph's data file, tensor by tensor, in the dtype the graph declares.

Export traces every graph on a model whose parameters are on torch's meta device (export/graph_export.py), so no
model is ever held in memory. Each initializer of such a graph is *virtual*: an external-data entry whose location
is `VIRTUAL` and whose `recipe` key names how to make its values — a checkpoint tensor (`Stored`), a small constant
(`Constant`), or one ONNX node applied to other recipes (`Derived`: the transposes, slices and `1 + w` that the
optimizer would have folded into new weights). Passes over the graph (the optimizer, the half-precision rewrite)
see its shape and dtype only; `write_graph` makes each tensor's values just before it writes them, a few at once
in threads, within a bound on the memory they hold.

A checkpoint's safetensors files are read with plain reads at each tensor's offset, not mapped: a mapped file's
pages count in the process's resident memory until it is closed.
"""

from __future__ import annotations

import json
import os
import struct
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..runtime.linked_weights import FP16_MAX, FP16_MIN_POSITIVE, LINKED, LINKED_DIR, LinkedWeight, write_links

VIRTUAL = "<virtual>"  # an initializer's external-data location until `write_graph` gives it its values
RECIPE_KEY = "recipe"
ALIGNMENT = 64  # each tensor's offset in a data file (onnxruntime maps the file; aligned rows read faster)
INLINE_BYTES = 1024  # smaller tensors are kept in the graph file, as onnx's own external-data writer does

_SAFETENSORS_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": "bfloat16", "F64": np.float64,
                       "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
                       "BOOL": np.bool_}


class WeightError(ValueError):
    pass


@dataclass(frozen=True)
class StoredTensor:
    path: Path
    dtype: str  # safetensors' name
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    length: int


class CheckpointTensors:
    """The tensors of a checkpoint directory's safetensors files, by (file name, key); read on demand."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.files: dict[str, dict[str, StoredTensor]] = {}
        for path in sorted(self.root.glob("*.safetensors")):
            self.files[path.name] = _read_header(path)
        if not self.files:
            raise WeightError(f"{self.root} holds no .safetensors file")

    def find(self, key: str) -> tuple[str, StoredTensor]:
        """The (file, tensor) that holds `key` among the model's files (a sharded checkpoint's index is not needed:
        every file's header lists its keys)."""
        found = [(name, tensors[key]) for name, tensors in self.files.items() if key in tensors]
        if len(found) != 1:
            where = "no file" if not found else f"{len(found)} files ({', '.join(n for n, _ in found)})"
            raise WeightError(f"checkpoint {self.root}: tensor {key!r} is in {where}")
        return found[0]

    def stored(self, file: str, key: str) -> StoredTensor:
        try:
            return self.files[file][key]
        except KeyError:
            raise WeightError(f"checkpoint {self.root}: {file} has no tensor {key!r}") from None

    def read(self, file: str, key: str) -> np.ndarray:
        """The tensor's values; bf16 as float32 (exact: bf16 is float32's upper half)."""
        tensor = self.stored(file, key)
        raw = np.empty(tensor.length, dtype=np.uint8)
        with open(tensor.path, "rb") as f:
            f.seek(tensor.start)
            if f.readinto(memoryview(raw)) != tensor.length:
                raise WeightError(f"{tensor.path}: {key!r} runs past the end of the file")
        dtype = _SAFETENSORS_DTYPES.get(tensor.dtype)
        if dtype is None:
            raise WeightError(f"{tensor.path}: {key!r} has dtype {tensor.dtype}, which export does not read")
        if dtype == "bfloat16":  # torch's cast: exact, and threaded
            import torch

            return torch.from_numpy(raw).view(torch.bfloat16).float().numpy().reshape(tensor.shape)
        return raw.view(dtype).reshape(tensor.shape)


def _read_header(path: Path) -> dict[str, StoredTensor]:
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise WeightError(f"{path} is not a safetensors file (shorter than its header)")
        (size,) = struct.unpack("<Q", head)
        if size > 100 << 20:
            raise WeightError(f"{path}: a header of {size} bytes is not a safetensors header")
        header = json.loads(f.read(size))
    tensors = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        start, end = entry["data_offsets"]
        tensors[key] = StoredTensor(path, entry["dtype"], tuple(entry["shape"]), 8 + size + start, end - start)
    return tensors


# -- recipes ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Stored:
    """A checkpoint tensor, as float32 (or its own integer type)."""

    file: str
    key: str


@dataclass(frozen=True)
class Constant:
    """A small tensor computed at trace time (a rotary table's frequencies)."""

    value: np.ndarray


@dataclass(frozen=True)
class Derived:
    """Output `output` of one ONNX node (serialized NodeProto) applied to the values of other recipes."""

    node: bytes
    inputs: tuple[str, ...]  # recipe names; "" for an absent optional input
    output: int = 0


Recipe = Stored | Constant | Derived


class WeightBook:
    """Recipes by name: what `write_graph` evaluates."""

    def __init__(self, recipes: Mapping[str, Recipe] | None = None):
        self.recipes: dict[str, Recipe] = dict(recipes or {})

    def add(self, name: str, recipe: Recipe) -> None:
        if name in self.recipes and self.recipes[name] != recipe:
            raise WeightError(f"two recipes for the weight {name!r}")
        self.recipes[name] = recipe

    def update(self, other: WeightBook) -> None:
        for name, recipe in other.recipes.items():
            self.add(name, recipe)

    def values(self, name: str, tensors: CheckpointTensors) -> np.ndarray:
        """The values of recipe `name`, made now (nothing is cached: each weight is made once, when written)."""
        recipe = self.recipes.get(name)
        if recipe is None:
            raise WeightError(f"no recipe for the weight {name!r}")
        if isinstance(recipe, Stored):
            return tensors.read(recipe.file, recipe.key)
        if isinstance(recipe, Constant):
            return recipe.value
        return _run_node(recipe.node, [self.values(i, tensors) if i else None for i in recipe.inputs])[recipe.output]


def _run_node(node_bytes: bytes, inputs: list[np.ndarray | None]) -> list[np.ndarray]:
    import onnx
    from onnx.reference import ReferenceEvaluator

    node = onnx.NodeProto.FromString(node_bytes)
    names = [f"in{i}" if value is not None else "" for i, value in enumerate(inputs)]
    outputs = [f"out{i}" for i in range(len(node.output))]
    single = onnx.helper.make_node(node.op_type, names, outputs, domain=node.domain or None)
    single.attribute.extend(node.attribute)
    feeds = {name: value for name, value in zip(names, inputs) if name}
    return list(ReferenceEvaluator(single).run(None, feeds))


# -- virtual initializers in a ModelProto ------------------------------------------------------------------------
def virtual_tensor(name: str, data_type: int, dims: tuple[int, ...], recipe: str | None = None):
    """A TensorProto with no values: `recipe` (default: `name`) says how `write_graph` makes them."""
    import onnx

    tensor = onnx.TensorProto(name=name, data_type=data_type, dims=list(dims))
    tensor.data_location = onnx.TensorProto.EXTERNAL
    for key, value in (("location", VIRTUAL), (RECIPE_KEY, recipe or name)):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    return tensor


def recipe_of(tensor) -> str | None:
    """The recipe name of a virtual TensorProto; None for one that holds its values."""
    entries = {entry.key: entry.value for entry in tensor.external_data}
    return entries.get(RECIPE_KEY) if entries.get("location") == VIRTUAL else None


def graph_tensors(model) -> Iterator:
    """Every TensorProto of the model's graphs (initializers and Constant nodes' values, subgraphs included)."""
    import onnx

    def walk(graph):
        yield from graph.initializer
        for node in graph.node:
            for attribute in node.attribute:
                if attribute.type == onnx.AttributeProto.TENSOR:
                    yield attribute.t
                elif attribute.type == onnx.AttributeProto.GRAPH:
                    yield from walk(attribute.g)
                elif attribute.type == onnx.AttributeProto.GRAPHS:
                    for sub in attribute.graphs:
                        yield from walk(sub)

    yield from walk(model.graph)


_CHUNK = 1 << 26  # values converted at a time: a weight's temporaries stay a few hundred MB whatever its size
# Weights made at once by `write_graph`'s threads, and the host memory they may hold together (each costs about
# eight bytes a value while made: its fp32 values and their conversion); one is always made, whatever its size.
WRITE_THREADS = min(4, os.cpu_count() or 1)
IN_FLIGHT_BYTES = 2 << 30


def _float32_view(values: np.ndarray):
    """`values` as a float32 torch tensor, sharing memory where it can: a transposed recipe's view keeps its
    strides, so the reordering happens in torch's (threaded) copy of the fp16 result, at half the bytes."""
    import torch

    values = np.asarray(values, dtype=np.float32)
    if values.ndim and min(values.strides) < 0:
        values = np.ascontiguousarray(values)
    return torch.from_numpy(values)


def _to_float16(values: np.ndarray) -> np.ndarray:
    """`values` in fp16 as onnxruntime's converter writes a weight (`convert_np_to_float16`): magnitudes strictly
    between 0 and fp16's smallest positive value raised to it, finite magnitudes above its largest lowered to it,
    signs kept, then rounded to nearest. With torch's kernels, a block of rows at a time, and the raise done after
    the cast where it matters (a nonzero value the cast made zero): a few passes where the converter makes a
    dozen."""
    import torch

    source = _float32_view(values)
    rows = source.reshape(1, -1) if source.dim() < 2 else source
    out = torch.empty(rows.shape, dtype=torch.float16)
    smallest = torch.tensor(FP16_MIN_POSITIVE, dtype=torch.float16)
    step = max(1, _CHUNK // max(1, rows[0].numel()))
    for start in range(0, rows.shape[0], step):
        part = rows[start:start + step]
        if bool(torch.isfinite(part).all()):
            part = part.clamp(-FP16_MAX, FP16_MAX)
        else:  # infinities and NaN kept as they are
            size = part.abs()
            part = torch.where((size > FP16_MAX) & torch.isfinite(size),
                               torch.copysign(torch.tensor(FP16_MAX), part), part)
        half = part.to(torch.float16)
        lost = (half == 0) & (part != 0)  # below half fp16's smallest subnormal: the converter keeps it off zero
        if bool(lost.any()):
            half = torch.where(lost, torch.copysign(smallest, part).to(torch.float16), half)
        out[start:start + step] = half
    return out.numpy().reshape(values.shape)


def _as_dtype(values: np.ndarray, data_type: int, name: str) -> np.ndarray:
    """`values` in the graph's dtype, C-contiguous."""
    import onnx
    from onnx.helper import tensor_dtype_to_np_dtype

    if data_type == onnx.TensorProto.FLOAT16 and values.dtype != np.float16:
        return _to_float16(values)
    if data_type == onnx.TensorProto.BFLOAT16:
        wide = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
        # Round to nearest even, as torch's bfloat16 cast does.
        return ((wide + 0x7FFF + ((wide >> 16) & 1)) >> 16).astype(np.uint16)
    target = tensor_dtype_to_np_dtype(data_type)
    if values.dtype != target:
        if np.issubdtype(values.dtype, np.floating) != np.issubdtype(target, np.floating):
            raise WeightError(f"weight {name!r}: its recipe makes {values.dtype}, the graph reads {target}")
        values = values.astype(target)
    return np.ascontiguousarray(values)


def _made(tensor, recipe: str, book: WeightBook, tensors: CheckpointTensors) -> np.ndarray:
    values = _as_dtype(book.values(recipe, tensors), tensor.data_type, tensor.name)
    if values.shape != tuple(tensor.dims):
        raise WeightError(f"weight {tensor.name!r}: its recipe makes {values.shape}, the graph reads "
                          f"{tuple(tensor.dims)}")
    return values


# A weight linked rather than written is at least this large: small ones cost more in the links file than on disk.
LINK_MIN_BYTES = 1 << 20
_LINKABLE_DTYPES = {"BF16", "F16", "F32"}


class Linker:
    """Links virtual weights that are a run of rows of one checkpoint tensor (the tensor, or a piece of a split
    along its first axis), read as such or transposed, to the checkpoint's file instead of writing their values
    (runtime/linked_weights.py makes them when a session opens). The file is hard-linked into `root`/linked/: the
    artifact takes no disk for it and keeps it if the checkpoint is removed (a copy where no hard link can be
    made: another filesystem). `files` records what was linked, with sizes, for the manifest."""

    def __init__(self, root: Path, tensors: CheckpointTensors, min_bytes: int = LINK_MIN_BYTES,
                 say: Callable[[str], None] = lambda _: None):
        self.root, self.tensors, self.min_bytes, self.say = Path(root), tensors, min_bytes, say
        self.files: dict[str, int] = {}

    def link(self, tensor, recipe: str, book: WeightBook):
        """The `LinkedWeight` for virtual `tensor` (recipe `recipe`), or None where it is not linkable."""
        import onnx

        dtype = {onnx.TensorProto.FLOAT16: "float16", onnx.TensorProto.FLOAT: "float32"}.get(tensor.data_type)
        view = _row_view(recipe, book)
        if dtype is None or view is None:
            return None
        stored_recipe, first, rows, transpose = view
        file, stored = stored_recipe.file, self.tensors.stored(stored_recipe.file, stored_recipe.key)
        if stored.dtype not in _LINKABLE_DTYPES or not stored.shape:
            return None
        shape = (stored.shape[0] if rows is None else rows, *stored.shape[1:])
        row_bytes = stored.length // stored.shape[0]
        if transpose and len(shape) != 2:
            return None
        link = LinkedWeight(tensor.name, f"{LINKED_DIR}/{file}", stored.start + first * row_bytes, stored.dtype,
                            shape, dtype, transpose)
        if link.graph_shape != tuple(tensor.dims) or link.nbytes < self.min_bytes:
            return None
        self._link_file(file)
        return link

    def _link_file(self, file: str) -> None:
        name = f"{LINKED_DIR}/{file}"
        if name in self.files:
            return
        source, target = self.tensors.root / file, self.root / name
        target.parent.mkdir(exist_ok=True)
        if not target.exists():
            try:
                os.link(source, target)
            except OSError as exc:
                import shutil

                self.say(f"{file} cannot be hard-linked into the artifact ({exc.strerror}): copying it")
                shutil.copyfile(source, target)
        self.files[name] = target.stat().st_size


def _row_view(name: str, book: WeightBook) -> tuple[Stored, int, int | None, bool] | None:
    """(stored tensor, first row, rows (None: all), transposed) where recipe `name` is such a view of one stored
    tensor: the tensor, a piece of a Split along its first axis, either one transposed (2-D); None otherwise."""
    import onnx

    recipe = book.recipes.get(name)
    transpose = False
    if isinstance(recipe, Derived):
        node = onnx.NodeProto.FromString(recipe.node)
        if node.op_type == "Transpose":
            perm = [list(a.ints) for a in node.attribute if a.name == "perm"]
            if perm and perm[0] != [1, 0]:
                return None
            transpose, recipe = True, book.recipes.get(recipe.inputs[0])
    first, rows = 0, None
    if isinstance(recipe, Derived):
        node = onnx.NodeProto.FromString(recipe.node)
        attributes = {a.name: a for a in node.attribute}
        if node.op_type != "Split" or attributes.get("axis", None) and attributes["axis"].i != 0:
            return None
        sizes = book.recipes.get(recipe.inputs[1]) if len(recipe.inputs) > 1 and recipe.inputs[1] else None
        if not isinstance(sizes, Constant):
            return None
        sizes_list = [int(v) for v in np.asarray(sizes.value).reshape(-1)]
        first, rows = sum(sizes_list[:recipe.output]), sizes_list[recipe.output]
        recipe = book.recipes.get(recipe.inputs[0])
    if not isinstance(recipe, Stored):
        return None
    return recipe, first, rows, transpose


_ONNX_OF_STORED = {"BF16": 16, "F16": 10, "F32": 1}  # safetensors' dtype -> onnx.TensorProto's


def consumers_of(graph) -> dict[str, list]:
    """By value name, the nodes of `graph` (not its subgraphs) that read it."""
    consumers: dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    return consumers


def cast_readers(graph, consumers: dict[str, list]) -> dict[str, list]:
    """The weights onnxruntime may read as the checkpoint stores them: overridable initializers (graph inputs, so
    nothing folds what reads them) that only a Cast to fp32 reads, directly or through a Gather whose rows only such
    a Cast reads (export/half_precision.py, `cast_weights_per_run`); by name, the Cast and Gather nodes that read
    each. `consumers`: `consumers_of(graph)`."""
    import onnx

    inputs = {v.name for v in graph.input}

    def to_fp32(node) -> bool:
        return node.op_type == "Cast" and any(a.name == "to" and a.i == onnx.TensorProto.FLOAT for a in node.attribute)

    found = {}
    for tensor in graph.initializer:
        readers = consumers.get(tensor.name, [])
        if tensor.name in inputs and readers and all(
                to_fp32(node) or (node.op_type == "Gather" and node.input[0] == tensor.name
                                  and all(to_fp32(c) for c in consumers.get(node.output[0], [])))
                for node in readers):
            found[tensor.name] = readers
    return found


def read_as_stored(graph, tensor, link: LinkedWeight, readers: list, consumers: dict[str, list]) -> bool:
    """Declare `tensor` as the rows `link` names, in the checkpoint's dtype and orientation, as ONNX external data
    in the hard-linked file (onnxruntime reads it when the session opens, a tensor at a time), and transpose after
    its Cast where `link` is transposed: a product reading it becomes a FusedMatMul with `transB`, anything else
    reads a Transpose. False (nothing changed) where a Gather reads it transposed. `consumers`: `consumers_of(graph)`,
    looked up rather than scanned since a 27B graph holds hundreds of such weights."""
    import onnx

    if link.transpose and any(node.op_type == "Gather" for node in readers):
        return False
    tensor.data_type = _ONNX_OF_STORED[link.stored]
    del tensor.dims[:]
    tensor.dims.extend(link.shape)
    tensor.ClearField("raw_data")
    del tensor.external_data[:]
    tensor.data_location = onnx.TensorProto.EXTERNAL
    for key, value in (("location", link.file), ("offset", str(link.offset)), ("length", str(link.nbytes))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    declared = next(v for v in graph.input if v.name == tensor.name)
    declared.CopyFrom(onnx.helper.make_tensor_value_info(tensor.name, tensor.data_type, list(link.shape)))
    if not link.transpose:
        return True
    for cast in readers:
        rows_first = cast.output[0]
        products = consumers.get(rows_first, [])
        if all(node.op_type == "MatMul" and list(node.input).index(rows_first) == 1 for node in products):
            for node in products:  # x @ w.T, read where it lies
                fused = onnx.helper.make_node("FusedMatMul", list(node.input), list(node.output), node.name,
                                              domain="com.microsoft", transB=1)
                node.CopyFrom(fused)
            continue
        transposed = f"{rows_first}_transposed"
        for node in products:
            node.input[:] = [transposed if name == rows_first else name for name in node.input]
        at = list(graph.node).index(cast)
        graph.node.insert(at + 1, onnx.helper.make_node("Transpose", [rows_first], [transposed],
                                                        f"{cast.name}_transpose", perm=[1, 0]))
    return True


def write_graph(model, path: Path, book: WeightBook, tensors: CheckpointTensors,
                written: Callable[[int], None] | None = None, threads: int = WRITE_THREADS,
                in_flight_bytes: int = IN_FLIGHT_BYTES, linker: Linker | None = None) -> Path:
    """Save `model` at `path`, every tensor over `INLINE_BYTES` in `path.name + '.data'`: virtual ones made from
    `book` and `tensors` in the dtype the graph declares for them, by `threads` threads while no more than
    `in_flight_bytes` are being made (at least one weight), and written in the graph's order. `written(bytes)`
    after each. With `linker`, the weights it can link are linked instead (listed beside the graph)."""
    import onnx
    from concurrent.futures import Future, ThreadPoolExecutor


    data_name = f"{path.name}.data"
    links: list = []
    pending: deque[tuple[Any, Future | bytes, int]] = deque()  # (tensor, its values to come or its bytes, cost)
    in_flight = 0

    def store(tensor, values: np.ndarray | bytes, data) -> None:
        del tensor.external_data[:]  # a virtual tensor's recipe entry (a stored one has none)
        if isinstance(values, np.ndarray) and values.nbytes <= INLINE_BYTES:  # small: kept in the graph file
            tensor.raw_data = values.tobytes()
            tensor.data_location = onnx.TensorProto.DEFAULT
            return
        size = values.nbytes if isinstance(values, np.ndarray) else len(values)
        offset = data.seek(0, os.SEEK_END)
        padding = -offset % ALIGNMENT
        data.write(b"\0" * padding)
        data.write(values.data if isinstance(values, np.ndarray) else values)
        tensor.ClearField("raw_data")
        tensor.data_location = onnx.TensorProto.EXTERNAL
        for key, value in (("location", data_name), ("offset", str(offset + padding)), ("length", str(size))):
            entry = tensor.external_data.add()
            entry.key, entry.value = key, value
        if written is not None:
            written(size)

    def write_oldest(data) -> None:
        nonlocal in_flight
        tensor, values, cost = pending.popleft()
        in_flight -= cost
        store(tensor, values.result() if isinstance(values, Future) else values, data)

    consumers = consumers_of(model.graph) if linker is not None else {}
    cast_read = cast_readers(model.graph, consumers) if linker is not None else {}
    with open(path.with_name(data_name), "wb") as data, ThreadPoolExecutor(max(1, threads)) as pool:
        try:
            for tensor in graph_tensors(model):
                recipe = recipe_of(tensor)
                link = linker.link(tensor, recipe, book) if linker is not None and recipe is not None else None
                if link is not None and tensor.name in cast_read and \
                        read_as_stored(model.graph, tensor, link, cast_read[tensor.name], consumers):
                    continue  # onnxruntime reads it from the linked file itself
                if link is not None:
                    del tensor.external_data[:]
                    entry = tensor.external_data.add()
                    entry.key, entry.value = "location", LINKED
                    links.append(link)
                elif recipe is not None:
                    cost = 8 * int(np.prod(tensor.dims, dtype=np.int64))
                    while pending and in_flight + cost > in_flight_bytes:
                        write_oldest(data)
                    pending.append((tensor, pool.submit(_made, tensor, recipe, book, tensors), cost))
                    in_flight += cost
                elif tensor.data_location == onnx.TensorProto.EXTERNAL:
                    raise WeightError(f"tensor {tensor.name!r} points at data that is not this graph's")
                elif len(tensor.raw_data) > INLINE_BYTES:
                    pending.append((tensor, tensor.raw_data, 0))
            while pending:
                write_oldest(data)
        finally:
            for _, values, _ in pending:
                if isinstance(values, Future):
                    values.cancel()
    if any(node.domain == "com.microsoft" for node in model.graph.node) and \
            not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid("com.microsoft", 1))  # read_as_stored's FusedMatMul
    onnx.save(model, str(path))
    if links:
        write_links(path, links)
    return path


@dataclass
class TracedGraph:
    """A graph with virtual weights (serialized ModelProto) and the recipes they name."""

    model: bytes
    book: WeightBook

    def proto(self):
        import onnx

        return onnx.ModelProto.FromString(self.model)
