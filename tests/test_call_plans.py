"""How one request's rows of different lengths are grouped into text-graph calls: by the call's cost as measured at
start-up (a fixed part and a part per padded token), within the token and attention budgets."""

import random

import pytest

from systemone.export.d1.answer_parity import sixteen_questions
from systemone.runtime.artifact import Artifact
from systemone.runtime.batch import BatchBudget, CallCost
from systemone.runtime.batch_sizing import fit_call_cost
from systemone.runtime.engine import EngineOptions
from systemone.runtime.service import DecisionService
from tests.answer_helpers import max_probability_diff


def modelled_seconds(plan: list[list[int]], lengths: list[int], cost: CallCost) -> float:
    return sum(cost.seconds(len(call), max(lengths[i] for i in call)) for call in plan)


def partitions(items: list[int]):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for smaller in partitions(rest):
        yield [[first], *smaller]
        for k in range(len(smaller)):
            yield smaller[:k] + [[first, *smaller[k]]] + smaller[k + 1:]


def assert_covers_once_within_budget(plan: list[list[int]], lengths: list[int], budget: BatchBudget,
                                     past: int = 0) -> None:
    assert sorted(i for call in plan for i in call) == list(range(len(lengths)))
    for call in plan:
        assert len(call) == 1 or budget.fits(len(call), max(lengths[i] for i in call), past)


def test_without_a_measured_cost_each_call_is_filled_as_far_as_the_budget_allows():
    budget = BatchBudget(max_batch_tokens=120)
    lengths = [10, 60, 30, 50, 5]
    plan = budget.plan(lengths)
    assert plan == [[1, 3], [2, 0, 4]]
    assert_covers_once_within_budget(plan, lengths, budget)


def test_a_calls_fixed_cost_merges_rows_of_different_lengths_and_padding_splits_them():
    budget = BatchBudget(max_batch_tokens=10_000)
    lengths = [130, 20, 115, 20, 29, 130]
    launch_bound = CallCost(fixed_s=10e-3, token_s=1e-6)  # a big model's call on a GPU: launches dominate
    assert budget.plan(lengths, cost=launch_bound) == [[0, 5, 2, 4, 1, 3]]
    compute_bound = CallCost(fixed_s=1e-9, token_s=1e-6)  # padding costs more than a call: equal lengths share
    assert budget.plan(lengths, cost=compute_bound) == [[0, 5], [2], [4], [1, 3]]


def test_the_plan_is_the_fastest_grouping_the_cost_model_allows():
    rng = random.Random(0)
    for _ in range(60):
        lengths = [rng.randint(1, 200) for _ in range(rng.randint(1, 7))]
        past = rng.choice([0, 500])
        budget = BatchBudget(max_batch_tokens=rng.choice([200, 400, 2000]),
                             attention_budget=rng.choice([1 << 20, 8 << 20]), heads=2)
        cost = CallCost(fixed_s=rng.uniform(0, 5e-3), token_s=rng.uniform(1e-6, 5e-5))
        plan = budget.plan(lengths, past, cost)
        assert_covers_once_within_budget(plan, lengths, budget, past)
        allowed = [p for p in partitions(list(range(len(lengths))))
                   if all(len(c) == 1 or budget.fits(len(c), max(lengths[i] for i in c), past) for c in p)]
        fastest = min(modelled_seconds(p, lengths, cost) for p in allowed)
        assert modelled_seconds(plan, lengths, cost) == pytest.approx(fastest, rel=1e-12)


def test_the_call_cost_is_fitted_to_the_start_up_timings():
    exact = {tokens: 2e-3 + 8e-6 * tokens for tokens in (128, 256, 512, 1024, 8192)}
    cost = fit_call_cost(exact)
    assert cost.fixed_s == pytest.approx(2e-3) and cost.token_s == pytest.approx(8e-6)
    # One batch size timed says nothing about the split; timings that fall with size give no negative part.
    assert fit_call_cost({128: 1e-3}) is None
    falling = fit_call_cost({128: 3e-3, 256: 2e-3})
    assert falling.fixed_s >= 0 and falling.token_s == 0


