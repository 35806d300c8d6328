"""What an MLflow user gets from a run (fl_core/store/tracking.py, fl_core/store/mlflow_artifacts.py): seed-mean curves on
the parent, each seed's model as an MLflow model that loads and predicts as the saved state, the best child named
on the parent, and artifacts that a moved project folder still opens."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from fl_core.store import mlflow_artifacts
from fl_core.store.tracking import MODEL_NAME, TAG_BEST_CHILD, TAG_BEST_MODEL_URI, TAG_BEST_SEED, TAG_MODEL_FORMAT, Tracking

ROOT = Path(__file__).resolve().parent.parent
TINY = ["partition.num_clients=4", "train.rounds=3", "train.participation=1.0", "train.local_epochs=1",
        "train.batch_size=64", "engine.progress=false", "engine.checkpoint_every=0"]
CURVES = {"test_acc": "test/acc", "test_loss": "test/loss", "train_loss": "train/loss",
          "comm_up_floats": "comm/up_floats"}


@pytest.fixture
def tracking(tmp_path, monkeypatch, empty_store):
    shutil.copy(empty_store, tmp_path / "mlflow.db")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    return Tracking("fl-tracking", root=tmp_path)


def _model_of(cfg: dict, state: dict) -> torch.nn.Module:
    """The experiment's model (as the simulator builds it) holding ``state``, in eval mode."""
    from fl_core.config import compose
    from fl_core.data.access import dataset_for
    from fl_core.models import build_model

    c = compose([])
    ds = dataset_for(c, write_cache=False)
    model = build_model(c.model, cfg["dataset"]["name"], ds.input_shape, ds.num_classes, input_norm=(ds.mean, ds.std))
    model.load_state_dict(state)
    return model.eval(), ds


# ------------------------------------------------------------------------------------------ end to end


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """A project folder after ``run(TINY, seeds=(1, 2), write=True)`` with the default store (./mlflow.db, created
    by the run), and the run's result."""
    from pipeline.api import run

    proj = tmp_path_factory.mktemp("moved") / "proj"
    proj.mkdir()
    mp = pytest.MonkeyPatch()
    try:
        mp.chdir(proj)
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)  # the project's own store, as `make repro` uses it
        mp.setenv("DVC_EXP_NAME", "dense-grid")  # what `dvc exp run` exports to the stage
        result = run(TINY + ["name=exp"], seeds=(1, 2), write=True)
    finally:
        mp.undo()
    return proj, result


def _client(proj: Path):
    from mlflow.tracking import MlflowClient

    mlflow_artifacts.register()  # what the installed entry point does (pyproject.toml)
    client = MlflowClient(f"sqlite:///{proj / 'mlflow.db'}")
    exp = client.get_experiment_by_name("fl-pipeline")
    runs = client.search_runs([exp.experiment_id])
    parent = next(r for r in runs if r.data.tags.get("fl.role") == "parent")
    children = {int(r.data.tags["fl.seed"]): r for r in runs if "mlflow.parentRunId" in r.data.tags}
    return client, parent, children


def test_parent_holds_the_seed_mean_curves_per_round(project):
    proj, result = project
    client, parent, children = _client(proj)
    assert set(children) == {1, 2}
    hist = result.history
    for key, name in CURVES.items():
        got = {m.step: m.value for m in client.get_metric_history(parent.info.run_id, name)}
        assert sorted(got) == [1, 2, 3], name  # step = round, once each
        mean = hist.groupby("round")[key].mean()
        for r in (1, 2, 3):
            assert got[r] == pytest.approx(mean[r], rel=1e-9), (name, r)
    acc = [m.value for m in client.get_metric_history(parent.info.run_id, "test/acc")]
    assert all(0.0 <= a <= 1.0 for a in acc)  # a fraction
    up = [m.value for m in sorted(client.get_metric_history(parent.info.run_id, "comm/up_floats"), key=lambda m: m.step)]
    assert up == sorted(up) and up[0] > 0  # cumulative
    per_round = {n for n in parent.data.metrics if "/" in n}
    assert per_round == {"test/acc", "test/acc_std", "test/loss", "train/loss", "comm/up_floats", "comm/down_floats"}
    # the summary columns of the runs table stay
    assert parent.data.metrics["final_acc_mean"] == pytest.approx(result.summary["final_acc_mean"])
    # a child: every name in a section, none plain; few enough to browse
    names = set(children[1].data.metrics)
    per_round = {n for n in names if not n.startswith("summary_")}
    assert all(n.count("/") == 1 for n in per_round)
    assert {"test/acc", "test/loss", "train/loss", "comm/up_floats", "train/lr", "round/time_s"} <= per_round
    assert len(names) < 40


