"""What the MLflow UI shows: params of the rules in the stack only, per-round metric names grouped in
sections (``test/acc``, ``train/loss``, ...; per-client and per-layer values only with tracking.detail_metrics),
and experiments marked as model training (fl_core/store/tracking.py)."""

from __future__ import annotations

import dataclasses
import shutil

import pytest

from fl_core.algorithms import registry
from fl_core.config import AlgorithmConfig, to_container
from fl_core.store.tracking import (EXPERIMENT_KIND, METRIC_NAMES, METRIC_SECTIONS, TAG_EXPERIMENT_KIND, Tracking, flatten,
                              is_detail, mlflow_metric_name, rule_sections, run_params)

from conftest import run_sim, tiny_cfg

SECTIONS = {f.name for f in dataclasses.fields(AlgorithmConfig) if dataclasses.is_dataclass(f.default_factory)}


def _sections_in(params) -> set:
    """The algorithm.<section> names that ``params`` carries."""
    return {k.split(".")[1] for k in params if k.startswith("algorithm.") and k.count(".") >= 2}


# ------------------------------------------------------------------------------------------ run_params


def test_every_rule_of_the_config_is_in_the_registries_and_every_section_is_read_by_a_rule():
    known = rule_sections()
    assert {r.name for r in registry.rules()} == set(known)
    assert set().union(*known.values()) == SECTIONS  # no section that run_params would always drop
    for rule, sections in known.items():
        assert sections <= SECTIONS
        if rule in SECTIONS:
            assert rule in sections, rule


def test_rule_sections_follow_the_builders():
    known = rule_sections()
    assert known["fedavg"] == frozenset()
    assert known["fedprox"] == {"fedprox"}
    assert known["fedbcgd_plus"] == {"fedbcgd"}
    assert known["topk"] == known["qsgd"] == {"compression"}
    assert known["adam"] == known["yogi"] == known["adagrad"] == {"adaptive"}
    assert known["momentum"] == {"fedavgm"} and known["sgd"] == frozenset()
    assert known["moon"] == {"moon"}


@pytest.mark.parametrize("overrides, sections", [
    ([], set()),  # fedavg
    (["algorithm=fedprox"], {"fedprox"}),
    (["algorithm=fedbug", "algorithm.name=fedprox"], {"fedbug", "fedprox"}),
    (["algorithm=fedbug", "algorithm.name=scaffold"], {"fedbug", "scaffold"}),
    (["algorithm=fedpaq"], {"compression"}),  # FedAvg(uniform) wrapped in QSGD
    (["algorithm=topk"], {"compression"}),
    (["algorithm=fedbcgd_plus"], {"fedbcgd"}),
    (["algorithm=fedadam"], {"adaptive"}),
    (["algorithm=fedbug", "algorithm.name=fedprox", "algorithm.server_opt=momentum"], {"fedbug", "fedprox", "fedavgm"}),
    (["algorithm=ccvr", "algorithm.wrappers=[fednlr,ccvr]"], {"ccvr", "fednlr"}),
])
def test_run_params_keep_the_sections_of_the_stack_only(overrides, sections):
    container = to_container(tiny_cfg(*overrides))
    full, params = flatten(container), run_params(container)
    assert _sections_in(params) == sections
    assert _sections_in(full) == SECTIONS
    # nothing changed, and nothing lost but the foreign sections
    assert all(full[k] == v for k, v in params.items())
    algo = container["algorithm"]
    # an empty transforms list (the default) is left out, so runs without transforms keep their params and fingerprint
    no_transforms = not algo["transforms"]
    lost = {k for k in full if k not in params} - ({"algorithm.transforms"} if no_transforms else set())
    assert ("algorithm.transforms" in params) != no_transforms
    assert {k.split(".")[1] for k in lost} == SECTIONS - sections
    assert all(k.startswith("algorithm.") and k.count(".") >= 2 for k in lost)
    # the generic algorithm keys and everything outside algorithm stay
    for key in ("name", "wrappers", "aggregation", "eta_g"):
        assert params[f"algorithm.{key}"] == algo[key]
    for key, value in algo.items():
        if not isinstance(value, dict) and not (key == "transforms" and no_transforms):
            assert params[f"algorithm.{key}"] == value
    assert {k: v for k, v in full.items() if not k.startswith("algorithm.")} == \
        {k: v for k, v in params.items() if not k.startswith("algorithm.")}


