"""What an experiment publishes, once per (name, config, seed): its files (``config.yaml``, the partition's statistics,
each seed's ``details/`` and ``models/``, ``runs.csv``, ``rounds.csv``, the curves, ``metrics.json`` and
``experiment.json``, written to the run's staging folder and published with it) and its MLflow runs (a child run per
seed with every round, its summary, artifacts and final model; the parent with the params, the summary over seeds,
the seed-mean curves and the best child). :class:`Publishing` does it for the run that owns the experiment
(:mod:`pipeline.observer`); the functions are the files' formats."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import TYPE_CHECKING, Dict, List, Optional

from fl_core.config import to_container
from fl_core.metrics import mean_std, summarize_seeds
from fl_core.store import faults
from fl_core.store.runstore import EXPERIMENT_FILE, METRICS_FILE, split_summary
from fl_core.store.tracking import TAG_EXPERIMENT, TAG_FINGERPRINT, TAG_SEED, resumable, run_params

from .files import atomic_write, write_json, write_text

if TYPE_CHECKING:  # annotations only: a run imports torch where it trains
    import torch


def _csv(rows: List[Dict], columns: List[str]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: r.get(k, "") for k in columns})
    return buf.getvalue()


TIMING_KEYS = ("round_time_s",)  # wall-clock measurements: differ between identical runs
TIMES_FILE = "round_times.csv"  # details/round_times.csv: every seed's TIMING_KEYS per round (.dvcignore'd)


def _without_timing(rows: List[Dict]) -> List[Dict]:
    """History rows without the wall-clock columns (:data:`TIMING_KEYS`): what the files DVC and git keep hold."""
    return [{k: v for k, v in row.items() if k not in TIMING_KEYS} for row in rows]


def _save_tensors(state: Dict, path: Path) -> None:
    """``torch.save`` through an open file: the archive's inner folder is then always ``archive/`` (given a path,
    torch names it after the file, here a random temporary name), so the same model gives the same bytes."""
    import torch

    with open(path, "wb") as f:
        torch.save(state, f)


OBJECTIVE_KEYS = ("objective", "objective_gap", "opt_distance")  # a model's objective_metrics (logreg_binary)


def mean_curve(histories: Dict[int, List[Dict]]) -> List[Dict]:
    """Per-round mean (and std of test_acc) over seeds; rounds without evaluation keep train columns."""
    rows = []
    by_round: Dict[int, List[Dict]] = {}
    for hist in histories.values():
        for row in hist:
            by_round.setdefault(int(row["round"]), []).append(row)
    for r in sorted(by_round):
        group = by_round[r]
        out: Dict = {"round": r}
        for k in ("test_acc", "test_loss", "train_loss", "client_acc_mean", "client_acc_std", "client_acc_worst10",
                  "comm_up_floats", "comm_down_floats", *OBJECTIVE_KEYS):
            vals = [g[k] for g in group if k in g]
            if vals:
                ms = mean_std(vals)
                out[k] = ms["mean"]
                if k == "test_acc":
                    out["test_acc_std"] = ms["std"]
        rows.append(out)
    return rows


def write_schedule(sim, part, cfg, out_dir: Path) -> List[Path]:
    """What the algorithm does over local steps (FedBug: trainable units per step), as CSV, PNG and PDF.

    Written for the clients' distinct step counts K_i; nothing for algorithms without a schedule."""
    from fl_core.engine.executors import client_steps

    from .figures import schedule_figure

    steps = [client_steps(int(n), cfg.train.batch_size, cfg.train.local_epochs, cfg.train.local_steps)
             for n in part.sizes]
    rows = sim.algo.schedule_rows(steps)
    if not rows:
        return []
    csv_path, png_path = out_dir / "details" / "schedule.csv", out_dir / "details" / "schedule.png"
    write_text(csv_path, _csv(rows, list(rows[0])))
    return [csv_path] + schedule_figure(rows, f"{sim.algo.describe()}: units trainable per local step", png_path)


def _history_columns(rows: List[Dict]) -> List[str]:
    cols: List[str] = []
    for r in rows:
        for k in r:
            if k not in cols:
                cols.append(k)
    return cols


