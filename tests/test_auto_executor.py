"""``engine.executor=auto`` (fl_core/engine/factory.py, fl_core/engine/autoprobe.py): forced choices never probe, the
probe's verdict decides otherwise, the probe leaves the run untouched (model, algorithm state, RNG), its alternating
calls' fastest timings decide despite stalls, it runs once per workload, and the rounds run with the heap frozen
(fl_core/engine/gcpause.py). No timing is asserted."""

from __future__ import annotations

import gc
import re
import subprocess
import sys
import time
import weakref

import numpy as np
import pytest
import torch

from fl_core.algorithms import FedAvg
from fl_core.data import make_partition
from fl_core.data.sampling import sample_clients
from fl_core.engine import autoprobe, gcpause
from fl_core.engine.autoprobe import call_time, predict_round
from fl_core.engine.executors import VectorizedExecutor
from fl_core.engine.factory import ExecutorTiming, build_simulator, choose_executor, client_data, time_executors
from fl_core.params import flatten_params

from conftest import tiny_cfg

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def timing(sequential: float, vectorized: float) -> ExecutorTiming:
    return ExecutorTiming({"sequential": sequential, "vectorized": vectorized},
                          {"sequential": 2, "vectorized": 3}, 3, 0.01)


class Probe:
    """A stand-in for the timed probe: returns ``result`` (or raises it) and counts its calls."""

    def __init__(self, result):
        self.result, self.calls = result, 0

    def __call__(self):
        self.calls += 1
        if isinstance(self.result, BaseException):
            raise self.result
        return self.result


class SeqOnly(FedAvg):
    vectorizable = False


@pytest.mark.parametrize("requested", ["sequential", "vectorized", "distributed"])
def test_a_named_executor_is_taken_as_given_without_probing(requested):
    probe = Probe(timing(1.0, 2.0))
    assert choose_executor(requested, FedAvg(), torch.nn.Linear(2, 2), CPU, probe) == \
        (requested, f"engine.executor={requested}")
    assert probe.calls == 0


def test_forced_sequential_cases_do_not_probe():
    probe = Probe(timing(2.0, 1.0))
    name, reason = choose_executor("auto", SeqOnly(), torch.nn.Linear(2, 2), CUDA, probe)
    assert name == "sequential" and "only run sequentially" in reason
    name, reason = choose_executor("auto", FedAvg(), torch.nn.BatchNorm1d(2), CUDA, probe)
    assert name == "sequential" and "buffers" in reason
    assert probe.calls == 0


@pytest.mark.parametrize("device", [CPU, CUDA])
def test_the_faster_prediction_wins_on_either_device(device):
    for seq, vec, want in ((0.200, 0.040, "vectorized"), (0.100, 0.900, "sequential")):
        probe = Probe(timing(seq, vec))
        name, reason = choose_executor("auto", FedAvg(), torch.nn.Linear(2, 2), device, probe)
        assert (name, probe.calls) == (want, 1)
        assert reason.startswith(f"auto: {want} (faster)") and f"vectorized {1e3 * vec:.1f} ms" in reason
        assert f"sequential {1e3 * seq:.1f} ms" in reason and "3 and 2 of its 3 clients" in reason


@pytest.mark.parametrize("device, default", [(CPU, "sequential"), (CUDA, "vectorized")])
def test_ties_missing_and_failed_probes_keep_the_device_default(device, default):
    model = torch.nn.Linear(2, 2)
    name, reason = choose_executor("auto", FedAvg(), model, device, Probe(timing(1.00, 1.04)))
    assert name == default and "within 5%" in reason
    assert choose_executor("auto", FedAvg(), model, device)[0] == default
    name, reason = choose_executor("auto", FedAvg(), model, device, Probe(MemoryError("out of memory\nmore")))
    assert name == default and reason.endswith("the timing probe failed: MemoryError: out of memory")


def _snapshot(obj, depth=0):
    """Everything ``obj`` holds, recursively (attributes, containers; tensors cloned), for an equality check."""
    if isinstance(obj, torch.Tensor):
        return ("tensor", obj.detach().clone())
    if isinstance(obj, dict):
        return {k: _snapshot(v, depth + 1) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_snapshot(v, depth + 1) for v in obj]
    if hasattr(obj, "__dict__") and depth < 6 and not isinstance(obj, torch.nn.Module):
        return (type(obj).__name__, _snapshot(vars(obj), depth + 1))
    return obj if isinstance(obj, (int, float, str, bool, type(None))) else type(obj).__name__


