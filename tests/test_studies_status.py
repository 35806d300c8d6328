"""make studies-status (pipeline/studies_status.py): the study folders, their recorded refresh times, one-line
errors."""

from __future__ import annotations

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