def _experiment_summary(name, cfg, algo_desc, pkey, model_name, summaries, failures, model_d=None) -> Dict:
    from fl_core.algorithms import registry

    # the description's text and its structure with the registry's labels (what the report's labels read)
    out: Dict = {"experiment": name, "algorithm": algo_desc, "stack": registry.described(algo_desc),
                 "dataset": cfg.dataset.name, "partition": pkey,
                 "model": model_name, "model_d": model_d, "rounds": int(cfg.train.rounds),
                 "target_acc": float(cfg.train.target_acc), "final_window": int(cfg.train.final_window)}
    seeds = summarize_seeds(summaries, failures)
    per_seed = seeds.pop("per_seed")
    out.update(seeds)
    if summaries:
        any_s = next(iter(summaries.values()))
        out["comm_up_floats"] = any_s["comm_up_floats"]
        out["comm_down_floats"] = any_s["comm_down_floats"]
    out["per_seed"] = per_seed
    return out


class Publishing:
    """The files and MLflow runs of an experiment, for the run that owns them (:class:`pipeline.observer.ExperimentRun`
    mixes it in and gives it its state: ``cfg0``, ``name``, ``store``, ``tracking``, ``parent_id``, ``tags``, ``records``,
    the experiment's probe simulator, data and partition). Each seed is published once, as soon as it has its completion
    record (:meth:`_publish_seed`); the experiment's own files and parent run when every seed has one
    (:meth:`_write_outputs`, :meth:`_end_parent`). Every method is safe to run again after a kill: a child or parent
    run that holds a step already keeps it (docs/reliability.md)."""

    def _write_description(self, staging: Path) -> None:
        """config.yaml and the partition's statistics and plot (the files that describe the experiment)."""
        import yaml

        from fl_core.data.partition import plot_label_distribution

        container = to_container(self.cfg0)
        container.pop("seed")
        write_text(staging / "config.yaml", yaml.safe_dump({**container, "name": self.name, "seeds": self.seeds,
                                                           "effective_update_u": self.u}, sort_keys=False))
        write_json(staging / "partition" / "stats.json", self.part.stats())
        if self.adhoc:  # git ignores the folder (a grid experiment's small outputs are tracked instead)
            write_text(staging / ".gitignore", "# results of a run outside the grid (fl-train / the API): not "
                       "tracked by git\n*\n")
        plot_label_distribution(self.part, staging / "partition" / "labels_per_client.png", title=self.pkey)

    def inputs(self) -> List[Dict[str, str]]:
        """The dataset and the partition as MLflow inputs (name, content digest, source)."""
        if self._inputs is None:
            self._inputs = self._describe_inputs()
        return self._inputs

    def _describe_inputs(self) -> List[Dict[str, str]]:
        import hashlib

        import numpy as np

        from fl_core.data import describe_source

        ds, part = self.ds, self.part
        h = hashlib.sha256(ds.y_train.numpy().tobytes())
        h.update(repr(tuple(ds.input_shape)).encode())
        if ds.provenance:  # generated data: the generator's arguments (mnist1d's shuffled control keeps the labels)
            h.update(json.dumps(ds.provenance, sort_keys=True).encode())
        p = hashlib.sha256()
        for ix in part.client_indices:
            p.update(np.asarray(ix, dtype=np.int64).tobytes())
            p.update(b"|")
        split = "validation" if self.cfg0.dataset.validation_fraction > 0 else "test"
        return [{"name": self.cfg0.dataset.name, "digest": h.hexdigest()[:16], "context": "training",
                 "source": f"{describe_source(self.cfg0.dataset)} (evaluation: {split} split)"},
                {"name": self.pkey, "digest": p.hexdigest()[:16], "context": "partition",
                 "source": f"partition={self.cfg0.partition.name} over {part.num_clients} clients"}]

    def _publish_seed(self, cfg, rec: Dict, logger) -> None:
        """The files of a seed with a completion record and its MLflow child run brought to its end."""
        seed = int(cfg.seed)
        files = self._write_seed_files(seed, rec, self._staging)
        if self.tracking is not None:
            self._finish_child(cfg, seed, rec, logger, files + self._schedule_files)
        self._live_loggers.pop(seed, None)
        faults.point("after_child_finished")

    def _child_logger(self, cfg, seed: int):
        derived = {f"model.{k}": v for k, v in self.probe.model.problem_params().items()} \
            if hasattr(self.probe.model, "problem_params") else {}  # constants the model took from the data
        params = {**run_params(to_container(cfg)), "model.resolved": self.model_name, "model.d": self.model_d, **derived,
                  "algorithm.describe": self.algo_desc, "effective_update_u": self.u}
        tags = {**self.tags, "seed": str(seed), TAG_SEED: str(seed), TAG_EXPERIMENT: self.name,
                TAG_FINGERPRINT: self.store.fingerprint}
        return self.tracking.child_logger(self.parent_id, f"{self.name}/seed{seed}", tags, params,
                                          cfg.tracking.log_every, cfg.tracking.detail_metrics)

    def _write_seed_files(self, seed: int, rec: Dict, staging: Path) -> List[Path]:
        """details/seed_<s>.csv and .png, and models/seed_<s>.pt for a seed that finished."""
        from .figures import experiment_figure, readable_title

        hist = _without_timing(rec["history"])
        seed_csv, seed_png = staging / "details" / f"seed_{seed}.csv", staging / "details" / f"seed_{seed}.png"
        write_text(seed_csv, _csv(hist, _history_columns(hist)))
        files = [seed_csv] + experiment_figure(
            {seed: hist}, readable_title(self.name, self.algo_desc, self.pkey, seed=seed,
                                         failed=rec["status"] != "ok"), seed_png)
        if rec["status"] == "ok":
            model_path = staging / "models" / f"seed_{seed}.pt"
            atomic_write(model_path, lambda p: _save_tensors(rec["state_dict"], p))
        return files

    def _finish_child(self, cfg, seed: int, rec: Dict, logger, files: List[Path]) -> None:
        """Bring the seed's MLflow child run to its end state, once: every round, the summary, the
        artifacts, the final model (``tracking.log_model``), FINISHED (or FAILED with the reason). A run already
        ended is left as it is."""
        if logger is None:  # read back from its record: find the child, or create it if it never was
            found = self.tracking.child_run(self.parent_id, seed)
            if found is not None and not resumable(found):  # FINISHED, or FAILED by its own numbers
                return
            logger = self._child_logger(cfg, seed)
            logger.open(None)
            for row in rec["history"]:
                logger.log_round(int(row["round"]), {k: v for k, v in row.items() if k != "round"})
            logger.flush()
        if rec["status"] == "ok":
            logger.log_summary({f"summary_{k}": v for k, v in rec["summary"].items()
                                if isinstance(v, (int, float)) and v is not None})
        self.tracking.log_inputs(logger.run_id, self.inputs())
        staging = self.store.staging
        logger.log_artifacts([staging / "config.yaml"] + files)
        logger.log_artifacts([staging / "partition" / "stats.json", staging / "partition" / "labels_per_client.png"],
                             "partition")
        if rec["status"] == "ok" and self.cfg0.tracking.log_model:
            self.tracking.log_model(logger.run_id, self._final_model(rec["state_dict"]), self._model_example())
            faults.point("after_child_model")
        logger.close("FINISHED" if rec["status"] == "ok" else "FAILED", rec.get("reason"))

    def _final_model(self, state_dict: Dict[str, torch.Tensor]) -> torch.nn.Module:
        """A fresh model of this experiment (built as the simulator builds it, without the data a model may bind)
        holding ``state_dict``, on the CPU in eval mode: what MLflow logs."""
        from fl_core.algorithms import prepare_model
        from fl_core.engine.factory import DTYPES
        from fl_core.models import build_model

        cfg, ds = self.cfg0, self.ds
        model = build_model(cfg.model, cfg.dataset.name, ds.input_shape, ds.num_classes,
                            input_norm=(ds.mean, ds.std)).to("cpu", DTYPES[cfg.engine.dtype])
        prepare_model(cfg.algorithm, model)
        model.load_state_dict(state_dict)
        return model.eval()

    def _model_example(self) -> torch.Tensor:
        """[2, *input_shape]: the first two training inputs (as the model takes them), the logged model's input example."""
        return self.data.x[:2].detach().cpu()

    def _write_outputs(self, staging: Path) -> Dict:
        """runs.csv, rounds.csv, curves.png, metrics.json and experiment.json of the finished seeds."""
        from .figures import experiment_figure, readable_title

        ok = {s: r for s, r in self.records.items() if r["status"] == "ok"}
        failures = {s: r["reason"] for s, r in self.records.items() if r["status"] == "failed"}
        histories = {s: r["history"] for s, r in ok.items()}
        summary = _experiment_summary(self.name, self.cfg0, self.algo_desc, self.pkey, self.model_name,
                                      {s: r["summary"] for s, r in ok.items()}, failures, self.model_d)
        summary.update(fingerprint=self.store.fingerprint, seeds_run=sorted(self.records))
        # git and DVC keep runs.csv, rounds.csv and details/seed_<s>.csv: no wall-clock columns there, so that a rerun
        # gives the same bytes (and dvc.lock the same hashes); round_time_s goes to MLflow and details/round_times.csv,
        # which .dvcignore leaves out of the outputs' hashes
        all_rows = [{"seed": s, **row} for s, h in histories.items() for row in _without_timing(h)]
        write_text(staging / "runs.csv", _csv(all_rows, _history_columns(all_rows)))
        times = [{"seed": s, "round": row["round"], **{k: row[k] for k in TIMING_KEYS if k in row}}
                 for s, r in sorted(self.records.items()) for row in r["history"]]
        write_text(staging / "details" / TIMES_FILE, _csv(times, ["seed", "round", *TIMING_KEYS]))
        mean_rows = mean_curve(histories)
        write_text(staging / "rounds.csv", _csv(mean_rows, _history_columns(mean_rows)))
        experiment_figure(histories, readable_title(self.name, self.algo_desc, self.pkey, failed=not histories),
                          staging / "curves.png")
        if not ok:  # keep the folder DVC expects, saying why it holds no model
            write_text(staging / "models" / "README.txt", "No model: every seed failed (see ../experiment.json).\n")
        metrics, info = split_summary(summary)
        write_json(staging / METRICS_FILE, metrics)
        write_json(staging / EXPERIMENT_FILE, info)
        return summary

    @staticmethod
    def _best_seed(records: Dict[int, Dict]) -> Optional[int]:
        """The seed with the highest final accuracy (``final_acc``: the mean of the last ``train.final_window``
        evaluations; the lowest such seed on a tie), or None when no seed has one."""
        scored = [(-r["summary"]["final_acc"], s) for s, r in records.items()
                  if r.get("summary", {}).get("final_acc") is not None]
        return min(scored)[1] if scored else None

    def _end_parent(self, summary: Dict) -> None:
        """The parent's params, summary metrics, seed-mean curves (step = round), artifacts and best-child tags, once
        (a rerun skips what the parent holds); then FINISHED, or FAILED naming the seeds that failed."""
        if self.tracking is None or self.parent_id is None:
            return
        container = to_container(self.cfg0)
        container.pop("seed")
        tr, out = self.tracking, self.store.out
        tr.log_params(self.parent_id, {**run_params(container), "seeds": self.seeds, "effective_update_u": self.u})
        tr.log_metrics_once(self.parent_id, {k: v for k, v in summary.items()
                                             if k.endswith(("_mean", "_std")) and isinstance(v, (int, float))})
        ok = {s: r for s, r in self.records.items() if r["status"] == "ok"}
        # the seed-mean curves of rounds.csv but the per-client accuracy summaries (final values in the metrics)
        tr.log_curves(self.parent_id, [{k: v for k, v in row.items() if not k.startswith("client_acc_")}
                                       for row in mean_curve({s: r["history"] for s, r in ok.items()})])
        faults.point("after_parent_curves")
        best = self._best_seed(ok)
        child = tr.child_run(self.parent_id, best) if best is not None else None
        if child is not None:
            tr.set_best_child(self.parent_id, best, child.info.run_id)
        tr.log_artifacts(self.parent_id, [out / METRICS_FILE, out / EXPERIMENT_FILE, out / "rounds.csv", out / "curves.png", out / "curves.pdf",
                                          out / "config.yaml"])
        failures = summary.get("failures") or {}
        tr.end_parent(self.parent_id, "FAILED" if failures else "FINISHED",
                      "; ".join(f"seed {s}: {r}" for s, r in failures.items()) or None)