def test_runs_of_a_dvc_experiment_carry_its_name(project, monkeypatch):
    from fl_core.store.tracking import TAG_DVC_EXPERIMENT, dvc_experiment_tags, run_name

    proj, _ = project
    _, parent, children = _client(proj)
    assert parent.info.run_name == "exp [dense-grid]" and parent.data.tags[TAG_DVC_EXPERIMENT] == "dense-grid"
    for seed, child in children.items():
        assert child.info.run_name == f"exp/seed{seed} [dense-grid]"
        assert child.data.tags[TAG_DVC_EXPERIMENT] == "dense-grid"
    monkeypatch.delenv("DVC_EXP_NAME", raising=False)  # outside `dvc exp run`: no tag, the plain name
    assert dvc_experiment_tags() == {} and run_name("exp", dvc_experiment_tags()) == "exp"


def test_best_child_model_loads_and_predicts_as_the_saved_state(project):
    import mlflow

    proj, result = project
    client, parent, children = _client(proj)
    finals = {s: c.data.metrics["summary_final_acc"] for s, c in children.items()}
    assert finals == {s: pytest.approx(result.summary["per_seed"][str(s)]["final_acc"]) for s in (1, 2)}
    best = max(finals, key=lambda s: (finals[s], -s))
    assert parent.data.tags[TAG_BEST_SEED] == str(best)
    assert parent.data.tags[TAG_BEST_CHILD] == children[best].info.run_id
    assert parent.data.tags[TAG_BEST_MODEL_URI] == f"runs:/{children[best].info.run_id}/{MODEL_NAME}"
    mlflow.set_tracking_uri(f"sqlite:///{proj / 'mlflow.db'}")
    try:
        for seed, child in children.items():
            assert child.data.tags[TAG_MODEL_FORMAT] == "pt2"
            loaded = mlflow.pytorch.load_model(f"runs:/{child.info.run_id}/{MODEL_NAME}")
            state = torch.load(proj / "results" / "exp" / "models" / f"seed_{seed}.pt")
            model, ds = _model_of(result.config, state)
            x = ds.x_test[:50].float()
            with torch.no_grad():
                assert torch.allclose(loaded(x), model(x), atol=1e-5), seed
            assert torch.equal(torch.argmax(loaded(x), 1), torch.argmax(model(x), 1))
        # the documented one call
        best_model = mlflow.pytorch.load_model(client.get_run(parent.info.run_id).data.tags[TAG_BEST_MODEL_URI])
        model, ds = _model_of(result.config, torch.load(proj / "results" / "exp" / "models" / f"seed_{best}.pt"))
        with torch.no_grad():
            assert torch.allclose(best_model(ds.x_test[:8].float()), model(ds.x_test[:8].float()), atol=1e-5)
    finally:
        mlflow.set_tracking_uri(None)


