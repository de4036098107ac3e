"""The choice of filter tier per call (retriever/engine/tier_choice.py), from measured costs: each size measured on each
tier first, the cheaper chosen after, the other tried once in EXPLORE calls, first calls not counted, and the
crossover the service's micro-batcher waits for."""

import math

import numpy as np

from fusionrag.retriever.engine.tier_choice import BUCKETS, TierChoice, bucket


def test_call_sizes_fall_in_power_of_two_buckets():
    assert [bucket(n) for n in (0, 1, 2, 3, 4, 7, 8, 1024, 2047, 10**6)] == [0, 0, 1, 1, 2, 2, 3, 10, 10, BUCKETS - 1]


def _feed(choice, gpu_call_s, cpu_query_s, sizes, rounds=3):
    """Calls served as choose() says, each taking what the two cost functions say; how each size was served."""
    served = {n: [] for n in sizes}
    for _ in range(rounds):
        for n in sizes:
            t = choice.choose(n)
            choice.record(t, n, gpu_call_s if t == 0 else cpu_query_s * n)
            served[n].append(t)
    return served


def test_each_size_is_measured_on_both_tiers_then_the_cheaper_serves():
    choice = TierChoice(explore=1000)
    sizes = (1, 2, 4, 8, 16, 64, 256)
    # the GPU: 1 ms a call whatever its size; the CPU: 0.1 ms a query; the first call of each tier not counted
    served = _feed(choice, 1e-3, 1e-4, sizes, rounds=6)
    for n, tiers in served.items():
        assert tiers.count(0) >= 1 and tiers.count(1) >= 1, (n, tiers)  # measured on both
        assert tiers[-1] == (0 if n > 10 else 1), (n, tiers)  # then the cheaper: 1 ms against n x 0.1 ms
    assert choice.crossover() == 16
    d = choice.describe()
    assert sum(d["calls_served"].values()) == 6 * len(sizes) and d["tiers"] == ["gpu", "cpu"]
    assert math.isclose(d["us_per_query_by_call_size"]["cpu"]["64"], 100.0, rel_tol=1e-6)


def test_the_tier_not_chosen_is_measured_again_once_in_explore_calls():
    choice = TierChoice(explore=8)
    _feed(choice, 1e-3, 1e-4, (64,), rounds=4)  # each tier twice (its first call not counted); the GPU cheaper
    picks = [choice.choose(64) for _ in range(64)]
    assert picks.count(1) == 8 and picks.count(0) == 56


def test_a_change_in_cost_moves_the_choice():
    choice = TierChoice(explore=1000)
    _feed(choice, 1e-3, 1e-4, (32,), rounds=4)
    assert choice.choose(32) == 0 and choice.crossover() == 32
    served = _feed(choice, 50e-3, 1e-4, (32,), rounds=20)  # the device now busy with an LLM: 50 ms a call
    assert served[32][0] == 0 and set(served[32][1:]) == {1} and choice.crossover() is None


def test_first_calls_are_not_counted_and_unmeasured_sizes_borrow_the_nearest():
    choice = TierChoice()
    choice.record(0, 16, 5.0)  # a CUDA context made: not what a call costs
    assert choice.served[0] == 1 and choice.calls[0].sum() == 0 and np.isnan(choice.per_query[0]).all()
    choice.record(0, 16, 16e-4)
    assert math.isclose(choice._predict(0, bucket(16)), 1e-4) and math.isclose(choice._predict(0, bucket(1000)), 1e-4)
    assert math.isnan(choice._predict(1, 0)) and choice.crossover() is None
