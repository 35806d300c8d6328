"""pipeline.claims: the verdict rule, the measured interval, claims.yaml validation, and the Claims table that
ends the report of a hand-made results tree (no training)."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest

from pipeline import claims as cl
from pipeline.report import main as report_main

T_975_2 = 4.302653  # Student t quantile t_{0.975, 2} (3 seeds), from a printed table


# ----------------------------------------------------------------------------- the rule


@pytest.mark.parametrize("expect, lo, hi, tol, want", [
    ("greater", 0.01, 0.05, None, "reproduced"),
    ("greater", -0.05, -0.01, None, "not reproduced"),
    ("greater", -0.01, 0.03, None, "inconclusive at 3 seeds"),  # straddles 0
    ("greater", 0.01, 0.05, 0.02, "inconclusive at 3 seeds"),  # above 0 but straddles the minimum effect
    ("greater", 0.03, 0.05, 0.02, "reproduced"),
    ("greater", -0.01, 0.02, 0.02, "not reproduced"),  # never above the minimum effect
    ("less", -0.05, -0.01, None, "reproduced"),
    ("less", 0.01, 0.05, None, "not reproduced"),
    ("less", -0.02, 0.01, None, "inconclusive at 3 seeds"),
    ("similar", -0.01, 0.015, 0.02, "reproduced"),
    ("similar", 0.03, 0.05, 0.02, "not reproduced"),
    ("similar", -0.06, -0.03, 0.02, "not reproduced"),
    ("similar", 0.0, 0.03, 0.02, "inconclusive at 3 seeds"),
])
def test_verdict_rule(expect, lo, hi, tol, want):
    assert cl.verdict(expect, 3, lo, hi, tolerance=tol) == want


def test_verdict_against_a_published_value():
    assert cl.verdict("value", 3, 0.89, 0.91, tolerance=0.02, value=0.9) == "reproduced"
    assert cl.verdict("value", 3, 0.70, 0.80, tolerance=0.02, value=0.9) == "not reproduced"
    assert cl.verdict("value", 3, 0.85, 0.95, tolerance=0.02, value=0.9) == "inconclusive at 3 seeds"


def test_verdict_without_an_interval_and_bad_arguments():
    assert cl.verdict("greater", 1, None, None) == "inconclusive at 1 seed"
    with pytest.raises(ValueError, match="expect"):
        cl.verdict("bigger", 3, 0.0, 1.0)
    with pytest.raises(ValueError, match="tolerance"):
        cl.verdict("similar", 3, 0.0, 1.0)


# ----------------------------------------------------------------------------- measuring


def _claim(**kw) -> cl.Claim:
    base = dict(id="x", claim="x", source="s", metric="final_acc", a="a", b="b", expect="greater")
    base.update(kw)
    return cl.Claim(**base)


def test_paired_interval_is_the_hand_computed_t_interval():
    # differences 0.10, 0.10, 0.05 on the common seeds 1-3 (seed 4 has no partner): mean 1/12, sample std
    # sqrt((2 (1/60)^2 + (1/30)^2) / 2) = 0.0288675, half width t_{0.975,2} * 0.0288675 / sqrt(3)
    a = {"1": 0.80, "2": 0.90, "3": 0.85, "4": 0.99}
    b = {"1": 0.70, "2": 0.80, "3": 0.80}
    o = cl.measure(_claim(), a, b)
    mean, sd = 1 / 12, math.sqrt((2 * (1 / 60) ** 2 + (1 / 30) ** 2) / 2)
    half = T_975_2 * sd / math.sqrt(3)
    assert o.n == 3 and o.mean == pytest.approx(mean)
    assert o.lo == pytest.approx(mean - half, abs=1e-6) and o.hi == pytest.approx(mean + half, abs=1e-6)
    assert o.lo == pytest.approx(0.011622, abs=1e-5)
    assert o.verdict == "reproduced"
    assert cl.measure(_claim(expect="less"), a, b).verdict == "not reproduced"


def test_value_claim_uses_a_alone():
    # a = 0.90, 0.92, 0.94: mean 0.92, std 0.02, half width 4.302653 * 0.02 / sqrt(3) = 0.049683
    a = {"1": 0.90, "2": 0.92, "3": 0.94}
    o = cl.measure(_claim(b=None, expect="value", value=0.92, tolerance=0.03), a)
    assert o.mean == pytest.approx(0.92)
    assert (o.lo, o.hi) == (pytest.approx(0.870317, abs=1e-5), pytest.approx(0.969683, abs=1e-5))
    assert o.verdict == "inconclusive at 3 seeds"  # [0.870, 0.970] reaches outside 0.92 +- 0.03
    assert cl.measure(_claim(b=None, expect="value", value=0.92, tolerance=0.06), a).verdict == "reproduced"


def test_missing_arms_give_not_run_or_needs_data():
    some = {"1": 0.5, "2": 0.6}
    assert cl.measure(_claim(), None, some).verdict == "not run"
    o = cl.measure(_claim(needs="cifar10"), some, None)
    assert o.verdict == "needs data: cifar10" and o.note == "no results for b"
    # both ran, but no seed has the metric in both (a target only one arm reached)
    o = cl.measure(_claim(metric="rounds_to_target", expect="less"), {"1": 12.0}, {"2": 20.0})
    assert o.verdict == "inconclusive at 0 seeds" and o.mean is None


def test_run_metrics_per_seed():
    cols = {"test_acc": np.array([0.1, 0.2, 0.3, 0.5, 0.4, 0.6]),
            "test_loss": np.array([2.0, 1.0, 1.5]),
            "client_loss/0": np.array([1.0, 1.0, 3.0, 3.0]),
            "client_loss/1": np.array([1.0, 1.0, 1.0, 1.0])}
    assert cl._run_metric(cols, "early_acc") == pytest.approx(0.15)  # first third: 0.1, 0.2
    assert cl._run_metric(cols, "oscillation") == pytest.approx(0.15)  # |0.4 - 0.5|, |0.6 - 0.4|
    assert cl._run_metric(cols, "min_test_loss") == 1.0
    assert cl._run_metric(cols, "client_loss_spread") == pytest.approx(1.0)  # late means 3 and 1
    assert cl._run_metric(cols, "cos_mean") is None


# ----------------------------------------------------------------------------- validation

GOOD = """\
claims:
  - id: bug_beats_avg
    claim: "FedBug beats FedAvg"
    source: "FedBug, Table 1"
    metric: final_acc
    a: fedbug_dir
    b: fedavg_dir
    expect: greater