def test_run_params_keep_every_key_of_the_base_and_wrapper_sections():
    container = to_container(tiny_cfg("algorithm=fedbug", "algorithm.name=fedprox", "algorithm.wrappers=[fedbug]",
                                   "algorithm.transforms=[topk]"))
    params = run_params(container)
    for section in ("fedbug", "fedprox", "compression"):
        sub = flatten(container["algorithm"][section], f"algorithm.{section}")
        assert sub and all(params[k] == v for k, v in sub.items()), section


def test_run_params_without_an_algorithm_is_flatten():
    assert run_params({"train": {"rounds": 3}, "seed": 1}) == {"train.rounds": 3, "seed": 1}


# ------------------------------------------------------------------------------------------ metric names


@pytest.mark.parametrize("key, name", [
    ("test_acc", "test/acc"),
    ("test_loss", "test/loss"),
    ("test_acc_std", "test/acc_std"),
    ("client_acc_mean", "test/client_acc_mean"),
    ("client_acc_std", "test/client_acc_std"),
    ("client_acc_worst10", "test/client_acc_worst10"),
    ("val_acc", "val/acc"),
    ("val_loss", "val/loss"),
    ("post_test_acc", "post/test_acc"),
    ("post_test_loss", "post/test_loss"),
    ("post_client_acc_mean", "post/client_acc_mean"),
    ("train_loss", "train/loss"),
    ("train_loss_clients_max", "train/loss_clients_max"),
    ("lr", "train/lr"),
    ("comm_up_floats", "comm/up_floats"),
    ("comm_down_floats", "comm/down_floats"),
    ("num_clients", "round/clients"),
    ("round_time_s", "round/time_s"),
    ("local_steps_mean", "round/local_steps_mean"),
    ("local_steps_max", "round/local_steps_max"),
    ("stragglers", "round/stragglers"),
    ("cos_mean", "diag/cos_mean"),
    ("neuron_drift", "diag/neuron_drift"),
    ("fedbug_trainable_share", "diag/fedbug_trainable_share"),
    ("topk_residual_norm", "diag/topk_residual_norm"),
    ("server_update_norm", "diag/server_update_norm"),
    ("objective_gap", "diag/objective_gap"),
    ("cos_conv1", "detail/cos_conv1"),
    ("cos_layer1.0.conv1", "detail/cos_layer1.0.conv1"),
    ("neuron_drift_l2", "detail/neuron_drift_l2"),
    ("fednlr_mu_l3", "detail/fednlr_mu_l3"),
    ("fednlr_T_l12", "detail/fednlr_T_l12"),
    ("client_loss/3", "detail/client_loss_3"),
    ("drift_cosine", "drift/cosine"),
    ("drift_dissimilarity", "drift/dissimilarity"),
    ("drift_cos_layer1.0.conv1", "detail/drift_cos_layer1.0.conv1"),
    ("system/cpu_utilization_percentage", "system/cpu_utilization_percentage"),  # MLflow's own
])
def test_mlflow_metric_name(key, name):
    assert mlflow_metric_name(key) == name
    assert mlflow_metric_name(name) == name  # idempotent
    assert name.count("/") == 1 and name.split("/")[0] in METRIC_SECTIONS + ("system",)  # one section in every UI view


def test_detail_keys_are_the_per_client_and_per_layer_ones():
    detail = ["client_loss/0", "cos_conv1", "cos_fc", "fednlr_mu_l1", "fednlr_T_l2", "neuron_drift_l10"]
    summary = ["cos_mean", "neuron_drift", "train_loss_clients_max", "fedbug_gu_steps_mean", "fedexp_eta_g",
               "qsgd_rel_error", "objective", "opt_distance", *METRIC_NAMES]
    assert all(is_detail(k) for k in detail)
    assert not any(is_detail(k) for k in summary)