def _same(a, b) -> bool:
    if isinstance(a, tuple) and len(a) == 2 and a[0] == "tensor":
        return isinstance(b, tuple) and b[0] == "tensor" and torch.equal(a[1], b[1])
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _parts(digits, *overrides):
    cfg = tiny_cfg("engine.executor=auto", *overrides)
    part = make_partition(cfg.partition, digits.y_train.numpy(), digits.num_classes)
    return cfg, part


def test_probe_leaves_model_algorithm_and_rng_untouched(digits):
    from fl_core.algorithms import build_algorithm
    from fl_core.models import build_model
    from fl_core.params import ParamSpec

    # SCAFFOLD keeps client state and server state; FedBug masks steps; the MLP trains in train mode
    cfg, part = _parts(digits, "algorithm=fedbug", "algorithm.name=scaffold", "model=mlp",
                       "train.augmentation=crop_flip", "train.crop_padding=1")
    data = client_data(digits, part, CPU)
    model = build_model(cfg.model, cfg.dataset.name, digits.input_shape, digits.num_classes)
    model.eval()
    algo = build_algorithm(cfg.algorithm, ParamSpec.from_model(model), model)
    before = (flatten_params(model), _snapshot(algo), torch.get_rng_state())
    kwargs = dict(batch_size=cfg.train.batch_size, local_epochs=cfg.train.local_epochs, seed=int(cfg.seed),
                  augmentation=cfg.train.augmentation, crop_padding=cfg.train.crop_padding)
    t = time_executors(cfg, model, algo, data, kwargs, budget_s=0.0, repeats=1)
    assert torch.equal(flatten_params(model), before[0]) and not model.training
    assert _same(_snapshot(algo), before[1])
    assert torch.equal(torch.get_rng_state(), before[2])
    assert set(t.round_s) == {"sequential", "vectorized"} and all(v > 0 for v in t.round_s.values())
    n = len(sample_clients(part.num_clients, cfg.train.participation, cfg.train.sampler, int(cfg.seed), 1))
    # budget 0: one sequential client; the vectorised chunk grows towards the round's while its calls stay short
    assert t.sampled == n and t.clients["sequential"] == 1 and 1 <= t.clients["vectorized"] <= n


def test_auto_run_equals_the_run_of_the_executor_it_chose(digits):
    cfg, part = _parts(digits, "algorithm=fedbug", "algorithm.name=fedprox", "model=mlp")
    torch.manual_seed(5)
    auto = build_simulator(cfg, digits, part)
    rng_after_auto = torch.get_rng_state()
    chosen = auto.executor.name
    torch.manual_seed(5)
    named = build_simulator(tiny_cfg("engine.executor=" + chosen, "algorithm=fedbug", "algorithm.name=fedprox",
                                     "model=mlp"), digits, part)
    assert torch.equal(torch.get_rng_state(), rng_after_auto)  # the probe drew nothing from the global RNG
    assert torch.equal(flatten_params(auto.model), flatten_params(named.model))
    assert torch.equal(auto.run().final_flat, named.run().final_flat)


# ------------------------------------------------------------------ robust timing: alternating calls, fastest counts


def _choice(samples, clients, steps, device=CPU):
    timing = ExecutorTiming.from_samples(samples, clients, steps, 0, 0.5)
    return choose_executor("auto", FedAvg(), torch.nn.Linear(2, 2), device, Probe(timing))[0], timing


