"""The engine's configs come from one declaration per knob: checks, messages and CLI flags all follow it."""

from __future__ import annotations

import argparse
import dataclasses
import math
import pickle

import numpy as np
import pytest

from fusionrag.cli import build_parser, main
from fusionrag.retriever.collection.config import CollectionConfig
from fusionrag.retriever.engine.config import BuildConfig, EngineConfig, SearchParams, knobs
from fusionrag.retriever.errors import ConfigError

CONFIGS = (BuildConfig, SearchParams, EngineConfig, CollectionConfig)
# Which `fusionrag` command has each config's flags, and the knobs that have a flag of another form there.
COMMANDS = {BuildConfig: ("build", ()), SearchParams: ("search", ()), EngineConfig: ("search", ("buffer_bytes",))}


def _bounds(k):
    """(low, low inclusive, high, high inclusive) from the declaration's "in [a, b)" / ">= a" text."""
    b = k.bounds
    if b.startswith("in "):
        lo, hi = b[4:-1].split(", ")
        return float(lo), b[3] == "[", float(hi), b[-1] == "]"
    if b.startswith((">=", ">")):
        return float(b.split()[-1]), b.startswith(">="), None, True
    if b.startswith(("<=", "<")):
        return None, True, float(b.split()[-1]), b.startswith("<=")
    return None, True, None, True


def _outside(k):
    """Values just outside a knob's bounds (and of the wrong kind)."""
    lo, lo_in, hi, hi_in = _bounds(k)
    step = 1 if k.type is int else 0.01
    out = []
    if lo is not None:
        out.append(k.type(lo - step) if lo_in else k.type(lo))
    if hi is not None:
        out.append(k.type(hi + step) if hi_in else k.type(hi))
    if k.choices:
        out.append("no-such-" + k.name)
    if k.type in (int, float):
        out.append("many")
    if k.type is bool:
        out.append("maybe")
    return out


def _knobs(*classes):
    return [(cls, k) for cls in classes for k in knobs(cls).values()]


@pytest.mark.parametrize("cls,k", _knobs(*CONFIGS), ids=lambda x: getattr(x, "name", getattr(x, "__name__", "")))
def test_every_knob_has_help_and_its_default_passes_its_own_checks(cls, k):
    assert k.help and not k.help.endswith(".")
    assert cls().__getattribute__(k.name) == k.default or k.name == "build"
    if k.choices:
        assert k.default in k.choices
    lo, lo_in, hi, hi_in = _bounds(k)
    if lo is not None:
        assert k.default >= lo if lo_in else k.default > lo
    if hi is not None:
        assert k.default <= hi if hi_in else k.default < hi


@pytest.mark.parametrize("cls,k", [(c, k) for c, k in _knobs(*CONFIGS) if _outside(k)],
                         ids=lambda x: getattr(x, "name", getattr(x, "__name__", "")))
def test_a_bad_value_is_refused_naming_the_knob_and_what_it_allows(cls, k):
    for bad in _outside(k):
        for make in (lambda: cls(**{k.name: bad}), lambda: cls().with_overrides(**{k.name: bad})):
            with pytest.raises(ConfigError) as e:
                make()
            msg = str(e.value)
            assert msg.startswith(f"{k.name} must be ") and msg.endswith(f"got {bad!r}"), msg
            assert (k.allowed in msg) or f"must be a {k.type.__name__}" in msg, msg