def test_a_moved_project_folder_still_opens_its_artifacts_and_models(project, tmp_path, monkeypatch):
    import mlflow

    proj, result = project
    db_bytes = (proj / "mlflow.db").read_bytes()
    assert str(proj).encode() not in db_bytes  # no absolute location of the folder in the store
    assert b"file://" not in db_bytes
    moved = tmp_path / "elsewhere" / "copy"
    shutil.copytree(proj, moved)
    shutil.rmtree(proj / "mlartifacts")  # the original artifacts are gone: only the copy's can answer
    try:
        client, parent, children = _client(moved)
        child = children[1]
        assert {"config.yaml", "seed_1.csv", "partition"} <= {a.path for a in client.list_artifacts(child.info.run_id)}
        got = Path(client.download_artifacts(child.info.run_id, "config.yaml", str(tmp_path)))
        assert got.read_text() == (moved / "results" / "exp" / "config.yaml").read_text()
        assert "metrics.json" in {a.path for a in client.list_artifacts(parent.info.run_id)}
        monkeypatch.chdir(tmp_path)  # anywhere: the artifacts resolve against the store, not the working directory
        mlflow.set_tracking_uri(f"sqlite:///{moved / 'mlflow.db'}")
        loaded = mlflow.pytorch.load_model(parent.data.tags[TAG_BEST_MODEL_URI])
        seed = int(parent.data.tags[TAG_BEST_SEED])
        model, ds = _model_of(result.config, torch.load(moved / "results" / "exp" / "models" / f"seed_{seed}.pt"))
        with torch.no_grad():
            assert torch.allclose(loaded(ds.x_test[:8].float()), model(ds.x_test[:8].float()), atol=1e-5)
    finally:
        mlflow.set_tracking_uri(None)
        shutil.copytree(moved / "mlartifacts", proj / "mlartifacts")


# ------------------------------------------------------------------------------------------ pieces


def test_log_curves_skips_the_steps_the_run_holds(tracking):
    run_id = tracking.start_parent("curves", {})
    rows = [{"round": r, "test_acc": 0.1 * r, "comm_up_floats": 10.0 * r, "client_loss/0": 1.0} for r in (1, 2)]
    assert tracking.log_curves(run_id, rows) == 4  # the per-client key is left out
    more = [{"round": r, "test_acc": 0.5, "comm_up_floats": 10.0 * r} for r in (1, 2, 3)]  # a rerun after a kill
    assert tracking.log_curves(run_id, more) == 2
    acc = {m.step: m.value for m in tracking.client.get_metric_history(run_id, "test/acc")}
    assert acc == pytest.approx({1: 0.1, 2: 0.2, 3: 0.5})
    assert [m.step for m in tracking.client.get_metric_history(run_id, "test/acc")].count(1) == 1
    assert set(tracking.client.get_run(run_id).data.metrics) == {"test/acc", "comm/up_floats"}


def test_log_model_once_and_a_stale_model_is_replaced(tracking):
    import mlflow
    from mlflow.entities import LoggedModelStatus

    run_id = tracking.start_parent("model", {})
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 3)).eval()
    x = torch.randn(2, 1, 2, 2)
    uri = tracking.log_model(run_id, model, x)
    assert uri == f"runs:/{run_id}/model"
    assert tracking.log_model(run_id, model, x) == uri
    assert [m.status for m in tracking.logged_models(run_id)] == [LoggedModelStatus.READY]
    run = tracking.client.get_run(run_id)
    assert run.info.status == "RUNNING"  # its owner ends it
    assert os.environ["MLFLOW_TRACKING_URI"] == tracking.uri and mlflow.active_run() is None
    # a model left PENDING by a kill while it was logged is deleted and logged again
    other = tracking.client.create_run(tracking.experiment_id).info.run_id
    stale = tracking.client.create_logged_model(tracking.experiment_id, name=MODEL_NAME, source_run_id=other)
    assert tracking.model_uri(other) is None
    tracking.log_model(other, model, x)
    models = tracking.logged_models(other)
    assert [m.status for m in models] == [LoggedModelStatus.READY] and models[0].model_id != stale.model_id
    mlflow.set_tracking_uri(tracking.uri)
    try:
        loaded = mlflow.pytorch.load_model(f"runs:/{other}/model")
        xs = torch.randn(5, 1, 2, 2)  # another batch size: the batch dimension is free
        assert torch.allclose(loaded(xs), model(xs), atol=1e-6)
        sig = mlflow.models.get_model_info(f"runs:/{other}/model").signature
        assert tuple(sig.inputs.inputs[0].shape) == (-1, 1, 2, 2)
    finally:
        mlflow.set_tracking_uri(None)