def test_launch_bound_small_calls_give_a_floor_and_the_slope_of_the_large_ones():
    """A GPU's uncaptured calls: the small ones cost their kernel launches whatever their size (the timings fall,
    then rise). The fastest call is the floor; the fixed and per-token parts follow the calls from it on."""
    floor, fixed, token = 9e-3, 5e-3, 12e-6
    timings = {128: 11e-3, 256: floor, 512: 11.2e-3, 1024: fixed + token * 1024, 2048: fixed + token * 2048,
               4096: fixed + token * 4096}
    cost = fit_call_cost(timings)
    assert cost.floor_s == floor
    assert cost.token_s == pytest.approx(token, rel=0.05) and cost.fixed_s == pytest.approx(fixed, rel=0.15)
    assert cost.seconds(1, 20) == floor and cost.seconds(32, 128) == pytest.approx(timings[4096], rel=0.02)
    assert "at least 9.00 ms" in cost.describe()
    # Where the smallest call is the fastest (a CPU), there is no floor: the model is the straight line.
    rising = fit_call_cost({tokens: fixed + token * tokens for tokens in (128, 256, 512)})
    assert rising.floor_s == 0.0 and rising.seconds(1, 1) == pytest.approx(fixed + token)


def test_with_a_floor_long_and_short_suffixes_go_in_two_calls():
    """d1-3B's start-up timings on the H200 (twenty-third run) and the sixteen-question request's suffixes (20 to
    130 tokens): the straight line fitted through the launch-bound small calls made one call of 16 x 130 padded
    tokens; the floor model splits them where the padding costs more than the launches of a second call."""
    timings = {128 * rows: ms / 1000 for rows, ms in {1: 14.16, 2: 14.04, 4: 13.52, 8: 18.08, 16: 29.6,
                                                      32: 54.72}.items()}
    lengths = [20, 20, 20, 28, 29, 29, 29, 38, 48, 53, 68, 85, 108, 111, 115, 130]
    budget = BatchBudget()
    line = CallCost(fixed_s=10.89e-3, token_s=9.06e-6)  # the straight line start-up printed in that run
    assert len(budget.plan(lengths, 2169, line)) == 1
    cost = fit_call_cost(timings)
    plan = budget.plan(lengths, 2169, cost)
    assert sorted(sorted(lengths[i] for i in call) for call in plan) == [lengths[:10], lengths[10:]]


def test_the_start_up_measurement_gives_the_engine_its_cost_and_no_grouping_changes_an_answer(d1_artifact):
    """Measured on the tiny d1 model on CPU, then the sixteen-question request (suffixes of 20 to 130 tokens on
    one shared prefix) read with its calls filled to the budget, grouped by the measured cost, and one call per
    length: the same answers (fp32 graphs: within 1e-5)."""
    service = DecisionService(Artifact.load(d1_artifact), EngineOptions(device="cpu"))
    body = sixteen_questions(with_image=False)
    filled = service.decide(body)["answers"]
    sizing = service.batch_sizing()
    assert sizing.cost is not None and sizing.cost.token_s > 0
    assert service.engine.runner.cost == sizing.cost
    assert "a call costs" in sizing.describe()
    measured = service.decide(body)["answers"]
    service.engine.use_call_cost(CallCost(fixed_s=1e-9, token_s=1e-6))
    per_length = service.decide(body)["answers"]
    assert max_probability_diff(measured, filled) <= 1e-5
    assert max_probability_diff(per_length, filled) <= 1e-5


def test_partitions_helper_counts_bell_numbers():
    # The brute force above must see every grouping: Bell(5) = 52 set partitions.
    assert sum(1 for _ in partitions(list(range(5)))) == 52
    assert len({tuple(sorted(tuple(sorted(c)) for c in p)) for p in partitions(list(range(5)))}) == 52


def test_a_prefix_chunk_is_the_longest_run_the_budget_allows_not_a_power_of_two():
    """d1-3B's 16-question request with a 1024x1024 image has a 2,169-token prefix: within 4 GiB of attention at
    32 heads it fits one call, so its state never leaves the device (as powers of two it took 2,048 + 121 tokens,
    and the state of two chunks made a round trip through host memory: 113 -> 65 ms on the H200)."""
    budget = BatchBudget(max_batch_tokens=32768, attention_budget=4 << 30, heads=32)
    for past in (0, 700, 2169, 20_000):
        n = budget.chunk_length(past)
        assert budget.fits(1, n, past) and not budget.fits(1, n + 1, past)
    assert budget.chunk_length(0) >= 2169
    assert BatchBudget(max_batch_tokens=100).chunk_length(0) == 100
    assert BatchBudget(attention_budget=1).chunk_length(0) == 1  # never less than a token