def test_messages_the_callers_rely_on():
    cases = [
        (lambda: EngineConfig(rerank_inflight=0),
         "rerank_inflight must be in [1, 1024] (1: one query at a time), got 0"),
        (lambda: BuildConfig(metric="hamming"), "metric must be one of ('l2', 'ip', 'cosine'), got 'hamming'"),
        (lambda: BuildConfig(centroid_ratio=7), "centroid_ratio must be in (0, 0.5], got 7"),
        (lambda: BuildConfig(pq_m=300), "pq_m must be in [0, 256] (0 = automatic), got 300"),
        (lambda: EngineConfig(gpu_memory_utilization=1.0), "gpu_memory_utilization must be in [0, 1), got 1.0"),
        (lambda: SearchParams(beta=-1), "beta must be >= 0 (0 disables early stop), got -1"),
        (lambda: SearchParams(nprobe=2.5), "nprobe must be a int, got 2.5"),
        (lambda: SearchParams(eps=math.nan), "eps must be in [0, 1], got nan"),
        (lambda: BuildConfig(graph_m=32, graph_ef_construction=16), "graph_ef_construction must be >= graph_m"),
        (lambda: BuildConfig().with_overrides(graph_ef_construction=8), "graph_ef_construction must be >= graph_m"),
        (lambda: CollectionConfig(build={"graph_m": 2}), "build.graph_m must be in [4, 64], got 2"),
        (lambda: SearchParams.from_dict({"nprobe": 4, "k": 1, "zz": 2}), "unknown SearchParams option(s): k, zz"),
        (lambda: SearchParams().with_overrides(nprob=4), "unknown SearchParams option(s): nprob"),
        (lambda: EngineConfig(pin_fraction=0.9, filter_tier="tpu"),
         "pin_fraction must be in [0, 0.75], got 0.9; filter_tier must be one of ('auto', 'cpu', 'gpu'), got 'tpu'"),
    ]
    for make, message in cases:
        with pytest.raises(ConfigError) as e:
            make()
        assert str(e.value) == message


def test_configs_stay_frozen_dataclasses():
    p = SearchParams(nprobe=np.int64(32), eps=0)
    assert type(p.nprobe) is int and type(p.eps) is float  # numbers of the declared type
    assert [f.name for f in dataclasses.fields(SearchParams)] == list(knobs(SearchParams))
    assert dataclasses.fields(SearchParams)[0].default == 256  # plain defaults (server/requests.py types by them)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.nprobe = 3
    assert dataclasses.replace(p, rerank=50) == SearchParams(nprobe=32, rerank=50)
    with pytest.raises(ConfigError, match="rerank must be"):
        dataclasses.replace(p, rerank=0)
    assert pickle.loads(pickle.dumps(p)) == p and hash(p) == hash(SearchParams(nprobe=32))
    c = CollectionConfig(build=BuildConfig(metric="ip"))
    assert CollectionConfig.from_dict(c.to_dict()) == c and c.to_dict()["build"]["metric"] == "ip"
    assert EngineConfig().batch_for("cpu") == 64 and EngineConfig(batch_size=5).batch_for("gpu") == 5


def test_with_overrides_checks_only_what_it_is_given():
    p = SearchParams(nprobe=64)
    assert p.with_overrides() is p and p.with_overrides(nprobe=None, rerank=None) is p
    q = p.with_overrides(rerank=np.int32(40), eps=None, probe_ratio=0)
    assert q == SearchParams(nprobe=64, rerank=40, probe_ratio=0.0) and type(q.rerank) is int
    assert p == SearchParams(nprobe=64)  # the original is untouched


@pytest.mark.parametrize("cls", list(COMMANDS))
def test_every_knob_is_a_flag_with_its_help(cls):
    command, elsewhere = COMMANDS[cls]
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    actions = {a.dest: a for a in sub._actions}
    for k in knobs(cls).values():
        if k.name in elsewhere:
            assert k.name not in actions
            continue
        a = actions[k.name]
        assert a.option_strings[0] == "--" + k.name.replace("_", "-") and a.default is None
        assert a.help.startswith(k.help.replace("%", "%%"))
        if k.type is bool:
            assert isinstance(a, argparse.BooleanOptionalAction)
        else:
            assert a.type is k.type and f"default {k.default!r}" in a.help
            assert (a.metavar == "{" + ",".join(k.choices) + "}") if k.choices else k.bounds in a.help
        assert a.choices is None  # bad values are the configs' to refuse, with their messages


@pytest.mark.parametrize("argv,message", [
    (["build", "x.fbin", "idx", "--centroid-ratio", "7"], "centroid_ratio must be in (0, 0.5], got 7.0"),
    (["build", "x.fbin", "idx", "--metric", "hamming"], "metric must be one of"),
    (["search", "idx", "q.fbin", "--out", "o.npy", "--nprobe", "0"], "nprobe must be in [1, 1048576], got 0"),
    (["search", "idx", "q.fbin", "--out", "o.npy", "--pin-fraction", "0.8"], "pin_fraction must be in [0, 0.75]"),
])
def test_a_bad_flag_is_refused_by_its_knob(tmp_path, monkeypatch, capsys, argv, message):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    assert message in capsys.readouterr().err