def test_a_stall_in_one_call_does_not_decide():
    """200 clients of one step each; the vectorised executor trains all 200 in 10 ms, the sequential one 20 of them in
    100 ms (1 s for the round). A neighbour (or a garbage collection) stalls the first vectorised call to 2 s: a
    one-shot probe would take the sequential executor, ten times slower; the alternating calls' fastest do not."""
    clients, steps = {"sequential": 20, "vectorized": 200}, [1] * 200
    samples = {"sequential": [0.10, 0.45, 0.11, 0.10, 0.30], "vectorized": [2.0, 0.012, 0.010, 0.40, 0.011]}
    name, timing = _choice(samples, clients, steps)
    assert name == "vectorized"
    assert timing.round_s == pytest.approx({"sequential": 1.0, "vectorized": 0.010})
    one_shot = {k: v[:1] for k, v in samples.items()}
    assert _choice(one_shot, clients, steps)[0] == "sequential"  # what the first calls alone would pick
    # the mirror image: 4 CNN clients, sequential 50 ms per client, vectorised 400 ms for all 4; the sequential
    # executor's calls are the ones hit
    clients, steps = {"sequential": 1, "vectorized": 4}, [3] * 4
    samples = {"sequential": [0.9, 0.05, 0.6, 0.051, 0.05], "vectorized": [0.41, 0.40, 0.42, 0.40, 0.9]}
    assert _choice(samples, clients, steps, CUDA)[0] == "sequential"
    assert _choice({k: v[:1] for k, v in samples.items()}, clients, steps, CUDA)[0] == "vectorized"


def test_outliers_from_a_busy_neighbour_never_flip_the_choice():
    """2,000 random workloads, the true ratio of the two rounds between 1.2 and 30 either way; each of the 5
    alternating calls per executor is hit with probability 1/2 by a stall of 1.1 to 100 times its time, at least one
    call per executor is not (the rest jitter by 2 %). The decision always matches the undisturbed times; the first
    calls alone get it wrong in a sizeable share."""
    rng = np.random.default_rng(0)
    wrong_one_shot = 0
    for _ in range(2000):
        clients = {"sequential": int(rng.integers(1, 50)), "vectorized": int(rng.integers(1, 500))}
        steps = [int(k) for k in rng.integers(1, 6, size=int(rng.integers(1, 500)))]
        seq_round = float(rng.uniform(0.01, 10.0))
        ratio = float(np.exp(rng.uniform(np.log(1.2), np.log(30.0))))
        vec_round = seq_round / ratio if rng.random() < 0.5 else seq_round * ratio
        truth = "vectorized" if vec_round < seq_round else "sequential"
        unit = predict_round({"sequential": 1.0, "vectorized": 1.0}, clients, steps, len(steps))
        call = {"sequential": seq_round / unit["sequential"], "vectorized": vec_round / unit["vectorized"]}
        samples = {}
        for name, base in call.items():
            hit = rng.random(5) < 0.5
            hit[rng.integers(5)] = False  # at least one undisturbed call
            stall = np.where(hit, 1.1 + rng.pareto(1.0, 5).clip(max=99.0), 1.0)
            samples[name] = list(base * stall * rng.uniform(1.0, 1.02, 5))
        assert _choice(samples, clients, steps)[0] == truth, samples
        wrong_one_shot += _choice({k: v[:1] for k, v in samples.items()}, clients, steps)[0] != truth
    assert wrong_one_shot > 100


def test_call_time_needs_a_timing():
    assert call_time([0.3, 0.1, 0.2]) == 0.1
    with pytest.raises(ValueError, match="no timing"):
        call_time([])


def _logreg_workload(digits, *extra):
    """300 clients of about 6 digits images each, all of them every round, E = 1, B = 5, logistic regression: many
    tiny clients, where the vectorised executor trains a round about 10x faster than the sequential one (measured
    on 2 CPU cores: 7-40 ms against 90-800 ms, loaded or not)."""
    return _parts(digits, "model=logreg", "partition=iid", "partition.num_clients=300", "train.participation=1.0",
                  "train.sampler=fixed", "train.local_epochs=1", "train.batch_size=5", *extra)


@pytest.fixture
def fresh_probes():
    autoprobe.clear_cache()
    yield
    autoprobe.clear_cache()


@pytest.mark.parametrize("threads", [1, 2])
def test_the_real_choice_holds_with_a_cpu_bound_neighbour(digits, fresh_probes, threads):
    """The probe with a busy loop in another process picks the vectorised executor on the tiny clients as on an idle
    machine, with one torch thread and with two (on a 2-core machine two threads and the neighbour contend for the
    cores: every parallel operation may wait for a thread held off its core)."""
    torch.set_num_threads(threads)
    cfg, part = _logreg_workload(digits)
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.2)  # the neighbour is running before the probe starts
        sim = build_simulator(cfg, digits, part)
    finally:
        busy.kill()
        busy.wait()
    assert sim.executor.name == "vectorized", sim.executor.reason
    assert re.search(r"fastest of [345] alternating calls each", sim.executor.reason)


