"""The GPU split between vLLM and the retriever (pure arithmetic, so tested exhaustively here)."""

import math
import random

import pytest

from fusionrag.integrations.vllm.memory import (DEFAULT_RESERVE_BYTES, GiB, VLLM_DEFAULT_UTILIZATION, plan_gpu_split,
                                             plan_plugin_split)
from fusionrag.retriever.errors import ConfigError

H100 = 80 * GiB


def test_default_utilization_leaves_no_room_for_a_large_retriever():
    split = plan_gpu_split(H100, 10 * GiB)
    assert not split.fits and split.retriever_first
    # 80 - 10 - 1 = 69 GiB left: 69/80 = 0.8625, rounded down to 0.862.
    assert split.max_gpu_memory_utilization == 0.862
    assert split.vllm_args == {"gpu_memory_utilization": 0.862}
    assert "gpu_memory_utilization=0.862" in split.advice and "before starting vLLM" in split.advice
    with pytest.raises(ConfigError, match="does not fit"):
        split.check()


def test_lower_utilization_fits_and_says_what_is_spare():
    split = plan_gpu_split(H100, 10 * GiB, gpu_memory_utilization=0.8)
    assert split.fits and split.check() is split
    assert split.vllm_bytes == math.ceil(0.8 * H100)
    assert split.available_bytes == 69 * GiB
    assert split.vllm_args == {"gpu_memory_utilization": 0.8}
    assert "5.00 GiB spare" in split.advice


