"""pipeline.report on a hand-made results tree (no training): tables, figure, summary.csv, exit codes."""

from __future__ import annotations

import csv
import json
import statistics
from pathlib import Path

import pytest

from fl_core.algorithms import registry
from fl_core.algorithms.base import Description
from pipeline.labels import algorithm_label, partition_label
from pipeline.report import main

ROOT = Path(__file__).resolve().parents[1]
PARTS = {"iid": "digits-iid-n20-sgm0-s0", "dir": "digits-dirichlet-per_client-a0.3-n20-sgm0-s0"}
ALGOS = {"fedavg": Description("fedavg"), "fedbug": Description("fedbug", [("P", 0.2)], Description("fedavg"))}
SEEDS = [1, 2]
ROUNDS = 4
# final test accuracy per (algorithm, partition) and seed
FINAL = {("fedavg", "iid"): [0.80, 0.90], ("fedbug", "iid"): [0.86, 0.88],
         ("fedavg", "dir"): [0.60, 0.70], ("fedbug", "dir"): [0.70, 0.74]}
TARGET = 0.85

PARAMS = """\
seeds: [1, 2]
dataset: {name: digits}
train: {rounds: 4, target_acc: 0.85}
experiments:
  fedavg_iid: {algorithm: fedavg, partition: iid}
  fedbug_iid: {algorithm: fedbug, algorithm.fedbug.gu_percentage: 0.2, partition: iid}
  fedavg_dir: {algorithm: fedavg, partition: dirichlet, partition.alpha: 0.3}
  fedbug_dir: {algorithm: fedbug, algorithm.fedbug.gu_percentage: 0.2, partition: dirichlet, partition.alpha: 0.3}
  fedprox_iid: {algorithm: fedprox, partition: iid}
"""


def _curve(final: float):
    """Test accuracy per round rising linearly to ``final``; train loss falling."""
    return [round(final * r / ROUNDS, 6) for r in range(1, ROUNDS + 1)]


