"""An exported artifact on disk: its manifest (read through one class), the family contract, the tokenizer and
the chat template."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..models.family import Family
from ..models.registry import FAMILIES, FamilyEntry, FamilyRegistry, UnknownFamily
from .chat_template import ChatTemplate
from .tokenizer import PromptTokenizer

MANIFEST = "manifest.json"
ARTIFACT_FORMAT = "systemone-onnx-artifact"
ARTIFACT_VERSION = 2
# Version 1 (every artifact has its portable graphs) loads as it is; version 2 may have none (`GraphEntry.file` "");
# version 3 links weights to the checkpoint's files (`Manifest.linked`), which a reader of 2 would not supply.
LINKED_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)


class ArtifactError(ValueError):
    pass


@dataclass(frozen=True)
class GraphEntry:
    """One graph of the artifact: its portable file ("" when export wrote only half-precision forms), its inputs'
    shapes (symbolic axes named), outputs, dtype, parity gate."""

    file: str
    inputs: dict[str, list[str | int]]
    outputs: list[str]
    dtype: str = "float32"
    parity: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"file": self.file, "inputs": self.inputs, "outputs": self.outputs, "dtype": self.dtype}
        if self.parity is not None:
            out["parity"] = self.parity
        return out


@dataclass(frozen=True)
class FormEntry:
    """Another form of the artifact's graphs beside the portable fp32 one (docs/artifact.md): its dtype, the
    providers it is for, its files by graph name (a graph it does not rewrite is the portable file), each rewritten
    graph's precision (which nodes run in that dtype) and its parity gate's figures; or why export refused it
    (`refused`, and no files)."""

    dtype: str
    providers: list[str]
    graphs: dict[str, str] = field(default_factory=dict)
    gate: dict[str, Any] = field(default_factory=dict)
    refused: str | None = None
    precisions: dict[str, str] = field(default_factory=dict)  # empty in manifests written before it was recorded

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"dtype": self.dtype, "providers": self.providers, "graphs": self.graphs,
                               "precisions": self.precisions, "gate": self.gate}
        if self.refused is not None:
            out["refused"] = self.refused
        return out


PORTABLE = "portable"  # the fp32 graphs every provider runs (manifest `graphs`)
# The precision of a form's graph that computes in fp32 from fp16 weights, each cast as a run reaches it
# (export/half_precision.py): its session must run the nodes in the graph's order (GraphSession).
WEIGHTS_CAST_PER_RUN = "float32-fp16-weights"


@dataclass(frozen=True)
class Manifest:
    """`manifest.json`: what every artifact records, and its family's own fields (`model`: the shapes and
    settings its engine needs), which the JSON keeps at the top level beside the common ones."""

    family: str
    source: str
    checkpoint: str
    max_model_len: int
    graphs: dict[str, GraphEntry]
    parity: dict[str, Any]
    special_tokens: dict[str, Any]
    tokenizer_class: str
    source_files: dict[str, str] = field(default_factory=dict)
    # Characters of the tokenizer's longest entry, read off its vocabulary at export (0: not recorded).
    max_token_chars: int = 0
    opset: int = 18
    versions: dict[str, str] = field(default_factory=dict)
    exported_at: str = ""
    model: dict[str, Any] = field(default_factory=dict)
    forms: dict[str, FormEntry] = field(default_factory=dict)
    # The checkpoint files the graphs' linked weights are read from (runtime/linked_weights.py), by their path in
    # the artifact, with their sizes.
    linked: dict[str, int] = field(default_factory=dict)

    COMMON = ("format", "format_version", "family", "source", "checkpoint", "max_model_len", "graphs", "parity",
              "special_tokens", "tokenizer_class", "max_token_chars", "source_files", "opset", "versions",
              "exported_at", "forms", "linked")

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Manifest:
        graphs = {name: GraphEntry(**entry) for name, entry in raw["graphs"].items()}
        return cls(family=raw["family"], source=raw["source"], checkpoint=raw.get("checkpoint", ""),
                   max_model_len=int(raw["max_model_len"]), graphs=graphs, parity=raw.get("parity", {}),
                   special_tokens=raw.get("special_tokens", {}), tokenizer_class=raw.get("tokenizer_class", ""),
                   max_token_chars=int(raw.get("max_token_chars", 0)),
                   source_files=raw.get("source_files", {}), opset=int(raw.get("opset", 18)),
                   versions=raw.get("versions", {}), exported_at=raw.get("exported_at", ""),
                   forms={name: FormEntry(**form) for name, form in raw.get("forms", {}).items()},
                   linked={name: int(size) for name, size in raw.get("linked", {}).items()},
                   model={k: v for k, v in raw.items() if k not in cls.COMMON})

    def to_dict(self) -> dict[str, Any]:
        version = LINKED_VERSION if self.linked else ARTIFACT_VERSION
        return {"format": ARTIFACT_FORMAT, "format_version": version, "family": self.family,
                "source": self.source, "checkpoint": self.checkpoint, "source_files": self.source_files,
                "max_model_len": self.max_model_len, "opset": self.opset, **self.model,
                "tokenizer_class": self.tokenizer_class, "special_tokens": self.special_tokens,
                **({"max_token_chars": self.max_token_chars} if self.max_token_chars else {}),
                "graphs": {name: g.to_dict() for name, g in self.graphs.items()}, "parity": self.parity,
                "forms": {name: form.to_dict() for name, form in self.forms.items()},
                "versions": self.versions, "exported_at": self.exported_at,
                **({"linked": self.linked} if self.linked else {})}

    def check_linked(self, root: Path) -> None:
        """Every linked checkpoint file where the manifest says, at its size; `ArtifactError` naming the first that
        is not."""
        for name, size in self.linked.items():
            path = root / name
            if not path.is_file():
                raise ArtifactError(f"{root}: its weights are linked to {name}, which is missing: export the "
                                    "checkpoint again")
            if path.stat().st_size != size:
                raise ArtifactError(f"{root}: {name} is {path.stat().st_size} bytes, not the {size} it was linked "
                                    "at (the checkpoint file was changed in place): export the checkpoint again")

    @classmethod
    def read(cls, root: Path) -> Manifest:
        path = root / MANIFEST
        if not path.is_file():
            raise ArtifactError(f"{root} is not an exported artifact: it has no {MANIFEST} "
                                "(run `systemone export SRC --out DIR` first)")
        raw = json.loads(path.read_text(encoding="utf-8"))
        if raw.get("format") != ARTIFACT_FORMAT:
            raise ArtifactError(f"{path}: not a {ARTIFACT_FORMAT} manifest")
        if raw.get("format_version") not in READABLE_VERSIONS:
            raise ArtifactError(f"{path}: artifact format version {raw.get('format_version')!r}; this systemone-onnx "
                                f"reads versions {', '.join(map(str, READABLE_VERSIONS))}: export the checkpoint again "
                                "(`systemone export CHECKPOINT --out DIR`)")
        try:
            return cls.from_dict(raw)
        except (KeyError, TypeError, ValueError) as exc:
            raise ArtifactError(f"{path}: malformed manifest ({type(exc).__name__}: {exc})") from None

    def write(self, root: Path) -> None:
        (root / MANIFEST).write_text(json.dumps(self.to_dict(), indent=2, ensure_ascii=False), encoding="utf-8")


@dataclass
class Artifact:
    root: Path
    manifest: Manifest
    entry: FamilyEntry
    family: Family
    tokenizer: PromptTokenizer
    template: ChatTemplate
    form: str = PORTABLE  # which form's files graph_path gives

    @property
    def source(self) -> str:
        return self.manifest.source

    @property
    def max_token_chars(self) -> int:
        """Characters of the tokenizer's longest entry (vLLM's bound on prompt characters per token, spec 3.9): as
        export recorded it, or read off the vocabulary where it did not (reading it is a quarter of a start's
        tokenizer load: docs/decisions/tokenizer-load.md)."""
        return self.manifest.max_token_chars or self.tokenizer.max_token_chars()

    @property
    def max_model_len(self) -> int:
        return self.manifest.max_model_len

    def graph_path(self, name: str) -> Path:
        graphs = self.manifest.graphs
        if name not in graphs:
            raise ArtifactError(f"artifact {self.root} has no {name!r} graph (it has {', '.join(graphs)})")
        file = graphs[name].file
        if self.form != PORTABLE:
            file = self.manifest.forms[self.form].graphs.get(name, file)
        if not file:
            raise ArtifactError(f"artifact {self.root} has no portable {name!r} graph (it was exported with "
                                f"{', '.join(self.written_forms()) or 'no form'} only)")
        return self.root / file

    def casts_weights_per_run(self, name: str) -> bool:
        """Whether graph `name` of the form read casts its fp16 weights to fp32 as a run reaches them."""
        return self.form != PORTABLE and \
            self.manifest.forms[self.form].precisions.get(name) == WEIGHTS_CAST_PER_RUN

    @property
    def has_portable(self) -> bool:
        """Whether export wrote the portable fp32 graphs."""
        return all(entry.file for entry in self.manifest.graphs.values())

    def written_forms(self) -> dict[str, FormEntry]:
        """The forms export wrote beside the portable one (not those it refused)."""
        return {name: form for name, form in self.manifest.forms.items() if form.refused is None}

    def forms_for(self, device: str) -> list[str]:
        """The forms this artifact can run on `device` (cpu, cuda, rocm), best first: the written forms made for
        it, then the portable one."""
        return [*(name for name, form in self.written_forms().items() if device in form.providers),
                *([PORTABLE] if self.has_portable else [])]

    def with_form(self, form: str, device: str) -> Artifact:
        """This artifact reading `form`'s graphs: "auto" takes the best form for `device`; a form named outright
        runs on any device (onnxruntime casts what a provider has no half-precision kernel for)."""
        if form == "auto":
            usable = self.forms_for(device)
            if not usable:
                raise ArtifactError(f"artifact {self.root} has no form for {device} (it has "
                                    f"{', '.join(self.written_forms())}): export it with --forms portable, or serve "
                                    "it where its forms run")
            form = usable[0]
        written = [*([PORTABLE] if self.has_portable else []), *self.written_forms()]
        if form not in written:
            refused = self.manifest.forms.get(form)
            why = f" (export refused it: {refused.refused})" if refused and refused.refused else ""
            raise ArtifactError(f"artifact {self.root} has no form {form!r}{why}; it has {', '.join(written)}")
        return replace(self, form=form)

    @classmethod
    def load(cls, root: str | Path, families: FamilyRegistry = FAMILIES) -> Artifact:
        root = Path(root)
        manifest = Manifest.read(root)
        manifest.check_linked(root)
        try:
            entry = families.get(manifest.family)
        except UnknownFamily as exc:
            raise ArtifactError(f"{root / MANIFEST}: {exc}") from None
        template = ChatTemplate((root / "chat_template.jinja").read_text(encoding="utf-8"), manifest.special_tokens)
        return cls(root, manifest, entry, entry.contract.load(root), PromptTokenizer(root / "tokenizer.json"),
                   template)
