"""make studies-status (pipeline/studies_status.py): the study folders, their recorded refresh times, one-line
errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline import studies_status as st


def test_every_study_folder_is_listed_and_an_unknown_one_is_refused_naming_the_known():
    names = [p.name for p in st.studies()]
    assert names == sorted(names) and {"fedbug", "fednlr", "noniid", "mnist1d", "synthetic"} <= set(names)
    assert all((st.STUDIES / n / "dvc.yaml").exists() for n in names)
    with pytest.raises(FileNotFoundError, match=r"study 'nosuch': no studies/nosuch/dvc.yaml \(studies: fedbcgd, "):
        st.studies(["nosuch"])
    assert st.main(["nosuch"]) == 2


def test_the_newest_refresh_row_of_a_study_counts(tmp_path):
    path = tmp_path / "refresh_times.csv"
    assert st.refresh_times(path) == {}
    path.write_text("study,wall_min,cpu_min,machine,date,commit\nfedbug,15.0,9.0,m,2026-11-26,aaa\n"
                    "fednlr,5.0,4.0,m,2026-11-26,aaa\nfedbug,7.5,6.0,m,2026-11-28,bbb\n")
    rows = st.refresh_times(path)
    assert (rows["fedbug"]["wall_min"], rows["fedbug"]["commit"]) == ("7.5", "bbb") and rows["fednlr"]["cpu_min"] == "4.0"
    header = st.REFRESH_TIMES.read_text().splitlines()[0]
    assert header == ",".join(st.REFRESH_COLUMNS)  # the committed file has the columns the reader expects


def test_a_refreshed_report_names_where_it_was_produced_and_dvc_keeps_it_up_to_date(tmp_path):
    import subprocess

    (tmp_path / "dvc.yaml").write_text("stages:\n  report:\n    cmd: mkdir -p results && printf '# Report\\n' > "
                                       "results/report.md\n    outs:\n      - results/report.md:\n"
                                       "          cache: false\n")
    dvc = st.dvc_command()
    subprocess.run([*dvc, "init", "--no-scm", "-q"], cwd=tmp_path, check=True)
    subprocess.run([*dvc, "repro", "-q"], cwd=tmp_path, check=True, capture_output=True)
    st.stamp_report(tmp_path, "machine X, commit abc1234")
    st.stamp_report(tmp_path, "machine Y, commit def5678")  # a later refresh replaces the line
    assert (tmp_path / "results" / "report.md").read_text() == \
        "> Produced on machine Y, commit def5678.\n\n# Report\n"
    status = subprocess.run([*dvc, "status"], cwd=tmp_path, check=True, capture_output=True, text=True).stdout
    assert "up to date" in status, status


def test_a_stage_whose_only_difference_is_what_git_does_not_hold_is_not_built_not_changed():
    """classify: absent outputs and data folders that git does not hold are rebuilt, nothing changed (a fresh clone);
    the code, a parameter, the command or a committed output make the stage changed."""
    held = {"results/report.md"}.__contains__
    absent_data = {"changed deps": {"data/prepared": "deleted"}}
    absent_outs = {"changed outs": {"results/a/runs.csv": "deleted", "results/a/models": "not in cache"}}
    assert st.classify([], held) is None
    assert st.classify([absent_data, absent_outs], held) == st.NOT_BUILT
    assert st.classify([{"changed deps": {"code/fl_core": "modified", "data/prepared": "deleted"}}], held) == st.CHANGED
    assert st.classify([{"changed deps": {"code/fl_core/new.py": "new"}}], held) == st.CHANGED
    assert st.classify([{"changed deps": {"params.yaml": {"experiments.a": "modified"}}}], held) == st.CHANGED
    assert st.classify([absent_data, "changed command"], held) == st.CHANGED
    assert st.classify(["always changed"], held) == st.CHANGED
    assert st.classify([{"changed outs": {"results/report.md": "deleted"}}], held) == st.CHANGED  # git holds it
    assert st.classify([{"changed outs": {"results/a/runs.csv": "modified"}}], held) == st.CHANGED


def test_git_files_holds_the_files_and_the_folders_above_them():
    held = st.git_files(st.STUDIES / "theory")
    assert held("results/report.md") and held("results") and held("params.yaml") and held("./results/report.md")
    assert not held("data/prepared") and not held("results/fedavg_k1/runs.csv")


def test_a_refresh_records_the_load_beside_the_machine(monkeypatch):
    monkeypatch.setattr(st.os, "getloadavg", lambda: (0.5, 1.0, 2.74))
    assert st.refresh_machine() == f"{st.procs.machine()}, load 2.7"

    def none():
        raise OSError("no load average")

    monkeypatch.setattr(st.os, "getloadavg", none)
    assert st.refresh_machine() == st.procs.machine()


def test_a_study_whose_dvc_lock_is_held_is_a_busy_row_not_an_error(tmp_path, monkeypatch, capsys):
    """While a refresh runs in a study, ``dvc status`` there fails on DVC's lock: that study's row says busy and
    the other studies are still listed (exit 0)."""
    import subprocess

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.setattr(st, "ROOT", tmp_path)
    monkeypatch.setattr(st, "studies", lambda names=None: [tmp_path / "a", tmp_path / "b"])
    monkeypatch.setattr(st, "stage_count", lambda folder: 3)
    monkeypatch.setattr(st, "git_files", lambda folder: (lambda path: True))
    monkeypatch.setattr(st, "refresh_times", lambda path=st.REFRESH_TIMES: {})
    monkeypatch.setattr(st, "needs_data", lambda folder: None)
    locked = ("ERROR: Unable to acquire lock. Most likely another DVC process is running or was terminated abruptly."
              " If there are no processes with such PIDs, you can manually remove '/x/.dvc/tmp/rwlock' and try again.")

    def run(cmd, cwd=None, **kw):
        if Path(cwd).name == "a":
            return subprocess.CompletedProcess(cmd, 255, "", locked)
        return subprocess.CompletedProcess(cmd, 0, "{}", "")

    monkeypatch.setattr(st.subprocess, "run", run)
    with pytest.raises(st.StudyBusy):
        st.stale_entries(tmp_path / "a")
    assert st.main(["a", "b"]) == 0
    rows = capsys.readouterr().out.strip().splitlines()[2:]
    assert rows[0].startswith("| a | 3 | busy: a DVC command runs here |")
    assert rows[1].startswith("| b | 3 | 0 | 0 | never measured |")