"""


@pytest.mark.parametrize("edit, where, message", [
    (("    expect: greater\n", "    expect: greater\n    colour: red\n"), "claim 'bug_beats_avg'", "colour: unknown key"),
    (('    source: "FedBug, Table 1"\n', ""), "claim 'bug_beats_avg'", "source: missing"),
    (("    a: fedbug_dir\n", "    a: fedbug_iid\n"), "claim 'bug_beats_avg'", "a: 'fedbug_iid' is not an experiment"),
    (("    b: fedavg_dir\n", "    b: nope\n"), "claim 'bug_beats_avg'", "b: 'nope' is not an experiment"),
    (("expect: greater", "expect: bigger"), "claim 'bug_beats_avg'", "expect: 'bigger' is not one of"),
    (("expect: greater", "expect: similar"), "claim 'bug_beats_avg'", "tolerance: missing"),
    (("expect: greater", "expect: greater\n    tolerance: -1"), "claim 'bug_beats_avg'", "tolerance: must be"),
    (("expect: greater", "expect: value\n    value: 0.9\n    tolerance: 0.1"), "claim 'bug_beats_avg'",
     "b: not with expect: value"),
    (("metric: final_acc", "metric: final_accuracy"), "claim 'bug_beats_avg'", "metric: 'final_accuracy'"),
    (("expect: greater", "expect: greater\n    needs: imagenet"), "claim 'bug_beats_avg'", "needs: 'imagenet'"),
    (("  - id: bug_beats_avg\n    claim:", "  - claim:"), "claims[0]", "id: missing"),
    (("claims:\n", "version: 1\nclaims:\n"), "", "unknown top-level key 'version'"),
])
def test_validation_errors_are_one_line_naming_file_claim_and_key(tmp_path, edit, where, message):
    path = tmp_path / "claims.yaml"
    path.write_text(GOOD.replace(*edit))
    with pytest.raises(cl.ClaimsError) as err:
        cl.load_claims(path, ["fedavg_dir", "fedbug_dir"])
    text = str(err.value)
    assert "\n" not in text and text.startswith(f"{path}: {where}") and message in text


def test_duplicate_ids_are_refused(tmp_path):
    path = tmp_path / "claims.yaml"
    path.write_text(GOOD + GOOD.split("claims:\n", 1)[1])
    with pytest.raises(cl.ClaimsError, match=r"claim 'bug_beats_avg': id: used by an earlier claim"):
        cl.load_claims(path, ["fedavg_dir", "fedbug_dir"])


def test_a_valid_file_loads(tmp_path):
    path = tmp_path / "claims.yaml"
    path.write_text(GOOD)
    (c,) = cl.load_claims(path, ["fedavg_dir", "fedbug_dir"])
    assert (c.id, c.a, c.b, c.expect, c.tolerance, c.needs) == ("bug_beats_avg", "fedbug_dir", "fedavg_dir",
                                                                 "greater", None, None)


STUDIES = Path(__file__).resolve().parents[1] / "studies"


def test_every_paper_study_has_a_claims_file():
    have = {p.parent.name for p in STUDIES.glob("*/claims.yaml")}
    assert {"fedbug", "fednlr", "fedbcgd", "noniid", "noniid_cifar10"} <= have


@pytest.mark.parametrize("study", sorted(p.parent.name for p in STUDIES.glob("*/claims.yaml")))
def test_the_studies_claims_files_are_valid(study):
    from pipeline.grid import load_grid

    root = STUDIES / study
    claims = cl.load_claims(root / "claims.yaml", list(load_grid(root / "params.yaml").experiments))
    assert 3 <= len(claims) <= 16
    assert "claims.yaml" in (root / "dvc.yaml").read_text()  # the report is rebuilt when the claims change


# ----------------------------------------------------------------------------- end to end

PARAMS = """\
seeds: [1, 2, 3]
dataset: {name: digits}
train: {rounds: 4, target_acc: 0.85}
experiments:
  fedavg_dir: {algorithm: fedavg, partition: dirichlet, partition.alpha: 0.3}
  fedbug_dir: {algorithm: fedbug, algorithm.fedbug.gu_percentage: 0.2, partition: dirichlet, partition.alpha: 0.3}
  fedprox_dir: {algorithm: fedprox, partition: dirichlet, partition.alpha: 0.3}
  fedavg_cifar: {algorithm: fedavg, partition: iid, dataset: cifar10}
