"""The service's settings: one declaration per setting gives its flag, its environment variable and its TOML key;
a bad value in any of them is refused naming the source and the setting; flags > environment > file > defaults."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest

from fusionrag.cli import build_parser
from fusionrag.retriever.engine.config import knobs
from fusionrag.retriever.errors import ConfigError
from fusionrag.server.config import ENV_PREFIX, ServerConfig, load_config

KNOBS = knobs(ServerConfig)
ROOT = Path(__file__).resolve().parents[2]


def _valid(k, value) -> bool:
    try:
        ServerConfig(**{k.name: value})
        return True
    except ConfigError:
        return False


def _distinct(k, n=3):
    """n valid values of a setting, each unlike the one before it (and the first unlike the default)."""
    if k.type is bool:
        pool = [not k.default, k.default]
    elif k.choices:
        pool = [c for c in k.choices if c != k.default] + [k.default]
    elif k.type is str:
        pool = [f"{k.name}-{i}" for i in range(n)]
    else:
        pool = [v for v in (k.type(k.default) + d for d in (1, 2, 3, -1, -2, -3, 0.5, 0.25, -0.25, -0.5))
                if (k.type is float or float(v).is_integer())]
    pool = [v for v in pool if v != k.default and _valid(k, v)] + [k.default]
    if len(set(map(repr, pool))) < 2:
        return None
    out = []
    for i in range(n):
        out.append(pool[i % len(pool)] if len(pool) > 2 else pool[i % 2])
    return out


def _toml(value) -> str:
    return json.dumps(value)  # TOML's booleans, numbers and basic strings are JSON's


def _env(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _ids(k):
    return k.name


@pytest.mark.parametrize("k", [k for k in KNOBS.values() if _distinct(k)], ids=_ids)
def test_each_setting_is_layered_flags_over_env_over_file_over_default(tmp_path, k):
    file_v, env_v, flag_v = _distinct(k)
    f = tmp_path / "fusionrag.toml"
    f.write_text(f"{k.name} = {_toml(file_v)}\n")
    env = {ENV_PREFIX + k.name.upper(): _env(env_v)}
    assert getattr(load_config(None, {}, environ={}), k.name) == k.default
    assert getattr(load_config(str(f), {}, environ={}), k.name) == file_v
    assert getattr(load_config(str(f), {}, environ=env), k.name) == env_v
    if k.flag:
        assert getattr(load_config(str(f), {k.name: flag_v}, environ=env), k.name) == flag_v
    assert getattr(load_config(str(f), {k.name: None}, environ=env), k.name) == env_v  # a flag not given


def _bad(k):
    if k.type is bool:
        return "maybe"
    if k.choices:
        return "no-such-" + k.name
    if k.type is str:
        return "" if k.name == "data_dir" else None
    for v in (-1, 10 ** 12, 0, 1, 1024 * 0.5):
        if not _valid(k, k.type(v)):
            return k.type(v)
    return "many"


@pytest.mark.parametrize("source", ["flag", "env", "file"])
@pytest.mark.parametrize("k", [k for k in KNOBS.values() if _bad(k) is not None], ids=_ids)
def test_a_bad_value_in_any_source_names_the_source_and_the_setting(tmp_path, k, source):
    bad = _bad(k)
    f = tmp_path / "fusionrag.toml"
    f.write_text(f"{k.name} = {_toml(bad)}\n" if source == "file" else "")
    env = {ENV_PREFIX + k.name.upper(): _env(bad)} if source == "env" else {}
    if source == "flag" and not k.flag:
        return
    flags = {k.name: bad} if source == "flag" else {}
    with pytest.raises(ConfigError) as e:
        load_config(str(f), flags, environ=env)
    msg = str(e.value)
    where = {"flag": "--" + k.name.replace("_", "-"), "env": ENV_PREFIX + k.name.upper(),
             "file": f"config file {f}"}[source]
    assert msg.startswith(f"{where}: {k.name} must be "), msg
    if not isinstance(bad, str) or k.choices:
        assert k.allowed in msg, msg


def test_a_file_keeps_its_types_and_names():
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "fusionrag.toml"
        for text, words in [('port = "8001"\n', "port must be a int"), ("demo = 1\n", "demo must be a bool"),
                            ("[server]\nmax_kk = 3\n", "unknown setting(s): max_kk"),
                            ("max_k = 5.5\n", "max_k must be a int")]:
            f.write_text(text)
            with pytest.raises(ConfigError, match=re.escape(f"config file {f}: ") + ".*" + re.escape(words)):
                load_config(str(f), {}, environ={})
        f.write_text("[server]\nbatch_wait_ms = 5\n")
        assert load_config(str(f), {}, environ={}).batch_wait_ms == 5.0
    assert load_config(None, {}, environ={"fusionrag_port": "1", "FUSIONRAG_PORTS": "2"}).port == 8000
    with pytest.raises(ConfigError, match="^FUSIONRAG_EMBEDDING: unknown embedding model 'bert'"):
        load_config(None, {}, environ={"FUSIONRAG_EMBEDDING": "bert"})
    assert load_config(None, {"embedding": "sentence-transformers/all-MiniLM-L6-v2"}, environ={}).embedding == \
        ServerConfig().embedding


def test_every_setting_is_a_serve_flag_with_its_help_and_environment_name():
    serve = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    actions = {a.dest: a for a in serve._actions}
    for k in KNOBS.values():
        if not k.flag:
            assert k.name not in actions  # secrets stay off the command line
            continue
        a = actions[k.name]
        assert k.help and a.option_strings[0] == "--" + k.name.replace("_", "-") and a.default is None
        assert a.help.startswith(k.help) and f"env {ENV_PREFIX}{k.name.upper()}" in a.help
        assert isinstance(a, argparse.BooleanOptionalAction) if k.type is bool else a.type is k.type
    # --ray, --index, --name, --routers and --proxy-location serve a sharded index instead (flags only; docs/api.md
    # says so).
    sharded = {"ray", "index", "name", "routers", "proxy_location"}
    assert set(actions) - {"help", "config"} - sharded == {k.name for k in KNOBS.values() if k.flag}


def test_every_setting_is_in_the_api_page():
    api = (ROOT / "docs" / "api.md").read_text()
    assert not [k.name for k in KNOBS.values() if f"`{ENV_PREFIX}{k.name.upper()}`" not in api]


def test_gpu_settings_without_a_cuda_device_are_refused_or_said_at_start(tmp_path):
    """#67 item 6: `--filter-tier gpu` where there is no CUDA device is refused at start, naming what to use
    instead (it failed each collection as it opened); `--gpu-budget-mb` there is said once in the log."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "-1"}  # no device, whatever this machine has ...
    env.pop("TRITON_INTERPRET", None)  # ... and not Triton's interpreter, under which the GPU tier runs on the CPU
    cmd = [sys.executable, "-m", "fusionrag", "serve", "--no-demo", "--host", "127.0.0.1", "--port", "0",
           "--data-dir", str(tmp_path / "data")]
    out = subprocess.run(cmd + ["--filter-tier", "gpu"], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    assert "--filter-tier gpu needs a CUDA device" in out.stderr and "auto" in out.stderr, out.stderr[-2000:]
    proc = subprocess.Popen(cmd + ["--gpu-budget-mb", "512"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        seen = ""
        for line in proc.stderr:
            seen += line
            if "gpu-budget-mb" in line or "Uvicorn running" in line or "started" in line.lower():
                break
        assert "--gpu-budget-mb 512 is set, but there is no CUDA device here" in seen, seen[-2000:]
    finally:
        proc.terminate()
        proc.wait(30)
