"""The service at several load levels, filter_tier auto against cpu (loadtests/levels.py, #47): the whole run at toy
size on the CPU, where both services really run and Locust drives them. Without CUDA auto is the CPU tier, so what
is checked is the study, not a GPU: every level measured for both tiers, its figures those of the run's own request
logs, the tier that served read from the service's counter (cpu for both here), and the verdict following from the
figures. The GPU run is step e of `make gpu-accept`."""

import json

import pytest

from fusionrag.loadtests import levels
from fusionrag.loadtests.report import read_request_log


def test_both_tiers_at_every_level_with_the_verdict_from_the_figures(tmp_path):
    out = tmp_path / "levels"
    status = levels.main(["--out", str(out), "--users", "1", "3", "--seconds", "3", "--warmup-seconds", "1",
                          "--count", "1500", "--dim", "16", "--num-queries", "30", "--min-ratio", "0.0"])
    r = json.loads((out / "levels.json").read_text())
    assert set(r["levels"]) == {"auto", "cpu"} and all(set(t) == {"1", "3"} for t in r["levels"].values())
    for tier, by_users in r["levels"].items():
        for users, x in by_users.items():
            rows = read_request_log(str(out / tier / f"{users}-users" / "requests.csv"))
            assert x["requests"] == len(rows) > 0 and x["failures"] == sum(1 for row in rows if not row["ok"])
            assert x["recall"] >= 0.9
            # No CUDA here: the service under either setting searched on the CPU tier, as its counter says.
            assert x["queries_by_filter_tier"] == {"cpu": pytest.approx(x["queries_by_filter_tier"]["cpu"])}
            assert x["queries_by_filter_tier"]["cpu"] >= x["requests"] - x["failures"]
    for users, ratio in r["auto_over_cpu"].items():
        assert ratio == pytest.approx(r["levels"]["auto"][users]["per_s"] / r["levels"]["cpu"][users]["per_s"])
    assert r["auto_over_cpu_worst"] == min(r["auto_over_cpu"].values())
    assert r["passed"] == (r["failures"] == 0) and status == (0 if r["passed"] else 1)
    md = (out / "levels.md").read_text()
    assert "| 1 |" in md and "| 3 |" in md
