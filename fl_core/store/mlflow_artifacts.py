"""Artifacts of a SQLite MLflow store, kept relative to the store: ``mlflow-artifacts:/`` beside ``mlflow.db``.

An MLflow experiment records where its artifacts live, and every run and logged model copies that
location into the database when it is created. A local path there is absolute (MLflow resolves it on
``create_experiment``), so a project folder that is moved or copied would point at the old folder. The
project's experiments therefore use MLflow's proxied-artifact location ``mlflow-artifacts:/`` (the one
``mlflow server`` gives its experiments): the database holds ``mlflow-artifacts:/<run_id>/artifacts`` and
``mlflow-artifacts:/models/<model_id>/artifacts``, with no folder in them, and

- ``mlflow ui --backend-store-uri sqlite:///<project>/mlflow.db --artifacts-destination <project>/mlartifacts``
  (``make ui``) serves them from that folder, as MLflow's tracking server does;
- in a Python process whose tracking URI is that SQLite file, :func:`artifact_repository` (registered for
  the scheme ``mlflow-artifacts`` through the ``mlflow.artifact_repository`` entry point in
  ``pyproject.toml``, and by :mod:`fl_core.store.tracking` on import) reads and writes
  ``<folder of the .db file>/mlartifacts/<path>`` directly, so ``MlflowClient.log_artifact``,
  ``mlflow.pytorch.log_model`` and ``mlflow.pytorch.load_model("runs:/<run_id>/model")`` work without a
  server. MLflow's own repository for the scheme cannot serve that case (it needs an ``http(s)`` tracking
  URI); every other case (a server's tracking URI, a URI that names a host) goes to it unchanged.

This module imports nothing of the project: MLflow may load it while its artifact registry is being built.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional
from urllib.parse import unquote, urlparse

SCHEME = "mlflow-artifacts"
#: the experiment artifact location of a project's SQLite store
LOCATION = f"{SCHEME}:/"
#: the folder beside ``mlflow.db`` that holds its artifacts (also ``mlflow server``'s default destination)
FOLDER = "mlartifacts"
_SQLITE = "sqlite:///"


def local_destination(tracking_uri: Optional[str]) -> Optional[Path]:
    """``<folder of the .db file>/mlartifacts`` for a SQLite file tracking URI (a relative file: against the
    working directory, as SQLite opens it), else None."""
    if not tracking_uri or not tracking_uri.startswith(_SQLITE):
        return None
    db = Path(unquote(tracking_uri[len(_SQLITE):].split("?", 1)[0]))
    if not db.is_absolute():
        db = Path.cwd() / db
    return db.parent / FOLDER


def artifact_repository(artifact_uri: str, tracking_uri: Optional[str] = None, registry_uri: Optional[str] = None):
    """The artifact repository of an ``mlflow-artifacts:`` URI (MLflow's artifact-repository factory signature).

    Args:
        artifact_uri: ``mlflow-artifacts:/<path>`` (a run's ``.../artifacts`` or a logged model's).
        tracking_uri: the tracking URI of the caller; None: MLflow's current one (``mlflow.get_tracking_uri``).
        registry_uri: passed on.

    Returns:
        A ``LocalArtifactRepository`` over ``<folder of the .db>/mlartifacts/<path>`` when the tracking URI is a
        SQLite file and the URI names no host; else MLflow's ``MlflowArtifactsRepository`` (a tracking server).
    """
    from mlflow.store.artifact.local_artifact_repo import LocalArtifactRepository
    from mlflow.store.artifact.mlflow_artifacts_repo import MlflowArtifactsRepository

    parsed = urlparse(artifact_uri)
    if not parsed.netloc:
        import mlflow

        dest = local_destination(tracking_uri or mlflow.get_tracking_uri())
        if dest is not None:
            path = unquote(parsed.path).lstrip("/")
            if any(part == ".." for part in Path(path).parts):
                raise ValueError(f"artifact URI {artifact_uri!r} leaves the store's {FOLDER}/ folder")
            return LocalArtifactRepository(str(dest / path), tracking_uri=tracking_uri, registry_uri=registry_uri)
    return MlflowArtifactsRepository(artifact_uri, tracking_uri=tracking_uri, registry_uri=registry_uri)


def register() -> None:
    """Make :func:`artifact_repository` MLflow's repository for ``mlflow-artifacts:`` in this process (what the
    entry point does where the project is installed; idempotent)."""
    from mlflow.store.artifact.artifact_repository_registry import _artifact_repository_registry

    if _artifact_repository_registry.get_registered_artifact_repositories().get(SCHEME) is not artifact_repository:
        _artifact_repository_registry.register(SCHEME, artifact_repository)