def test_the_named_keys_are_those_the_round_loop_and_the_evaluation_write(digits):
    """Every key of a round's row of a plain run has its stable name (no diag/ fallback for the standard ones); the
    drift measures (on by default) are in their own section, their per-layer values in detail."""
    _, res = run_sim(digits)
    keys = {k for row in res.history for k in row if k != "round"}
    drift = {k for k in keys if k.startswith("drift_")}
    assert keys - drift <= set(METRIC_NAMES)
    assert {mlflow_metric_name(k).split("/")[0] for k in keys - drift} == {"test", "train", "comm", "round"}
    assert {mlflow_metric_name(k).split("/")[0] for k in drift} == {"drift", "detail"}


# ------------------------------------------------------------------------------------------ end to end


@pytest.fixture
def tracking(tmp_path, monkeypatch, empty_store):
    shutil.copy(empty_store, tmp_path / "mlflow.db")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    return Tracking("fl-view", root=tmp_path)


def _history_names(tracking, run_id):
    run = tracking.client.get_run(run_id)
    return set(run.data.metrics), run


@pytest.mark.parametrize("detail", [False, True])
def test_tiny_run_has_grouped_metrics_stack_params_and_the_experiment_kind(digits, tracking, detail):
    overrides = ["algorithm=fedbug", "algorithm.name=fedprox", "tracking.client_loss_trace=2",
                 "tracking.layer_cosine=true"]
    cfg = tiny_cfg(*overrides)
    params = run_params(to_container(cfg))
    lg = tracking.child_logger(None, "view/seed0", {"fl.seed": "0"}, params, log_every=1, detail=detail)
    sim, res = run_sim(digits, *overrides, logger=lg)
    lg.log_summary({"summary_final_acc": res.history[-1]["test_acc"]})
    lg.close("FINISHED")

    exp = tracking.client.get_experiment(tracking.experiment_id)
    assert exp.tags[TAG_EXPERIMENT_KIND] == EXPERIMENT_KIND == "custom_model_development"

    names, run = _history_names(tracking, lg.run_id)
    row_keys = {k for row in res.history for k in row if k != "round"}
    assert {"test_acc", "train_loss", "comm_up_floats", "lr", "fedbug_trainable_share", "cos_mean"} <= row_keys
    per_client = {k for k in row_keys if k.startswith(("client_loss/", "cos_", "drift_cos_")) and k != "cos_mean"}
    assert per_client and all(is_detail(k) for k in per_client)
    logged = row_keys if detail else row_keys - per_client
    assert names == {mlflow_metric_name(k) for k in logged} | {"summary_final_acc"}
    assert {"test/acc", "train/loss", "comm/up_floats", "train/lr", "diag/fedbug_trainable_share",
            "diag/cos_mean"} <= names
    assert any(n.startswith("detail/client_loss_") for n in names) == detail
    assert not names & row_keys  # no plain per-round name
    R = cfg.train.rounds
    assert [m.step for m in tracking.client.get_metric_history(lg.run_id, "test/acc")] == list(range(1, R + 1))
    assert res.history[0]["test_acc"] == pytest.approx(
        tracking.client.get_metric_history(lg.run_id, "test/acc")[0].value)
    # params: the stack's sections only
    assert _sections_in(run.data.params) == {"fedbug", "fedprox"}
    assert run.data.params["algorithm.name"] == "fedprox"
    assert run.data.params["algorithm.fedprox.mu"] == str(cfg.algorithm.fedprox.mu)
    assert not any(k.startswith(("algorithm.ccvr.", "algorithm.compression.", "algorithm.scaffold."))
                   for k in run.data.params)


def test_experiment_created_before_gets_the_kind_and_a_kind_chosen_in_the_ui_stays(tracking, tmp_path):
    client = tracking.client
    old = client.create_experiment("older")
    assert TAG_EXPERIMENT_KIND not in client.get_experiment(old).tags
    Tracking("older", root=tmp_path)
    assert client.get_experiment(old).tags[TAG_EXPERIMENT_KIND] == EXPERIMENT_KIND
    client.set_experiment_tag(old, TAG_EXPERIMENT_KIND, "genai_development")
    Tracking("older", root=tmp_path)
    assert client.get_experiment(old).tags[TAG_EXPERIMENT_KIND] == "genai_development"