class _DataDependent(torch.nn.Module):
    """A branch on a value: torch.export cannot trace it."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 2)

    def forward(self, x):
        return self.lin(x) if float(x.sum()) > 0 else -self.lin(x)


def test_a_model_torch_export_cannot_trace_is_pickled_with_a_warning(tracking, capsys, monkeypatch):
    import mlflow

    run_id = tracking.start_parent("pickled", {})
    model = _DataDependent().eval()
    tracking.log_model(run_id, model, torch.ones(2, 3))
    assert "warning: torch.export cannot trace _DataDependent" in capsys.readouterr().err
    assert tracking.client.get_run(run_id).data.tags[TAG_MODEL_FORMAT] == "pickle"
    assert len(tracking.logged_models(run_id)) == 1  # the failed pt2 attempt is gone
    monkeypatch.setenv("MLFLOW_ALLOW_PICKLE_DESERIALIZATION", "true")
    mlflow.set_tracking_uri(tracking.uri)
    try:
        loaded = mlflow.pytorch.load_model(f"runs:/{run_id}/model")
        x = -torch.ones(4, 3)
        assert torch.equal(loaded(x), model(x))
    finally:
        mlflow.set_tracking_uri(None)


def test_artifact_locations_are_relative_to_the_store(tracking, tmp_path):
    exp = tracking.client.get_experiment(tracking.experiment_id)
    assert exp.artifact_location == "mlflow-artifacts:/"
    assert tracking.client.get_experiment("0").artifact_location == "mlflow-artifacts:/0"  # MLflow's Default
    run_id = tracking.start_parent("arts", {})
    assert tracking.client.get_run(run_id).info.artifact_uri == f"mlflow-artifacts:/{run_id}/artifacts"
    f = tmp_path / "note.txt"
    f.write_text("hello")
    tracking.log_artifacts(run_id, [f], "sub")
    assert (tmp_path / "mlartifacts" / run_id / "artifacts" / "sub" / "note.txt").read_text() == "hello"


def test_the_local_destination_and_the_server_case(tmp_path, monkeypatch):
    from mlflow.store.artifact.local_artifact_repo import LocalArtifactRepository
    from mlflow.store.artifact.mlflow_artifacts_repo import MlflowArtifactsRepository

    monkeypatch.chdir(tmp_path)
    assert mlflow_artifacts.local_destination("sqlite:////srv/p/mlflow.db") == Path("/srv/p/mlartifacts")
    assert mlflow_artifacts.local_destination("sqlite:///mlflow.db?timeout=5") == tmp_path / "mlartifacts"
    assert mlflow_artifacts.local_destination("http://tracker:5000") is None
    assert mlflow_artifacts.local_destination("postgresql://u@h/mlflow") is None
    repo = mlflow_artifacts.artifact_repository("mlflow-artifacts:/abc/artifacts", "sqlite:////srv/p/mlflow.db")
    assert isinstance(repo, LocalArtifactRepository) and repo.artifact_dir == "/srv/p/mlartifacts/abc/artifacts"
    server = mlflow_artifacts.artifact_repository("mlflow-artifacts:/abc/artifacts", "http://tracker:5000")
    assert isinstance(server, MlflowArtifactsRepository)
    assert server.artifact_uri == "http://tracker:5000/api/2.0/mlflow-artifacts/artifacts/abc/artifacts"
    with pytest.raises(ValueError, match="leaves the store's mlartifacts/ folder"):
        mlflow_artifacts.artifact_repository("mlflow-artifacts:/../etc", "sqlite:////srv/p/mlflow.db")


def test_the_entry_point_names_the_repository_factory():
    """``pip install -e .`` registers the factory for every MLflow process of the environment (mlflow ui, a
    notebook that never imports fl_core)."""
    import importlib

    tomllib = pytest.importorskip("tomllib")
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    target = meta["project"]["entry-points"]["mlflow.artifact_repository"][mlflow_artifacts.SCHEME]
    module, _, attr = target.partition(":")
    assert getattr(importlib.import_module(module), attr) is mlflow_artifacts.artifact_repository


def test_input_example_is_numpy_of_the_model_inputs(project):
    """The logged input example is two training inputs as the model takes them ([2, 1, 8, 8] for digits)."""
    import json

    import mlflow
    from mlflow.models import get_model_info

    proj, _ = project
    client, parent, children = _client(proj)
    mlflow.set_tracking_uri(f"sqlite:///{proj / 'mlflow.db'}")
    try:
        info = get_model_info(f"runs:/{children[1].info.run_id}/model")
        assert tuple(info.signature.inputs.inputs[0].shape) == (-1, 1, 8, 8)
        assert tuple(info.signature.outputs.inputs[0].shape) == (-1, 10)
        path = mlflow.artifacts.download_artifacts(f"runs:/{children[1].info.run_id}/model/input_example.json")
        example = np.asarray(json.loads(Path(path).read_text()))
        assert example.shape == (2, 1, 8, 8) and np.isfinite(example).all()
    finally:
        mlflow.set_tracking_uri(None)


def test_the_screenshot_script_stops_in_one_line_without_chromium(tmp_path):
    import subprocess
    import sys

    out = tmp_path / "shot.png"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "ui_screenshot.py"), "--chromium",
                           str(tmp_path / "no-chromium"), "--out", str(out)], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: {tmp_path / 'no-chromium'} not found: install it (Debian: apt-get install -y chromium) or give "
        "--chromium PATH"]
    assert not out.exists()


# ------------------------------------------------------------------------------------------ the runs table


def test_the_runs_table_opens_on_the_headline_columns_every_run_holds(project, monkeypatch):
    """The experiment carries the saved view ``headline`` (MLflow 3's envelope, listed under the Runs tab's Saved
    views and opened by ``?viewStateShareKey=headline``): its columns are the final accuracy over seeds (parents),
    each seed's final accuracy (children), algorithm, partition, dataset and seed, and each names a metric or tag that
    a run of this project holds, so none is an empty column; ``make ui`` prints the address."""
    import json

    from fl_core.store.tracking import HEADLINE_COLUMNS, NOTE, TAG_NOTE, TAG_SHARED_VIEW, headline_url

    proj, _ = project
    client, parent, children = _client(proj)
    exp = client.get_experiment_by_name("fl-pipeline")
    envelope = json.loads(exp.tags[TAG_SHARED_VIEW + "headline"])
    assert envelope["name"] == "headline" and envelope["createdAt"] > 0
    state = json.loads(envelope["state"])
    assert state["selectedColumns"] == list(HEADLINE_COLUMNS)
    assert state["orderByKey"] == "metrics.`final_acc_mean`" and state["orderByAsc"] is False
    runs = [parent, *children.values()]
    for col in HEADLINE_COLUMNS:
        kind, name = col.split(".", 1)
        name = name.strip("`")
        held = [r for r in runs if name in (r.data.metrics if kind == "metrics" else r.data.tags)]
        assert held, col
    assert exp.tags[TAG_NOTE] == NOTE
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert headline_url("fl-pipeline", root=proj) == \
        f"http://127.0.0.1:5000/#/experiments/{exp.experiment_id}/runs?viewStateShareKey=headline"
    assert headline_url("no-such-experiment", root=proj) is None


def test_an_older_experiment_gets_the_headline_view_and_keeps_its_own_description(tracking):
    import json

    from mlflow.tracking import MlflowClient

    from fl_core.store.tracking import HEADLINE_STATE, TAG_NOTE, TAG_SHARED_VIEW, Tracking

    client = MlflowClient(tracking.uri)
    old = client.create_experiment("older", tags={TAG_NOTE: "my notes",
                                                 TAG_SHARED_VIEW + "headline": json.dumps({"name": "headline",
                                                                                           "state": "{}"})})
    Tracking("older", root=tracking.root)
    tags = client.get_experiment(old).tags
    assert tags[TAG_NOTE] == "my notes"
    assert json.loads(json.loads(tags[TAG_SHARED_VIEW + "headline"])["state"]) == HEADLINE_STATE
    before = tags[TAG_SHARED_VIEW + "headline"]
    Tracking("older", root=tracking.root)  # already the project's view: left as it is
    assert client.get_experiment(old).tags[TAG_SHARED_VIEW + "headline"] == before