def test_small_retriever_fits_beside_vllms_default():
    split = plan_gpu_split(H100, 2 * GiB, reserve_bytes=GiB // 2)
    # 0.92 * 80 = 73.6 GiB <= 80 - 2 - 0.5 = 77.5 GiB
    assert split.fits and split.vllm_args == {"gpu_memory_utilization": VLLM_DEFAULT_UTILIZATION}


def test_fixed_kv_cache_fits_in_either_order_with_the_suggested_fraction():
    split = plan_gpu_split(H100, 10 * GiB, kv_cache_memory_bytes=30 * GiB, model_bytes=20 * GiB)
    assert split.fits and not split.retriever_first
    assert split.vllm_bytes == 50 * GiB
    assert split.max_kv_cache_memory_bytes == 49 * GiB
    # 0.92 would fail vLLM's start-up check with the index open: the fraction is lowered.
    assert split.vllm_args == {"kv_cache_memory_bytes": 30 * GiB, "gpu_memory_utilization": 0.862}
    assert "start vLLM before opening the index" in split.advice


def test_fixed_kv_cache_too_large_gets_the_largest_that_fits():
    split = plan_gpu_split(H100, 10 * GiB, kv_cache_memory_bytes=60 * GiB, model_bytes=20 * GiB,
                           gpu_memory_utilization=0.5)
    assert not split.fits
    assert split.vllm_args == {"kv_cache_memory_bytes": 49 * GiB, "gpu_memory_utilization": 0.5}
    assert f"kv_cache_memory_bytes={49 * GiB}" in split.advice
    again = plan_gpu_split(H100, 10 * GiB, model_bytes=20 * GiB, **split.vllm_args)
    assert again.fits and again.available_bytes - again.vllm_bytes == 0


def test_weights_alone_too_large():
    split = plan_gpu_split(H100, 40 * GiB, kv_cache_memory_bytes=GiB, model_bytes=45 * GiB)
    assert not split.fits and "weights and activations alone" in split.advice


def test_retriever_alone_too_large():
    split = plan_gpu_split(H100, 80 * GiB)
    assert not split.fits and split.max_gpu_memory_utilization == 0.0 and split.vllm_args == {}
    assert "lower the retriever's GPU budget" in split.advice
    # Room for less than 0.1% of the GPU is no room: vLLM takes fractions, not bytes.
    assert not plan_gpu_split(H100, H100 - H100 // 2000, reserve_bytes=0).fits


@pytest.mark.parametrize("kwargs, message", [
    (dict(total_bytes=0, retriever_bytes=0), "total_bytes must be > 0"),
    (dict(total_bytes=-1, retriever_bytes=0), "total_bytes"),
    (dict(total_bytes=H100, retriever_bytes=1.5), "retriever_bytes"),
    (dict(total_bytes=H100, retriever_bytes=True), "retriever_bytes"),
    (dict(total_bytes=H100, retriever_bytes=0, gpu_memory_utilization=0), "gpu_memory_utilization"),
    (dict(total_bytes=H100, retriever_bytes=0, gpu_memory_utilization=1.2), "gpu_memory_utilization"),
    (dict(total_bytes=H100, retriever_bytes=0, gpu_memory_utilization="0.5"), "gpu_memory_utilization"),
    (dict(total_bytes=H100, retriever_bytes=0, kv_cache_memory_bytes=GiB), "give model_bytes"),
    (dict(total_bytes=H100, retriever_bytes=0, kv_cache_memory_bytes=0, model_bytes=GiB), "must be > 0"),
    (dict(total_bytes=H100, retriever_bytes=0, reserve_bytes=-5), "reserve_bytes"),
])
def test_bad_input_is_named(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        plan_gpu_split(**kwargs)


def test_random_splits_agree_with_vllms_own_checks():
    """For any sizes: the verdict is exactly vLLM's start-up check (ceil(total*u) <= free, with the
    retriever's memory and the reserve taken) and, with a fixed KV cache, weights + KV <= free; the
    suggested settings always fit, and the suggested fraction is the largest in 0.001 steps."""
    rng = random.Random(7)
    for _ in range(5000):
        total = rng.randrange(1, 200) * GiB + rng.randrange(GiB)
        retriever = rng.randrange(total)
        reserve = rng.choice([0, DEFAULT_RESERVE_BYTES, rng.randrange(GiB)])
        util = rng.choice([None, round(rng.uniform(0.01, 1.0), 3)])
        free = total - retriever - reserve
        room = free > 0 and math.floor(free * 1000 / total) > 0  # vLLM can be given at least 0.001
        u = VLLM_DEFAULT_UTILIZATION if util is None else util
        if rng.random() < 0.5:
            split = plan_gpu_split(total, retriever, gpu_memory_utilization=util, reserve_bytes=reserve)
            assert split.fits == (room and math.ceil(total * u) <= free)
            if room:
                suggested = plan_gpu_split(total, retriever, reserve_bytes=reserve, **split.vllm_args)
                assert suggested.fits
                bigger = split.max_gpu_memory_utilization + 0.001
                assert bigger > 1 or math.ceil(total * bigger) > free
        else:
            model = rng.randrange(1, total)
            kv = rng.randrange(1, total)
            split = plan_gpu_split(total, retriever, gpu_memory_utilization=util, kv_cache_memory_bytes=kv,
                                   model_bytes=model, reserve_bytes=reserve)
            assert split.fits == (room and model + kv <= free)
            if room and split.max_kv_cache_memory_bytes > 0:
                suggested = plan_gpu_split(total, retriever, model_bytes=model, reserve_bytes=reserve,
                                           **split.vllm_args)
                assert suggested.fits
                assert math.ceil(total * suggested.vllm_args["gpu_memory_utilization"]) <= free


def test_vllm_first_needs_only_the_sum_to_fit():
    # With the retriever opening once vLLM is up, vLLM's start-up check never sees its memory: a fixed KV
    # cache keeps vLLM's own fraction instead of the lowered one the other order needs.
    split = plan_gpu_split(H100, 10 * GiB, kv_cache_memory_bytes=30 * GiB, model_bytes=20 * GiB, vllm_first=True)
    assert split.fits and not split.retriever_first
    assert split.vllm_args == {"kv_cache_memory_bytes": 30 * GiB, "gpu_memory_utilization": VLLM_DEFAULT_UTILIZATION}
    assert "the retriever opens once vLLM is up" in split.advice
    # With the fraction the verdict is the same in both orders; only the advice on the order differs.
    for util in (0.8, 0.92):
        before, after = (plan_gpu_split(H100, 10 * GiB, gpu_memory_utilization=util, vllm_first=v)
                         for v in (False, True))
        assert before.fits == after.fits and before.vllm_args == after.vllm_args
        assert before.retriever_first and not after.retriever_first
        assert "before starting vLLM" in before.advice and "before starting vLLM" not in after.advice


def test_plugin_split_takes_what_vllms_fraction_leaves():
    # vLLM at 0.8 of 80 GiB holds 64 GiB; 14 GiB are free now (another process holds 2).
    split = plan_plugin_split(H100, 14 * GiB, gpu_memory_utilization=0.8)
    assert split.fits and split.retriever_bytes == 13 * GiB  # the free 14 less the 1 GiB reserve
    split = plan_plugin_split(H100, 20 * GiB, gpu_memory_utilization=0.8)
    assert split.fits and split.retriever_bytes == H100 - math.ceil(0.8 * H100) - GiB  # what 0.8 leaves, 15 GiB
    # A budget given is checked, not changed.
    split = plan_plugin_split(H100, 20 * GiB, budget_bytes=10 * GiB, gpu_memory_utilization=0.8)
    assert split.fits and split.retriever_bytes == 10 * GiB
    split = plan_plugin_split(H100, 20 * GiB, budget_bytes=16 * GiB, gpu_memory_utilization=0.8)
    assert not split.fits and "gpu_memory_utilization=0.787" in split.advice  # (80 - 16 - 1) / 80, rounded down
    # Fits vLLM's fraction, but not what is free now.
    split = plan_plugin_split(H100, 5 * GiB, budget_bytes=10 * GiB, gpu_memory_utilization=0.8)
    assert not split.fits and f"lower the retriever's budget to {4 * GiB} bytes" in split.advice
    with pytest.raises(ConfigError, match="does not fit"):
        split.check()


def test_plugin_split_with_a_fixed_kv_cache_measures_what_vllm_holds():
    # vLLM was given a 30 GiB KV cache; the device has 50 GiB in use: weights and activations ~20 GiB.
    split = plan_plugin_split(H100, 30 * GiB, kv_cache_memory_bytes=30 * GiB)
    assert split.fits and split.vllm_bytes == 50 * GiB and split.retriever_bytes == 29 * GiB
    assert split.vllm_args["kv_cache_memory_bytes"] == 30 * GiB
    split = plan_plugin_split(H100, 30 * GiB, budget_bytes=29 * GiB + 1, kv_cache_memory_bytes=30 * GiB)
    assert not split.fits and f"kv_cache_memory_bytes={30 * GiB - 1}" in split.advice


def test_plugin_split_without_room():
    split = plan_plugin_split(H100, GiB // 2, gpu_memory_utilization=0.99)
    assert not split.fits and split.retriever_bytes == 0 and "nothing is left for the retriever" in split.advice
    with pytest.raises(ConfigError, match="free_bytes"):
        plan_plugin_split(GiB, 2 * GiB)