def test_the_probe_runs_once_per_workload(digits, fresh_probes, monkeypatch):
    """Seeds and learning rates of one workload share one probe; another batch size is another workload, and so is
    a population of several replicas (the probe times their round: ``replicas``)."""
    import fl_core.engine.factory as factory

    calls = []

    def fake(cfg, model, algo, data, kwargs, replicas=1):
        calls.append(int(kwargs["batch_size"]) * (100 if replicas > 1 else 1))
        return ExecutorTiming.from_samples({"sequential": [1.0], "vectorized": [0.1]}, {"sequential": 1,
                                           "vectorized": 1}, [1], 0, 0.2)

    monkeypatch.setattr(factory, "time_executors", fake)
    cfg, part = _logreg_workload(digits)
    first = build_simulator(cfg, digits, part)
    assert "measured once" not in first.executor.reason
    for extra in (["seed=3"], ["train.lr=0.2"], ["train.rounds=7"]):
        again = build_simulator(_logreg_workload(digits, *extra)[0], digits, part)
        assert again.executor.name == "vectorized" and again.executor.reason.endswith(
            "measured once for this workload in this process)")
    assert calls == [5]
    build_simulator(_logreg_workload(digits, "train.batch_size=3")[0], digits, part)
    assert calls == [5, 3]
    pop = build_simulator(cfg, digits, part, replicas=4)
    assert calls == [5, 3, 500] and "predicted round 1 of a population of 4 replicas" in pop.executor.reason


def test_the_probe_keeps_the_collector_out_of_its_calls(digits, fresh_probes, monkeypatch):
    """No garbage collection runs inside the probe's timed calls, and what it built is freed when it returns."""
    cfg, part = _logreg_workload(digits)
    data = client_data(digits, part, CPU)
    from fl_core.algorithms import build_algorithm
    from fl_core.models import build_model
    from fl_core.params import ParamSpec

    model = build_model(cfg.model, cfg.dataset.name, digits.input_shape, digits.num_classes)
    algo = build_algorithm(cfg.algorithm, ParamSpec.from_model(model), model)
    seen = []
    real = VectorizedExecutor.run_round

    def spy(self, *args):
        seen.append((gc.isenabled(), weakref.ref(self)))
        return real(self, *args)

    monkeypatch.setattr(VectorizedExecutor, "run_round", spy)
    kwargs = dict(batch_size=5, local_epochs=1, seed=0)
    timing = time_executors(cfg, model, algo, data, kwargs, budget_s=0.0, repeats=3)
    assert gc.isenabled() and seen and not any(enabled for enabled, _ in seen)
    assert all(ref() is None for _, ref in seen)  # the probe's executors (a reference cycle) are gone
    assert len(timing.samples["sequential"]) == len(timing.samples["vectorized"]) == 3


# ------------------------------------------------------------------ the round loop and the garbage collector


def test_frozen_heap_nests_and_releases():
    assert gc.get_freeze_count() == 0
    with gcpause.frozen_heap():
        outer = gc.get_freeze_count()
        assert outer > 0
        with gcpause.frozen_heap():
            gcpause.refreeze()
        assert gc.get_freeze_count() >= outer  # the inner exit keeps the outer block's objects frozen
    assert gc.get_freeze_count() == 0
    gcpause.refreeze()  # outside a block: nothing
    assert gc.get_freeze_count() == 0


def test_rounds_run_with_the_heap_frozen(digits):
    """During the rounds the objects that existed before the run (the interpreter's, torch's, the data's) are out of
    the collector's walks; afterwards they are back."""
    from conftest import run_sim

    frozen = []
    run_sim(digits, "train.rounds=3", callbacks=[lambda r, row: frozen.append(gc.get_freeze_count())])
    assert len(frozen) == 3 and min(frozen) > 0
    assert frozen[1] >= frozen[0]  # refrozen after the first round
    assert gc.get_freeze_count() == 0


def test_paused_collector_frees_the_block_cycles():
    class Node:
        pass

    with gcpause.paused():
        assert not gc.isenabled()
        a, b = Node(), Node()
        a.other, b.other = b, a
        ref = weakref.ref(a)
        del a, b
        assert ref() is not None  # a cycle: only the collector frees it
    assert gc.isenabled() and ref() is None