def test_reopened_run_skips_the_steps_it_holds_under_the_grouped_names(tracking):
    lg = tracking.child_logger(None, "resume", {}, {}, log_every=1)
    lg.open(None)
    for r in (1, 2):
        lg.log_round(r, {"test_acc": 0.1 * r, "comm_up_floats": 10.0 * r})
    lg.close("KILLED")
    lg2 = tracking.child_logger(None, "resume", {}, {}, log_every=1)
    lg2.open(lg.state())
    assert lg2.run_id == lg.run_id
    for r in (1, 2, 3):  # a resume replays rounds 1-2: each (metric, step) stays once
        lg2.log_round(r, {"test_acc": 0.1 * r, "comm_up_floats": 10.0 * r})
    lg2.close("FINISHED")
    for name in ("test/acc", "comm/up_floats"):
        assert [m.step for m in tracking.client.get_metric_history(lg.run_id, name)] == [1, 2, 3], name
    assert set(tracking.client.get_run(lg.run_id).data.metrics) == {"test/acc", "comm/up_floats"}


@pytest.mark.parametrize("older", ["test_acc", "1_accuracy/test_acc"])
def test_run_begun_with_older_names_keeps_them_on_resume(tracking, older):
    """A run logged before the names had sections (plain keys) or with the earlier numbered sections continues
    its series under that name instead of splitting it; new keys get the current names."""
    from mlflow.entities import Metric

    lg = tracking.child_logger(None, "legacy", {}, {}, log_every=1)
    lg.open(None)
    tracking.client.log_batch(lg.run_id, metrics=[Metric(older, 0.1, 0, 1), Metric(older, 0.2, 0, 2),
                                                  Metric("5_diagnostics/client_loss/0", 1.0, 0, 1)])
    lg.close("KILLED")
    lg2 = tracking.child_logger(None, "legacy", {}, {}, log_every=1)
    lg2.open(lg.state())
    for r in (2, 3):
        lg2.log_round(r, {"test_acc": 0.1 * r, "train_loss": 1.0 / r, "client_loss/0": 1.0})
    lg2.close("FINISHED")
    hist = tracking.client.get_metric_history(lg.run_id, older)
    assert sorted(m.step for m in hist) == [1, 2, 3]
    # client_loss/0 is a per-client key: without detail it is not logged, not even under its older name
    assert [m.step for m in tracking.client.get_metric_history(lg.run_id, "5_diagnostics/client_loss/0")] == [1]
    assert set(tracking.client.get_run(lg.run_id).data.metrics) == {older, "train/loss", "5_diagnostics/client_loss/0"}


def test_fingerprint_depends_on_the_sections_of_the_stack_only():
    """A rule's section changes the fingerprint of the experiments that use the rule and of no other, so
    registering a new rule (a new section) leaves every existing experiment's fingerprint, and results, in place."""
    from fl_core.experiment import fingerprint as experiment_fingerprint

    from fl_core.config import compose

    from conftest import TINY

    fp = lambda *o: experiment_fingerprint(tiny_cfg(*o))  # noqa: E731
    # sections outside the stack, as a preset brings them (typed, they are refused: tests/test_user_keys.py)
    unread = compose(TINY + ["algorithm.moon.mu=3", "algorithm.fedprox.mu=0.5", "algorithm.adaptive.tau=0.1"], user=())
    assert fp() == experiment_fingerprint(unread)
    assert fp("algorithm=moon") != fp("algorithm=moon", "algorithm.moon.mu=3")
    assert fp("algorithm=fedprox", "algorithm.server_opt=adam") != fp("algorithm=fedprox", "algorithm.server_opt=adam",
                                                                     "algorithm.adaptive.tau=0.1")
    assert fp("algorithm=fedprox") != fp("algorithm=fedprox", "algorithm.server_opt=adam")
    assert fp("seed=1") == fp("seed=2")
