"""Summaries of a run's per-round history and across seeds."""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence


def rounds_to_target(history: Sequence[Dict[str, float]], target: float) -> Optional[int]:
    """First round whose ``test_acc`` >= ``target`` (accuracy as a fraction), or None if never."""
    for row in history:
        if "test_acc" in row and row["test_acc"] >= target:
            return int(row["round"])
    return None


CLIENT_ACC_KEYS = ("client_acc_mean", "client_acc_std", "client_acc_worst10")  # per-client accuracy row keys


def summarize_run(history: Sequence[Dict[str, float]], target: float, final_window: int = 1) -> Dict[str, Optional[float]]:
    """final/best test accuracy (fractions), final test and train loss, rounds to ``target``, cumulative comm.

    ``final_acc`` is the mean test accuracy of the last ``final_window`` evaluations (FedNLR reports the
    last 5 or 30 rounds). With a post-training step (CCVR) the final accuracy and test loss are those
    of the calibrated model.

    ``final_client_acc_mean`` / ``_std`` / ``_worst10`` are the per-client accuracy summary (fractions;
    the test set reweighted by each client's label histogram, as FLGo / PFLlib report;
    :func:`fl_core.engine.simulator.evaluate`) of the last evaluation that has it, or None. With a
    post-training step they are those of the calibrated model (``post_client_acc_*``) when it has them.
    """
    evals = [r for r in history if "test_acc" in r]
    last = history[-1]
    if "post_test_acc" in last:
        out = {**summarize_run([{k: v for k, v in r.items() if not k.startswith("post_")} for r in history], target,
                               final_window),
               "final_acc": last["post_test_acc"], "final_test_loss": last["post_test_loss"],
               "final_acc_before_post": evals[-1]["test_acc"] if evals else None}
        if "post_client_acc_mean" in last:
            out.update({f"final_{k}": last[f"post_{k}"] for k in CLIENT_ACC_KEYS})
        return out
    client_eval = next((r for r in reversed(evals) if "client_acc_mean" in r), None)
    return {
        "final_acc": (sum(r["test_acc"] for r in evals[-final_window:]) / len(evals[-final_window:])
                      if evals else None),
        "best_acc": max(r["test_acc"] for r in evals) if evals else None,
        "final_test_loss": evals[-1]["test_loss"] if evals else None,
        "final_train_loss": last["train_loss"],
        "rounds_to_target": rounds_to_target(history, target),
        "up_floats_to_target": _up_floats_to_target(history, target),
        "comm_up_floats": last["comm_up_floats"],
        "comm_down_floats": last["comm_down_floats"],
        "rounds": int(last["round"]),
        **{f"final_{k}": client_eval[k] if client_eval else None for k in CLIENT_ACC_KEYS},
    }


def _up_floats_to_target(history: Sequence[Dict[str, float]], target: float) -> Optional[float]:
    """Cumulative uplink floats per client when ``test_acc`` first reaches ``target`` (None if never)."""
    r = rounds_to_target(history, target)
    return None if r is None else float(next(row["comm_up_floats"] for row in history if int(row["round"]) == r))


def mean_std(values: Sequence[Optional[float]]) -> Dict[str, Optional[float]]:
    """Mean and sample standard deviation (ddof = 1; 0 for a single value) of the non-None values."""
    xs: List[float] = [float(v) for v in values if v is not None]
    if not xs:
        return {"mean": None, "std": None, "n": 0}
    m = sum(xs) / len(xs)
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
    return {"mean": m, "std": sd, "n": len(xs)}


SUMMARY_KEYS = ("final_acc", "best_acc", "final_test_loss", "final_train_loss", "rounds_to_target",
                "up_floats_to_target", "final_client_acc_mean", "final_client_acc_worst10")


def summarize_seeds(summaries: Dict[int, Dict[str, Optional[float]]],
                    failures: Optional[Dict[int, str]] = None) -> Dict[str, object]:
    """An experiment's numbers over its seeds: ``<key>_mean`` / ``<key>_std`` (:func:`mean_std`) of every
    :data:`SUMMARY_KEYS` entry of the finished seeds' :func:`summarize_run` results, ``target_reached``
    (seeds that reached the target), ``status`` (``ok``; ``partial`` when some seeds failed; ``failed``
    when all did), ``seeds``, ``failed_seeds``, ``failures`` {seed: reason} and ``per_seed``."""
    failures = failures or {}
    out: Dict[str, object] = {
        "status": "failed" if failures and not summaries else ("partial" if failures else "ok"),
        "seeds": sorted(summaries), "failed_seeds": sorted(failures),
        "failures": {str(s): r for s, r in sorted(failures.items())}}
    for key in SUMMARY_KEYS:
        ms = mean_std([s.get(key) for s in summaries.values()])  # .get: records written before a key existed
        out[f"{key}_mean"], out[f"{key}_std"] = ms["mean"], ms["std"]
    out["target_reached"] = sum(1 for s in summaries.values() if s["rounds_to_target"] is not None)
    out["per_seed"] = {str(s): v for s, v in summaries.items()}
    return out