def _write_experiment(results: Path, algo: str, part: str) -> None:
    name = f"{algo}_{part}"
    d = results / name
    d.mkdir(parents=True)
    per_seed = {}
    rows = []
    for seed, final in zip(SEEDS, FINAL[(algo, part)]):
        accs = _curve(final)
        rtt = next((r for r, a in enumerate(accs, 1) if a >= TARGET), None)
        per_seed[str(seed)] = {"final_acc": final, "best_acc": max(accs), "rounds_to_target": rtt,
                               "final_train_loss": 1.0 - final}
        for r, a in enumerate(accs, 1):
            rows.append({"seed": seed, "round": r, "train_loss": round(2.0 - a, 6), "lr": 0.05,
                         "num_clients": 10, "comm_up_floats": 100 * r, "comm_down_floats": 100 * r,
                         # round 2 not evaluated: empty test columns as the train stage writes them
                         "test_acc": "" if r == 2 else a, "test_loss": "" if r == 2 else 1 - a,
                         "round_time_s": 0.1})
    finals = FINAL[(algo, part)]
    rtts = [s["rounds_to_target"] for s in per_seed.values() if s["rounds_to_target"] is not None]
    metrics = {
        "experiment": name, "algorithm": ALGOS[algo], "stack": registry.described(ALGOS[algo]), "dataset": "digits",
        "partition": PARTS[part],
        "model": "small_cnn", "rounds": ROUNDS, "target_acc": TARGET, "seeds": SEEDS, "failed_seeds": [],
        "final_acc_mean": statistics.mean(finals), "final_acc_std": statistics.stdev(finals),
        "best_acc_mean": statistics.mean(finals), "best_acc_std": statistics.stdev(finals),
        "final_test_loss_mean": 0.5, "final_test_loss_std": 0.01,
        "final_train_loss_mean": statistics.mean(1 - f for f in finals),
        "final_train_loss_std": statistics.stdev([1 - f for f in finals]),
        "rounds_to_target_mean": statistics.mean(rtts) if rtts else None,
        "rounds_to_target_std": (statistics.stdev(rtts) if len(rtts) > 1 else 0.0) if rtts else None,
        "target_reached": len(rtts), "comm_up_floats": 400, "comm_down_floats": 400, "per_seed": per_seed,
        "model_d": 100, "up_floats_to_target_mean": 100.0 * statistics.mean(rtts) if rtts else None,
    }
    (d / "metrics.json").write_text(json.dumps(metrics))
    with open(d / "runs.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


@pytest.fixture
def tree(tmp_path):
    results = tmp_path / "results"
    for algo, part in FINAL:
        _write_experiment(results, algo, part)
    params = tmp_path / "params.yaml"
    params.write_text(PARAMS)
    return tmp_path, params, results


def _table(md: str, heading: str):
    """The rows (lists of cells) of the first table after ``heading``."""
    lines = md.split(heading, 1)[1].splitlines()
    rows = [ln for ln in lines if ln.startswith("|")]
    start = next(i for i, ln in enumerate(lines) if ln.startswith("|"))
    block = []
    for ln in lines[start:]:
        if not ln.startswith("|"):
            break
        block.append([c.strip() for c in ln.strip().strip("|").split("|")])
    assert rows
    return block[0], block[2:]


def test_labels():
    fedbug = Description("fedbug", [("P", 0.2)], Description("fedavg"))
    assert algorithm_label(fedbug) == algorithm_label(registry.described(fedbug)) == "FedBug P=0.2 (FedAvg)"
    assert algorithm_label("fedprox") == "FedProx"  # a bare registered name: its label
    # text without structure (results written before runs stored their stack) is not parsed: shown as it is
    assert algorithm_label("fedbug[P=0.2](fedavg)") == "fedbug[P=0.2](fedavg)"
    assert algorithm_label("odd thing(") == "odd thing("
    assert partition_label("digits-iid-n20-s0") == "IID"
    assert partition_label("digits-dirichlet-per_client-a0.3-n20-s0") == "Dirichlet α=0.3"
    assert partition_label("digits-dirichlet-per_client-a1e-05-n20-sgm0-s0") == "Dirichlet α=1e-05"
    assert partition_label("cifar100-shards-S20-n20-s0") == "Shards (20 classes/client)"
    assert partition_label("not-a-key") == "not-a-key"


def test_report(tree, capsys):
    root, params, results = tree
    before = sorted(p.relative_to(root) for p in root.rglob("*"))
    assert main(["--params", str(params), "--results", str(results)]) == 0
    after = sorted(p.relative_to(root) for p in root.rglob("*"))
    added = {Path("results/report.md"), Path("results/curves.png"), Path("results/curves.pdf"),
             Path("results/uplink.png"), Path("results/uplink.pdf"), Path("results/drift.png"), Path("results/drift.pdf"),
             Path("results/summary.csv"), Path("results/test_acc.csv"), Path("results/metrics.json")}
    assert set(after) - set(before) == added  # nothing else written, no temp files left
    md = (results / "report.md").read_text()

    # header line: experiments, seeds, dataset, rounds
    assert "5 experiment(s) (4 with results)" in md
    assert "seeds 1, 2" in md and "dataset digits" in md and "4 rounds" in md

    # Table 1
    header, rows = _table(md, "## All experiments")
    assert header[:3] == ["experiment", "algorithm", "partition"]
    by_name = {r[0].strip("`"): r for r in rows}
    assert list(by_name) == ["fedavg_iid", "fedbug_iid", "fedavg_dir", "fedbug_dir"]  # params order
    r = by_name["fedavg_iid"]
    assert r[1] == "FedAvg" and r[2] == "IID"
    assert r[3] == "85.00 ± 7.07"  # 0.80, 0.90
    assert r[5] == r[6] == "—"  # no per-client accuracy in these results
    assert r[7] == "4.0 ± 0.0 (1/2 seeds)"  # only seed 2 reaches 0.85 (at round 4)
    assert r[8] == "0.1500 ± 0.0707"
    assert r[9] == "4.0d" and by_name["fedavg_dir"][9] == "—"  # 400 floats at round 4 / d = 100
    assert by_name["fedbug_iid"][3] == "87.00 ± 1.41"  # 0.86, 0.88
    assert by_name["fedbug_iid"][7] == "4.0 ± 0.0 (2/2 seeds)"
    assert by_name["fedbug_dir"][1] == "FedBug P=0.2 (FedAvg)"
    assert by_name["fedbug_dir"][2] == "Dirichlet α=0.3"
    assert by_name["fedbug_dir"][3] == "72.00 ± 2.83"  # 0.70, 0.74
    assert by_name["fedavg_dir"][7] == "—"

    # each method against FedAvg on the same partition and seeds (pp): iid 0.86-0.80, 0.88-0.90 -> +6, -2
    header, rows = _table(md, "## Difference to FedAvg")
    assert header == ["algorithm", "partition", "vs FedAvg (pp)", "seeds", "95% CI (pp)"]
    # 95% CI: mean +- t(0.975, 1) * std / sqrt(2) = mean +- 12.7062 * std / 1.4142
    assert rows == [["FedBug P=0.2 (FedAvg)", "IID", "+2.00 ± 5.66", "2", "[-48.82, +52.82]"],
                    ["FedBug P=0.2 (FedAvg)", "Dirichlet α=0.3", "+7.00 ± 4.24", "2", "[-31.12, +45.12]"]]
    root_metrics = json.loads((results / "metrics.json").read_text())
    # DVC's metrics: headline numbers as fractions (d for the uplink), grouped by number then experiment; a group
    # no experiment has (worst10: no client accuracy in these results) and the values no seed reached are left out
    assert root_metrics == {
        "final": {"fedavg_iid": 0.85, "fedbug_iid": 0.87, "fedavg_dir": 0.65, "fedbug_dir": 0.72},
        "final_std": {"fedavg_iid": 0.0707, "fedbug_iid": 0.0141, "fedavg_dir": 0.0707, "fedbug_dir": 0.0283},
        "best": {"fedavg_iid": 0.85, "fedbug_iid": 0.87, "fedavg_dir": 0.65, "fedbug_dir": 0.72},
        "best_std": {"fedavg_iid": 0.0707, "fedbug_iid": 0.0141, "fedavg_dir": 0.0707, "fedbug_dir": 0.0283},
        "rounds_to_target": {"fedavg_iid": 4, "fedbug_iid": 4},
        "uplink_to_target": {"fedavg_iid": 4.0, "fedbug_iid": 4.0}}
    assert list(root_metrics["final"]) == ["fedavg_iid", "fedbug_iid", "fedavg_dir", "fedbug_dir"]  # grid order
    with open(results / "test_acc.csv", newline="") as f:
        acc = list(csv.DictReader(f))
    assert list(acc[0]) == ["round", "fedavg_iid", "fedbug_iid", "fedavg_dir", "fedbug_dir"]
    assert [a["round"] for a in acc] == ["1", "3", "4"]  # round 2 was not evaluated
    assert float(acc[-1]["fedavg_iid"]) == pytest.approx(0.85)  # fraction at the last round, mean over seeds

    # Table 2
    header, rows = _table(md, "## Comparison")
    assert header == ["algorithm", "IID", "Dirichlet α=0.3"]
    cells = {r[0]: r[1:] for r in rows}
    assert list(cells) == ["FedAvg", "FedBug P=0.2 (FedAvg)"]
    assert cells["FedAvg"] == ["85.00 ± 7.07", "65.00 ± 7.07"]
    assert cells["FedBug P=0.2 (FedAvg)"] == ["**87.00 ± 1.41**", "**72.00 ± 2.83**"]

    assert "![" in md and "](curves.png)" in md
    assert "[curves.pdf](curves.pdf)" in md  # the same figure for a draft
    assert "](uplink.png)" in md and "[uplink.pdf](uplink.pdf)" in md
    assert "](drift.png)" in md and "[drift.pdf](drift.pdf)" in md
    from pipeline.grid import load_grid
    from pipeline.results import load_experiments

    exps = {e.name: e for e in load_experiments(load_grid(params), results)}
    # comm_up_floats is cumulative in runs.csv: 100 r floats at round r, d = 100; round 2 was not evaluated
    assert list(exps["fedavg_iid"].curves["acc_up_d"]) == [1.0, 3.0, 4.0]
    assert "## How to read" in md and "sample standard deviation" in md
    missing = md.split("## Missing", 1)[1]
    assert "`fedprox_iid`" in missing

    png = (results / "curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert (results / "curves.pdf").read_bytes()[:5] == b"%PDF-"

    with open(results / "summary.csv", newline="") as f:
        summary = list(csv.DictReader(f))
    assert [s["experiment"] for s in summary] == ["fedavg_iid", "fedbug_iid", "fedavg_dir", "fedbug_dir"]
    s0 = summary[0]
    assert float(s0["final_acc_mean"]) == pytest.approx(0.85)
    assert float(s0["final_acc_std"]) == pytest.approx(0.0707107, abs=1e-6)
    assert s0["algorithm_label"] == "FedAvg" and s0["partition_label"] == "IID"
    assert s0["partition"] == PARTS["iid"] and s0["target_reached"] == "1"
    assert summary[2]["rounds_to_target_mean"] == ""  # never reached

    # --out elsewhere: the figure and csv go beside it, the link stays relative
    out = root / "elsewhere" / "r.md"
    assert main(["--params", str(params), "--results", str(results), "--out", str(out)]) == 0
    assert (out.parent / "curves.png").exists() and (out.parent / "summary.csv").exists()
    assert (out.parent / "curves.pdf").exists()
    assert "](curves.png)" in out.read_text()


def test_empty_results_exit_2(tree, capsys):
    root, params, _ = tree
    empty = root / "empty"
    empty.mkdir()
    assert main(["--params", str(params), "--results", str(empty)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: no results found under {empty.as_posix()}/ (run dvc repro)"
    assert list(empty.iterdir()) == []


def test_bad_params_exit_2(tmp_path, capsys):
    assert main(["--params", str(tmp_path / "nope.yaml"), "--results", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "\n" not in err


def test_fedbug_layout_table(tree, capsys):
    """The study's layout (studies/fedbug/layout.py) in the report of a grid that declares it, not in one that does
    not (tests/test_study_layouts.py: the rows and columns)."""
    tmp, params, results = tree
    assert main(["--params", str(params), "--results", str(results)]) == 0
    assert "FedBug layout" not in (results / "report.md").read_text()
    params.write_text(PARAMS + f"report: {{layouts: [{(ROOT / 'studies' / 'fedbug' / 'layout.py').as_posix()}]}}\n")
    assert main(["--params", str(params), "--results", str(results)]) == 0
    md = (results / "report.md").read_text()
    head, rows = _table(md, "### Dirichlet \u03b1=0.3")
    assert head == ["", "FedAvg"]
    assert [r[0] for r in rows] == ["Vanilla", "FedBug 20%"]
    # Dirichlet: vanilla 0.60/0.70 -> 65.00 +- 7.07; FedBug 0.70/0.74 -> 72.00 +- 2.83 (best, bold)
    assert rows[0][1] == "65.00 \u00b1 7.07" and rows[1][1] == "**72.00 \u00b1 2.83**"
    head, rows = _table(md, "### IID")
    assert rows[1][1] == "**87.00 \u00b1 1.41**"


def test_communication_layout_cells():
    from pipeline.report import communication_layout
    from pipeline.results import Experiment

    def exp(name, algo, up_per_round, acc, to_target):
        m = {"final_acc_mean": acc, "final_acc_std": 0.01, "comm_up_floats": 10 * up_per_round, "rounds": 10,
             "model_d": 1000, "target_acc": 0.9, "up_floats_to_target_mean": to_target}
        return Experiment(name, [], metrics=m, row_label=algo, col_label="Dir")

    exps = [exp("a", "FedAvg", 1000, 0.95, 4000.0), exp("b", "FedBCGD", 250, 0.96, 1500.0),
            exp("c", "SCAFFOLD", 2000, 0.80, None)]
    md = "\n".join(communication_layout(exps))
    assert "| FedAvg | 95.00 ± 1.00 (4.0d) |" in md
    assert "| FedBCGD | **96.00 ± 1.00** (1.5d) |" in md
    assert "| SCAFFOLD | 80.00 ± 1.00 (\u221e) |" in md  # never reached the target
    # equal uplink per round everywhere: no such table (rounds to target says it all)
    assert communication_layout([exp("a", "FedAvg", 1000, 0.95, 4000.0), exp("p", "FedProx", 1000, 0.9, 5000.0)]) == []


def test_partition_label_of_dirichlet_variant_b():
    from pipeline.labels import partition_label

    key = "cifar100-dirichlet-fixed_size_reuse-a0.6-n100-spc500-s0"
    assert partition_label(key) == "Dirichlet \u03b1=0.6 (500/client, reused)"


def test_atomic_writes_get_the_usual_permissions(tmp_path):
    import os

    from pipeline.files import write_text

    write_text(tmp_path / "a.txt", "x")
    (tmp_path / "b.txt").write_text("x")  # a plain write, for comparison
    assert os.stat(tmp_path / "a.txt").st_mode & 0o777 == os.stat(tmp_path / "b.txt").st_mode & 0o777
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left behind


def test_fedbcgd_plus_label():
    from pipeline.labels import algorithm_label

    desc = Description("qsgd", [("s", 16)], Description("fedbcgd_plus", [("", "code"), ("N", 3), ("lambda", 0.8)]))
    assert str(desc) == "qsgd[s=16](fedbcgd_plus[code,N=3,lambda=0.8])"
    assert algorithm_label(desc) == "QSGD s=16 (FedBCGD+ code, N=3, lambda=0.8)"


def test_dataset_variants_are_columns_of_their_own():
    """Each variant of a generated dataset is its own partition key, so its own column (FedProx's Synthetic(0,0)
    and (1,1) were one column before)."""
    from pipeline.figures import partition_title
    from pipeline.labels import dataset_label

    assert dataset_label("synthetic-a0.5-b0.5-n30-tf0.2-s0") == "Synthetic(0.5,0.5)"
    assert dataset_label("synthetic-iid-n30-tf0.2-s0") == "Synthetic IID"
    assert dataset_label("mnist1d-shuffled-s42") == "MNIST-1D shuffled"
    assert dataset_label("emnist-byclass") == "EMNIST byclass"
    assert dataset_label("digits") == "digits"
    keys = [f"synthetic-{v}-n30-tf0.2-s0-natural-n30" for v in ("a0-b0", "a1-b1", "iid")]
    assert [partition_label(k) for k in keys] == ["Synthetic(0,0), natural", "Synthetic(1,1), natural",
                                                  "Synthetic IID, natural"]
    assert partition_label(keys[0], verbose=True) == "Synthetic(0,0), natural (30 devices)"
    assert partition_title(keys[1]) == "Synthetic(1,1), natural, 30 devices"
    assert partition_label("mnist1d-shuffled-s42-iid-n1-sgm0-s0", verbose=True) == \
        "MNIST-1D shuffled: IID (1 client, seed 0)"


def test_a_report_folder_holding_foreign_files_is_refused(tree, capsys):
    """``--out`` into a folder of the user's (here one holding notes and a metrics.json of theirs): one line, exit 2,
    nothing written; the default folder (beside the experiments' folders) is the report's."""
    root, params, results = tree
    docs = root / "docs"
    docs.mkdir()
    (docs / "notes.md").write_text("mine")
    (docs / "metrics.json").write_text("{\"mine\": 1}")
    assert main(["--params", str(params), "--results", str(results), "--out", str(docs / "report.md")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "report folder" in err[0] and "notes.md" in err[0] and "nothing was changed" in err[0]
    assert sorted(p.name for p in docs.iterdir()) == ["metrics.json", "notes.md"]
    assert (docs / "metrics.json").read_text() == "{\"mine\": 1}"


def test_a_study_s_own_notes_beside_its_report_are_left_as_they_are(tree):
    """findings.md, findings_*.csv and fingerprint.json (a study's own files in its results folder, the last written
    by ``make study-refresh``) do not make the folder foreign: the report is written and they keep their bytes."""
    from pipeline import fingerprint

    _, params, results = tree
    notes = {"findings.md": "# what we found\n", "findings_recipe.csv": "a,b\n1,2\n", fingerprint.FILE: "{}\n"}
    for name, text in notes.items():
        (results / name).write_text(text)
    assert main(["--params", str(params), "--results", str(results)]) == 0
    assert (results / "report.md").exists()
    assert {n: (results / n).read_text() for n in notes} == notes


QUAD_PARAMS = """\
seeds: [1, 2]
dataset: {name: quadratic}
train: {rounds: 3}
experiments:
  fedavg_k5: {algorithm: fedavg}
  scaffold_k5: {algorithm: scaffold}
  feddyn_k5: {algorithm: feddyn}
"""
# ||x - x*|| per seed and round: FedAvg stops at its fixed point, SCAFFOLD and FedDyn reach x* (to float64 rounding)
QUAD = {"fedavg_k5": {1: [0.5, 0.2, 0.158], 2: [0.6, 0.2, 0.158]},
        "scaffold_k5": {1: [0.5, 1e-3, 1.6e-15], 2: [0.6, 1e-3, 1.5e-15]},
        "feddyn_k5": {1: [0.5, 1e-2, 1.9e-15], 2: [0.6, 1e-2, 1.8e-15]}}


def _quadratic_tree(root: Path) -> tuple:
    results = root / "results"
    algos = {"fedavg_k5": Description("fedavg"), "scaffold_k5": Description("scaffold"),
             "feddyn_k5": Description("feddyn")}
    for name, per_seed in QUAD.items():
        d = results / name
        d.mkdir(parents=True)
        rows = [{"seed": s, "round": r, "train_loss": 1.5, "test_acc": 0.0, "test_loss": 3.45,
                 "opt_distance": dist[r - 1], "objective_gap": dist[r - 1] ** 2 / 2, "comm_up_floats": 10 * r}
                for s, dist in per_seed.items() for r in (1, 2, 3)]
        metrics = {"experiment": name, "algorithm": algos[name], "stack": registry.described(algos[name]),
                   "dataset": "quadratic", "partition": "quadratic-n10-m10, natural", "model": "quadratic",
                   "rounds": 3, "target_acc": 0.9, "seeds": [1, 2], "failed_seeds": [], "final_acc_mean": 0.0,
                   "final_acc_std": 0.0, "best_acc_mean": 0.0, "best_acc_std": 0.0, "final_train_loss_mean": 1.5,
                   "final_train_loss_std": 0.0, "final_test_loss_mean": 3.45, "final_test_loss_std": 0.0,
                   "comm_up_floats": 30, "model_d": 10}
        (d / "metrics.json").write_text(json.dumps(metrics))
        with open(d / "runs.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    params = root / "params.yaml"
    params.write_text(QUAD_PARAMS)
    return params, results


def test_a_problem_with_a_known_optimum_reports_the_distance_to_it_not_an_accuracy_of_0(tmp_path):
    """The quadratic problem's model predicts no label (accuracy 0 in every round) and logs ||x - x*||: the tables
    show the final distance and gap (mean +- std over seeds, from runs.csv's last round), the rules that reached x*
    (below 1e-12) all in bold, and no accuracy, target or difference-to-FedAvg table."""
    params, results = _quadratic_tree(tmp_path)
    assert main(["--params", str(params), "--results", str(results)]) == 0
    md = (results / "report.md").read_text()
    head, rows = _table(md, "## All experiments")
    assert head[3:6] == ["final distance to x*", "final F(x) - F(x*)", "final train loss"]
    cells = {r[0].strip("`"): r for r in rows}
    assert cells["fedavg_k5"][3] == "0.158 \u00b1 0"
    assert cells["scaffold_k5"][3] == f"1.55e-15 \u00b1 {statistics.stdev([1.6e-15, 1.5e-15]):.2g}"
    assert cells["fedavg_k5"][4] == f"{0.158 ** 2 / 2:.4g} \u00b1 0"
    assert cells["fedavg_k5"][7] == "3d"  # 30 floats per client over the run, d = 10
    _, comp = _table(md, "## Comparison")
    bold = {r[0]: r[1].startswith("**") for r in comp}
    assert bold == {"FedAvg": False, "SCAFFOLD": True, "FedDyn": True}
    for gone in ("final acc", "## Difference to", "## Accuracy and uplink", "target accuracy", "rounds to target"):
        assert gone not in md
    assert "![Distance to the optimum and training loss per round](curves.png)" in md
    assert (results / "curves.png").stat().st_size > 0 and (results / "uplink.png").stat().st_size > 0


def test_a_grid_with_accuracy_keeps_the_accuracy_tables_even_when_it_logs_the_distance(tmp_path):
    """A convex problem whose model classifies (accuracy above 0) and logs ||x - x*|| stays an accuracy report."""
    from pipeline.report import objective_mode
    from pipeline.results import load_experiments
    from pipeline.grid import load_grid

    params, results = _quadratic_tree(tmp_path)
    m = json.loads((results / "fedavg_k5" / "metrics.json").read_text())
    exps = load_experiments(load_grid(params), results)
    assert objective_mode(exps)
    m["best_acc_mean"] = 0.6
    (results / "fedavg_k5" / "metrics.json").write_text(json.dumps(m))
    assert not objective_mode(load_experiments(load_grid(params), results))
    assert main(["--params", str(params), "--results", str(results)]) == 0
    assert "final acc (%)" in (results / "report.md").read_text()


def test_the_uplink_table_names_the_target_only_when_every_experiment_has_it(tree):
    """The uplink-to-target table's text gives the target accuracy when all experiments share it, and says it is
    each experiment's own when they differ (a study whose centralised rows aim at 90% and federated ones at 50%)."""
    from pipeline.grid import load_grid
    from pipeline.report import communication_layout
    from pipeline.results import load_experiments

    _, params, results = tree
    exps = [e for e in load_experiments(load_grid(params), results) if e.metrics is not None]
    exps[0].metrics["comm_up_floats"] = 800  # two uplinks per round: the table is shown
    text = "\n".join(communication_layout(exps))
    assert "first reached 85%" in text
    exps[1].metrics["target_acc"] = 0.5
    text = "\n".join(communication_layout(exps))
    assert "first reached the experiment's target accuracy (`train.target_acc`, which differs" in text
