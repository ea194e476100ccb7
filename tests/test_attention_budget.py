"""The attention budget is real (docs/operations.md): a request of two of the longest prompts the budget
accepts stays, at its peak, within the budget (measured in an RSS-capped subprocess, tests/memory_probe.py)."""

from __future__ import annotations

from systemone.models.errors import DecisionError
from systemone.runtime.artifact import Artifact
from systemone.runtime.engine import EngineOptions
from systemone.runtime.service import DecisionService
from tests.memory_probe import probe

BUDGET = 512 << 20


def longest_body(service: DecisionService) -> tuple[dict, int]:
    """Two questions whose prompts are as long as max_model_len allows (words of the state found by bisection)."""
    questions = {"q": {"type": "noul", "instructions": "Is it urgent?"},
                 "r": {"type": "noul", "instructions": "Is it urgent, all things considered?"}}

    def body(words: int) -> dict:
        return {"state": " ".join(f"w{i}" for i in range(words)), "questions": questions}

    lo, hi = 1, service.max_model_len
    while lo < hi:
        mid = (lo + hi + 1) // 2
        try:
            service.prepare(body(mid))
            lo = mid
        except DecisionError:
            hi = mid - 1
    return body(lo), max(len(p.token_ids) for p in service.prepare(body(lo)).prompts)


def test_the_longest_accepted_d3_prompts_stay_within_the_attention_budget(d3_artifact, tmp_path):
    service = DecisionService(Artifact.load(d3_artifact), EngineOptions(device="cpu", attention_budget=BUDGET))
    body, tokens = longest_body(service)
    assert tokens > service.max_model_len - 16
    out = probe(d3_artifact, body, tmp_path, 2 * BUDGET >> 20, BUDGET)
    assert out.get("status") == 200, out
    assert out["peak_increase_mb"] <= BUDGET >> 20, out
