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
