"""Secrets never leave memory (issue 32): every storage or tracking URI a message, a log line, an MLflow tag or a
summary shows goes through :func:`fl_core.store.storefail.mask`, and error messages that may quote one through
:func:`fl_core.store.storefail.redact`; tune.py's command-line errors are one line (exit 2); its progress bars are drawn
on a terminal only (:mod:`fl_core.progress`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from fl_core.store import storefail
from fl_core.store.storefail import mask, redact

ROOT = Path(__file__).resolve().parent.parent
TUNE = ROOT / "sweeps" / "tune.py"


def _hidden(shown: str, *pieces: str) -> bool:
    return not any(p in shown for p in pieces)


# --------------------------------------------------------------------------- mask: how a URI is shown


@pytest.mark.parametrize("url,shown,secret", [
    ("postgresql+psycopg://u:pw@127.0.0.1:5432/optuna", "postgresql+psycopg://u:***@127.0.0.1:5432/optuna", ["pw"]),
    ("postgresql+psycopg://u@127.0.0.1:1/x?password=S3cret", "postgresql+psycopg://u@127.0.0.1:1/x?password=***",
     ["S3c"]),
    ("postgresql://u@h/db?sslmode=require&PassWord=S3cret", "postgresql://u@h/db?PassWord=***&sslmode=require",
     ["S3c"]),
    ("postgresql://u:pw@h/db?passwd=a1&pwd=b2&secret=c3&token=d4",
     "postgresql://u:***@h/db?passwd=***&pwd=***&secret=***&token=***", ["pw@", "a1", "b2", "c3", "d4"]),
    ("postgresql+psycopg://u:S3c%2Fret@127.0.0.1:1/x", "postgresql+psycopg://u:***@127.0.0.1:1/x", ["S3c", "ret"]),
    ("postgresql+psycopg://u:S3c/ret@127.0.0.1:1/x", "postgresql+psycopg://u:***@127.0.0.1:1/x",
     ["S3c", "ret"]),  # a raw "/": urllib would take "S3c" for the host
    ("postgresql://u:p@ss@h/db", "postgresql://u:***@h/db", ["p@", "ss"]),  # a raw "@": SQLAlchemy's host: "ss@h"
    ("postgresql://u:a@b/c@h/db", "postgresql://u:***@h/db", ["a@", "b/", "c@"]),  # both
    ("postgresql://u:p@ss:word@h/db", "postgresql://u:***@h/db", ["p@", "ss", "word"]),  # SQLAlchemy: port "word@h"
    ("postgresql://u:p?ss#x@h/db", "postgresql://u:***@h/db", ["p?", "ss", "x"]),
    ("mysql+pymysql://u:pw@h/db?charset=utf8", "mysql+pymysql://u:***@h/db?charset=utf8", ["pw"]),
    ("http://user:pw@127.0.0.1:5000", "http://user:***@127.0.0.1:5000", ["pw"]),
    ("https://mlflow.example.org/?token=S3cret&x=1", "https://mlflow.example.org/?token=***&x=1", ["S3c"]),
    ("http://u:S3c/ret@h:5000/path?Access_Token=T0ken", "http://u:***@h:5000/path?Access_Token=***",
     ["S3c", "ret", "T0k"]),
])
def test_mask_hides_every_form_of_a_password(url, shown, secret):
    got = mask(url)
    assert got == shown
    assert _hidden(got, *secret)


@pytest.mark.parametrize("url", [
    "sqlite:////tmp/studies/x.db", "sqlite:///:memory:", "sqlite:///rel/a@b.db", "postgresql+psycopg://u@h:5432/db",
    "postgresql://h/db?sslmode=require&connect_timeout=10", "http://127.0.0.1:5000", "nosuchdialect://host/db",
])
def test_a_uri_without_secrets_is_shown_as_written(url):
    assert mask(url) == url


@pytest.mark.parametrize("path", ["sweeps/studies/lr.log", "/abs/path/with:colon@and.log", "s.log"])
def test_a_journal_path_is_unchanged(path):
    assert mask(path) == path


@pytest.mark.parametrize("url,shown", [
    ("postgresql://u:S3cret@h:notaport/db", "postgresql://***"),  # SQLAlchemy raises on the port
    ("postgresql://u:S3cret@[bad", "postgresql://***"),  # an unclosed [IPv6] host
    ("postgresql://u:S3cret@h1:5432,h2:5432/db", "postgresql://***"),
    ("http://u:S3cret@[bad", "http://***"),
])
def test_an_unparseable_uri_shows_only_its_scheme(url, shown):
    assert mask(url) == shown


def test_mask_imports_no_sqlalchemy_at_module_load():
    code = "import sys; import fl_core.store.storefail; print('sqlalchemy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    assert out.strip() == "False"


def test_the_sweeps_show_the_storage_through_mask():
    from sweeps.storage import shown_storage

    url = "postgresql+psycopg://u:S3c/ret@127.0.0.1:1/x"
    assert shown_storage(url) == mask(url) == "postgresql+psycopg://u:***@127.0.0.1:1/x"


def test_the_identity_of_a_store_ignores_a_raw_password():
    """A failure names its store masked; it must still be recognised as the same store as the raw URL."""
    for url in ("postgresql+psycopg://u:S3c/ret@127.0.0.1:1/x", "postgresql://u:p@ss@h/db"):
        assert storefail.identity(mask(url)) == storefail.identity(url)
    assert storefail.identity("postgresql+psycopg://u:S3c/ret@127.0.0.1:1/x") == "postgresql://127.0.0.1:1/x"


# --------------------------------------------------------------------------- redact: messages that quote a URL


def test_redact_removes_the_url_and_the_password_pieces_from_a_message():
    url = "postgresql+psycopg://u:p@ss:word@127.0.0.1:1/x"
    text = (f"failed to resolve host 'ss:word@127.0.0.1' for {url}; invalid literal for int() with base 10: "
            "'word@127.0.0.1:1'")
    got = redact(text, url)
    assert _hidden(got, "p@ss", "ss:", "word"), got
    assert "postgresql+psycopg://u:***@127.0.0.1:1/x" in got
    url = "postgresql://u@h/db?password=S3cret"
    assert redact("connect(password='S3cret') failed", url) == "connect(password='***') failed"
    assert redact("nothing here", "postgresql://u:ab@h/db") == "nothing here"  # short secrets: whole words only
    assert redact("user ab refused", "postgresql://u:ab@h/db") == "user *** refused"
    assert redact("a journal error", "sweeps/studies/x.log", None) == "a journal error"


def test_the_failure_of_a_database_does_not_quote_its_password():
    """storefail's PostgreSQL failure: the driver's message is redacted (here it quotes the password)."""
    url = "postgresql+psycopg://u:S3cret@127.0.0.1:1/x"
    orig = type("OperationalError", (Exception,), {"__module__": "psycopg"})("connection refused for S3cret")
    failure = storefail._pg_failure(url, orig)
    assert "S3cret" not in str(failure) and failure.store == "postgresql+psycopg://u:***@127.0.0.1:1/x"
    stalled = storefail.stalled(url, 30, f"no answer from {url}")
    assert "S3cret" not in str(stalled) and "u:***@127.0.0.1" in str(stalled)


def test_a_storage_error_does_not_quote_the_password():
    from sweeps.storage import storage_error

    url = "postgresql://u:S3c/ret@h/db"
    err = storage_error(url, ValueError(f"cannot parse {url!r}; host 'ret@h'"))
    assert _hidden(str(err), "S3c", "ret"), str(err)
    assert str(err).startswith("--storage postgresql://u:***@h/db: cannot open the storage (ValueError: ")


# --------------------------------------------------------------------------- tune.py end to end


@pytest.mark.parametrize("storage,secret", [
    ("postgresql+psycopg://u:S3c/ret@127.0.0.1:1/x", ("S3c", "ret")),
    pytest.param("postgresql+psycopg://u@127.0.0.1:1/x?password=S3cret", ("S3cret",), marks=pytest.mark.slow),
    pytest.param("postgresql+psycopg://u:p@ss@127.0.0.1:1/x", ("p@ss", "ss@"), marks=pytest.mark.slow),
])
def test_tune_never_prints_the_password_of_its_storage(tmp_path, storage, secret):
    """Port 1: nothing listens, the storage fails at once: one line, exit status 2 (docs/sweeps.md), no password."""
    res = subprocess.run([sys.executable, str(TUNE), "--space", "lr", "--n-trials", "1", "--no-mlflow",
                          "--out", str(tmp_path / "out"), "--storage", storage],
                         capture_output=True, text=True, cwd=tmp_path, timeout=120, check=False)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --storage postgresql+psycopg://u"), res.stderr
    assert _hidden(res.stdout + res.stderr, *secret), res.stderr
    assert "***" in lines[0]
    assert not (tmp_path / "out").exists()


def _settings(storage: str):
    from sweeps.settings import Settings

    return Settings(space="lr", overrides=[], seeds=[1], objectives=["acc"], study_name="s", storage=storage,
                    experiment="e", parent_run_id="r1")


def test_summary_json_and_the_mlflow_tag_show_the_storage_masked():
    from sweeps import outputs

    storage = "postgresql+psycopg://u:S3c/ret@127.0.0.1:1/x?password=S3cret"
    settings = _settings(storage)
    space = SimpleNamespace(name="lr", path=Path("sweeps/spaces/lr.yaml"), conditional={})
    study = SimpleNamespace(trials=[], user_attrs={"mlflow_parent_run_id": "r1"})
    summary = json.dumps(outputs.summarize(study, settings, space, None, None, 1.0, "finished"))
    assert "u:***@127.0.0.1:1/x?password=***" in summary and _hidden(summary, "S3c", "ret", "S3cret")

    tags = {}
    client = SimpleNamespace(get_run=lambda run_id: SimpleNamespace(data=SimpleNamespace(tags={})),
                             update_run=lambda run_id, status: None, delete_tag=lambda run_id, key: None,
                             set_tag=lambda run_id, key, value: tags.__setitem__(key, value))
    assert outputs.ensure_parent_run(study, settings, space, SimpleNamespace(client=client)) == "r1"
    assert tags["storage"] == "postgresql+psycopg://u:***@127.0.0.1:1/x?password=***"
    assert _hidden(json.dumps(tags), "S3c", "ret", "S3cret")


def test_mlflow_does_not_print_a_tracking_uri_that_holds_a_password(monkeypatch):
    """MLflow prints "View run <name> at: <tracking URI>/#/..." on stdout as a run of a tracking server ends: off
    when the URI holds a password or a token, as before otherwise."""
    from fl_core.store import storewait
    from fl_core.store.tracking import bounded_uri

    for key in (*storewait.HTTP_DEFAULTS, "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"):
        monkeypatch.setenv(key, "x")  # restored after the test
        monkeypatch.delenv(key)
    assert bounded_uri("http://127.0.0.1:5000") == "http://127.0.0.1:5000"
    assert "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT" not in os.environ
    for uri in ("http://user:S3cret@127.0.0.1:5000", "https://mlflow.example.org/?token=S3cret"):
        monkeypatch.delenv("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", raising=False)
        assert bounded_uri(uri) == uri
        assert os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] == "true"
