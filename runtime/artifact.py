"""An exported artifact on disk: the manifest, the family contract, the tokenizer and the chat template."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..models.d1 import D1Family
from ..models.d3 import D3Family, DecisionConfig
from ..models.family import Family
from .chat_template import ChatTemplate
from .tokenizer import PromptTokenizer

MANIFEST = "manifest.json"
ARTIFACT_FORMAT = "systemone-onnx-artifact"
ARTIFACT_VERSION = 1


class ArtifactError(ValueError):
    pass


@dataclass
class Artifact:
    root: Path
    manifest: dict[str, Any]
    family: Family
    tokenizer: PromptTokenizer
    template: ChatTemplate

    @property
    def source(self) -> str:
        return self.manifest["source"]

    @property
    def max_model_len(self) -> int:
        return int(self.manifest["max_model_len"])

    def graph_path(self, name: str) -> Path:
        graphs = self.manifest["graphs"]
        if name not in graphs:
            raise ArtifactError(f"artifact {self.root} has no {name!r} graph (it has {', '.join(graphs)})")
        return self.root / graphs[name]["file"]

    @classmethod
    def load(cls, root: str | Path) -> Artifact:
        root = Path(root)
        path = root / MANIFEST
        if not path.is_file():
            raise ArtifactError(f"{root} is not an exported artifact: it has no {MANIFEST} "
                                "(run `systemone export SRC --out DIR` first)")
        manifest = json.loads(path.read_text(encoding="utf-8"))
        if manifest.get("format") != ARTIFACT_FORMAT or manifest.get("format_version") != ARTIFACT_VERSION:
            raise ArtifactError(f"{path}: not a {ARTIFACT_FORMAT} version {ARTIFACT_VERSION} manifest")
        family_name = manifest.get("family")
        family: Family
        if family_name == "d3":
            family = D3Family(DecisionConfig.load(root / "decision_config.json"))
        elif family_name == "d1":
            family = D1Family()
        else:
            raise ArtifactError(f"{path}: unknown model family {family_name!r}")
        template = ChatTemplate((root / "chat_template.jinja").read_text(encoding="utf-8"),
                                manifest.get("special_tokens", {}))
        return cls(root, manifest, family, PromptTokenizer(root / "tokenizer.json"), template)