"""

CLAIMS = GOOD + """\
  - id: prox_like_avg
    claim: "FedProx matches FedAvg"
    source: "FedProx, Fig. 1"
    metric: final_acc
    a: fedprox_dir
    b: fedavg_dir
    expect: similar
    tolerance: 0.01
  - id: bug_oscillates_less
    claim: "FedBug's accuracy oscillates less"
    source: "made up"
    metric: oscillation
    a: fedbug_dir
    b: fedavg_dir
    expect: less
  - id: cifar_value
    claim: "FedAvg reaches 60% on CIFAR-10"
    source: "a paper, Table 2"
    metric: final_acc
    a: fedavg_cifar
    expect: value
    value: 0.6
    tolerance: 0.02
    needs: cifar10
"""

# final accuracy per seed: FedBug +0.10, +0.10, +0.05 over FedAvg; FedProx -0.02, +0.03, 0.0 (straddles +-0.01)
FINAL = {"fedavg_dir": [0.70, 0.80, 0.80], "fedbug_dir": [0.80, 0.90, 0.85], "fedprox_dir": [0.68, 0.83, 0.80]}
ZIGZAG = {"fedavg_dir": 0.05, "fedbug_dir": 0.01, "fedprox_dir": 0.03}  # +- amplitude of the accuracy curve


def _write(results: Path, name: str) -> None:
    d = results / name
    d.mkdir(parents=True)
    per_seed, rows = {}, []
    for seed, final in zip((1, 2, 3), FINAL[name]):
        per_seed[str(seed)] = {"final_acc": final, "best_acc": final}
        for r in range(1, 9):
            acc = final - 0.02 * (8 - r) + (ZIGZAG[name] if r % 2 else -ZIGZAG[name]) * (1 + 0.1 * seed)
            rows.append({"seed": seed, "round": r, "train_loss": 1.0 / r, "test_acc": acc, "test_loss": 1 - acc})
    fin = FINAL[name]
    metrics = {"experiment": name, "algorithm": "fedavg", "dataset": "digits", "model": "small_cnn",
               "partition": "digits-dirichlet-per_client-a0.3-n10-sgm0-s0", "rounds": 8, "target_acc": 0.85,
               "seeds": [1, 2, 3], "failed_seeds": [], "final_acc_mean": sum(fin) / 3, "final_acc_std": 0.0,
               "per_seed": per_seed}
    (d / "metrics.json").write_text(json.dumps(metrics))
    with open(d / "runs.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


@pytest.fixture
def study(tmp_path):
    results = tmp_path / "results"
    for name in FINAL:
        _write(results, name)
    (tmp_path / "params.yaml").write_text(PARAMS)
    (tmp_path / "claims.yaml").write_text(CLAIMS)
    return tmp_path


def _claims_rows(md: str):
    section = md.split("## Claims", 1)[1]
    lines = [ln for ln in section.splitlines() if ln.startswith("| ")]
    return {ln.split("`")[1]: [c.strip() for c in ln.strip().strip("|").split("|")] for ln in lines[1:]}


def test_report_ends_with_the_claims_table(study, capsys):
    results = study / "results"
    assert report_main(["--params", str(study / "params.yaml"), "--results", str(results)]) == 0
    md = (results / "report.md").read_text()
    tail = md.split("## Claims", 1)[1]
    assert "\n## " not in tail  # the last section
    rows = _claims_rows(md)
    assert list(rows) == ["bug_beats_avg", "prox_like_avg", "bug_oscillates_less", "cifar_value"]
    # FedBug - FedAvg: the hand-computed interval of test_paired_interval_is_the_hand_computed_t_interval, in pp
    assert rows["bug_beats_avg"][2] == "a - b > 0 pp"
    assert rows["bug_beats_avg"][3] == "`fedbug_dir` - `fedavg_dir` (final_acc): +8.33 pp [+1.16, +15.50] (3 seeds)"
    assert rows["bug_beats_avg"][4] == "**reproduced**"
    # FedProx - FedAvg = -0.02, +0.03, 0.00: mean +0.33 pp, its interval straddles +-1 pp
    assert rows["prox_like_avg"][3].startswith("`fedprox_dir` - `fedavg_dir` (final_acc): +0.33 pp [")
    assert rows["prox_like_avg"][4] == "**inconclusive at 3 seeds**"
    # oscillation from runs.csv: mean |step| over the second half; FedBug's zigzag is smaller on every seed
    assert rows["bug_oscillates_less"][4] == "**reproduced**"
    assert rows["cifar_value"][2] == "a within 60 ± 2%"
    assert rows["prox_like_avg"][2] == "a - b within ±1 pp"
    assert rows["cifar_value"][4] == "**needs data: cifar10**" and "no results for fedavg_cifar" in rows["cifar_value"][3]
    assert "2 of 3 measured claims reproduced (4 claims)." in tail


def test_report_without_claims_file_has_no_claims_section(study):
    (study / "claims.yaml").unlink()
    assert report_main(["--params", str(study / "params.yaml"), "--results", str(study / "results")]) == 0
    assert "## Claims" not in (study / "results" / "report.md").read_text()


def test_a_bad_claims_file_stops_the_report_with_exit_2(study, capsys):
    (study / "claims.yaml").write_text(CLAIMS.replace("b: fedavg_dir\n    expect: similar",
                                                      "b: fedavg_iid\n    expect: similar"))
    assert report_main(["--params", str(study / "params.yaml"), "--results", str(study / "results")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert err == (f"error: {study / 'claims.yaml'}: claim 'prox_like_avg': b: 'fedavg_iid' is not an experiment "
                   "of the study's params.yaml")
    assert not (study / "results" / "report.md").exists()


def test_a_target_one_arm_never_reached_is_an_infinite_difference_not_missing_data():
    """up_floats_to_target / rounds_to_target of a seed that never reached the target is +inf: a claim that a needs
    fewer floats than b is not reproduced when a never got there in any seed and b did in every one (the fedbcgd
    study's FedBCGD+ paper rows), reproduced in the mirror case; seeds where neither did are left out; a mix of
    finite and infinite differences has no interval (inconclusive)."""
    inf = math.inf
    never, always = {"1": inf, "2": inf, "3": inf}, {"1": 7e5, "2": 8e5, "3": 6e5}
    fewer = _claim(metric="up_floats_to_target", expect="less")
    o = cl.measure(fewer, never, always)
    assert o.verdict == "not reproduced" and o.n == 3 and o.mean == inf
    assert o.note == "a never reached the target in 3 and b in 0 of the 3 seeds where one of them did"
    assert "never reached the target" in cl._effect(o) and "inf" not in cl._effect(o).split("(")[0]
    assert cl.measure(fewer, always, never).verdict == "reproduced"
    assert cl.measure(_claim(metric="rounds_to_target", expect="greater"), never, always).verdict == "reproduced"
    # seed 3: neither arm got there; seeds 1-2 as above
    o = cl.measure(fewer, never, {**always, "3": inf})
    assert o.verdict == "not reproduced" and o.n == 2
    # seed 1 finite in both: no interval from a mix of finite and infinite differences
    o = cl.measure(fewer, {**never, "1": 5e5}, always)
    assert o.verdict == "inconclusive at 3 seeds" and o.mean is None
    # no seed reached it in either arm: nothing measured, as before
    assert cl.measure(fewer, never, never).verdict == "inconclusive at 0 seeds"


def test_to_target_values_of_an_experiment_mark_the_seeds_that_never_got_there():
    from pipeline.results import Experiment

    e = Experiment("x", [], metrics={"per_seed": {"1": {"final_acc": 0.9, "up_floats_to_target": 3e5},
                                                  "2": {"final_acc": 0.5, "up_floats_to_target": None}}})
    assert cl.metric_values(e, "up_floats_to_target", Path(".")) == {"1": 3e5, "2": math.inf}
    assert cl.metric_values(e, "final_acc", Path(".")) == {"1": 0.9, "2": 0.5}
