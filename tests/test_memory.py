"""The vectorised executor's memory (fl_core/engine/memory.py) and what engine.executor=auto / vectorized do with it
(fl_core/engine/factory.py): the estimate by hand, the measured activations, the available memory read from fake
/proc and cgroup files and a fake CUDA device, and the choice against fake memory numbers, ViT-B's included. Nothing
of a large model's size is allocated."""

from __future__ import annotations

import os
import re

import pytest
import torch

from fl_core.algorithms import FedAvg, build_algorithm
from fl_core.algorithms.base import Needs
from fl_core.config import ConfigError, compose
from fl_core.data import make_partition
from fl_core.data.sampling import sample_clients
from fl_core.engine import diskstate, factory, memory
from fl_core.engine.factory import ExecutorTiming, build_simulator, choose_executor
from fl_core.engine.memory import (ACTIVATION_FACTOR, FIT_FRACTION, GIB, Fit, activation_bytes, available_bytes,
                                   extra_vectors, vectorized_memory)
from fl_core.models import build_model
from fl_core.params import ParamSpec

from conftest import tiny_cfg

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
VIT_B_D = 85_875_556  # ViT-B/16 with a 100-way head (docs/algorithms.md, Model catalogue)
VIT_B_ACTIVATIONS = 117_710_404  # bytes per sample activation_bytes measured for ViT-B/16 on one 32x32 input (CPU)


def _sizes(**kw):
    base = dict(d=1000, float_bytes=4, round_clients=10, max_parallel_clients=0, batch_size=8,
                activation_per_sample=100, state_bytes=4000, sample_bytes=12, extra_vectors=0)
    return {**base, **kw}


# ------------------------------------------------------------------------------------------------ the estimate

def test_the_estimate_is_the_documented_sum():
    m = vectorized_memory(**_sizes())
    vec = 4 * 1000
    act = ACTIVATION_FACTOR * 8 * 100  # 2400 < 2 s d = 8000: the chunk's end (flat parameters + deltas) dominates
    assert m.update == vec and m.clients == 10
    assert m.per_client == vec * 2 + 2 * 4000 + max(act, 2 * vec) + 8 * 12
    assert m.total() == 10 * m.per_client  # every client at once: no earlier chunk's updates
    big = vectorized_memory(**_sizes(activation_per_sample=10_000, extra_vectors=3))
    assert big.per_client == vec * 5 + 2 * 4000 + ACTIVATION_FACTOR * 8 * 10_000 + 8 * 12
    chunked = vectorized_memory(**_sizes(max_parallel_clients=3))
    assert chunked.clients == 3 and chunked.total() == 7 * vec + 3 * chunked.per_client
    assert vectorized_memory(**_sizes(max_parallel_clients=50)).clients == 10
    held = vectorized_memory(**_sizes(max_parallel_clients=3, held_bytes=10 ** 6))  # e.g. the in-memory store's states
    assert held.total() == 10 ** 6 + chunked.total() and held.total(5) == 10 ** 6 + chunked.total(5)


@pytest.mark.parametrize("held", [0, 50_000])
def test_the_largest_chunk_is_the_largest_that_fits(held):
    m = vectorized_memory(**_sizes(held_bytes=held))
    for budget in (m.total(1) - 1, m.total(1), m.total(4), m.total(4) + m.per_client - m.update - 1, m.total(10),
                   10 ** 9):
        k = m.largest_chunk(budget)
        assert k == max([c for c in range(0, 11) if c == 0 or m.total(c) <= budget])


@pytest.mark.parametrize("key", ["d", "float_bytes", "state_bytes", "extra_vectors", "held_bytes"])
def test_a_negative_size_is_one_line(key):
    with pytest.raises(ValueError, match=rf"^vectorized_memory: {key} must be >= 0, got -1$"):
        vectorized_memory(**_sizes(**{key: -1}))
    with pytest.raises(ValueError, match=r"^vectorized_memory: batch_size must be >= 1, got 0$"):
        vectorized_memory(**_sizes(batch_size=0))


def test_extra_vectors_count_the_optimiser_and_the_declared_services():
    class Full(FedAvg):
        needs = Needs(full_gradient=True, anchor_gradient=True)

    class Scaled(FedAvg):
        def client_begin(self, ctx, probe):
            ctx.lr_scale = None

    assert extra_vectors(FedAvg(), 0.0, "sgd") == 0
    assert extra_vectors(FedAvg(), 0.9, "sgd") == 1
    assert extra_vectors(FedAvg(), 0.0, "adam") == 2
    assert extra_vectors(Full(), 0.0, "sgd") == 3
    assert extra_vectors(Scaled(), 0.9, "sgd") == 2


# ------------------------------------------------------------------------------------------------ measured activations

def test_activation_bytes_grow_with_the_batch_and_leave_parameters_and_data_out():
    torch.manual_seed(0)
    model = build_model(compose(["model=mlp"]).model, "digits", (1, 8, 8), 10)
    data = torch.randn(500, 1, 8, 8)
    one = activation_bytes(model, data[:1])  # a view of a 500-sample tensor counts one sample
    assert 0 < one < 64 * 1024  # the MLP's activations of one 8x8 sample, far below its parameters or the data
    assert abs(activation_bytes(model, data[:4]) - one) <= 0.01 * one  # linear in the batch (ceil per sample)
    assert sum(p.numel() * 4 for p in model.parameters()) > 10 * one


def test_activation_bytes_change_nothing():
    torch.manual_seed(0)
    model = build_model(compose(["model=vgg9"]).model, "digits", (1, 8, 8), 10)  # dropout draws from the RNG
    model.eval()
    x = torch.randn(1, 1, 8, 8)
    before = ({k: v.clone() for k, v in model.state_dict().items()}, torch.get_rng_state())
    assert activation_bytes(model, x) > 0
    assert not model.training and torch.equal(torch.get_rng_state(), before[1])
    assert all(torch.equal(v, before[0][k]) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


# ------------------------------------------------------------------------------------------------ available memory

def test_available_ram_is_memavailable_capped_by_the_cgroup(tmp_path, monkeypatch):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24576000 kB\nMemFree:         1000000 kB\nMemAvailable:   20000000 kB\n")
    assert available_bytes(CPU, meminfo, tmp_path / "none") == (20_000_000 * 1024, "of RAM available")
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "memory.max").write_text("8589934592\n")
    (v2 / "memory.current").write_text("1073741824\n")
    assert available_bytes(CPU, meminfo, v2)[0] == 7 * GIB
    (v2 / "memory.max").write_text("max\n")
    assert available_bytes(CPU, meminfo, v2)[0] == 20_000_000 * 1024
    v1 = tmp_path / "v1" / "memory"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text(str(2 * GIB))
    (v1 / "memory.usage_in_bytes").write_text(str(GIB // 2))
    assert available_bytes(CPU, meminfo, tmp_path / "v1")[0] == 3 * GIB // 2
    # without /proc/meminfo: the free pages
    pages = {"SC_AVPHYS_PAGES": 1000, "SC_PAGE_SIZE": 4096}
    monkeypatch.setattr(os, "sysconf", pages.__getitem__)
    assert available_bytes(CPU, tmp_path / "missing", tmp_path / "none")[0] == 4096 * 1000


def test_available_cuda_memory_counts_the_allocators_unused_cache(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (30 * GIB, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 6 * GIB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 4 * GIB)
    assert available_bytes(CUDA) == (32 * GIB, "free on cuda")


# ------------------------------------------------------------------------------------------------ the choice

class Probe:
    def __init__(self):
        self.calls = 0

    def __call__(self):
        self.calls += 1
        return ExecutorTiming({"sequential": 2.0, "vectorized": 1.0}, {"sequential": 1, "vectorized": 1}, 1, 0.01)


def _fit(total_gib: float, available_gib: float, clients: int = 10) -> Fit:
    """A fit whose estimate is ``total_gib`` for ``clients`` at once (no earlier chunks; updates of 0.1 GiB)."""
    per = int(total_gib * GIB / clients)
    return Fit(memory.VectorizedMemory(clients, clients, per, int(0.1 * GIB)), int(available_gib * GIB),
               "of RAM available")


@pytest.mark.parametrize("device", [CPU, CUDA])
def test_auto_falls_back_to_sequential_where_the_vectorized_executor_cannot_fit(device):
    probe, calls = Probe(), []
    fit = _fit(40.0, 20.0)

    def check():
        calls.append(1)
        return fit

    name, reason = choose_executor("auto", FedAvg(), torch.nn.Linear(2, 2), device, probe, fit=check)
    k = fit.need.largest_chunk(fit.budget)
    assert (name, probe.calls, len(calls)) == ("sequential", 0, 1)
    assert reason == (f"auto: the vectorized executor would need about 40.0 GiB for 10 clients at once, more than "
                      f"80% of the 20.0 GiB of RAM available; engine.max_parallel_clients={k} would fit")
    assert k == 3  # 3 x 4 GiB + 7 x 0.1 GiB <= 16 GiB < 4 x 4 GiB + 6 x 0.1 GiB
    # where it fits, the probe decides as before
    name, reason = choose_executor("auto", FedAvg(), torch.nn.Linear(2, 2), device, probe, fit=lambda: _fit(15.0, 20.0))
    assert (name, probe.calls) == ("vectorized", 1) and reason.startswith("auto: vectorized (faster)")


def test_a_sequential_only_stack_or_a_model_with_buffers_is_not_measured():
    class SeqOnly(FedAvg):
        vectorizable = False

    def never():
        raise AssertionError("measured")

    assert choose_executor("auto", SeqOnly(), torch.nn.Linear(2, 2), CPU, Probe(), fit=never)[0] == "sequential"
    assert choose_executor("auto", FedAvg(), torch.nn.BatchNorm1d(2), CPU, Probe(), fit=never)[0] == "sequential"
    assert choose_executor("sequential", FedAvg(), torch.nn.Linear(2, 2), CPU, Probe(), fit=never)[0] == "sequential"
    # the vectorised executor's own one-line refusal stays (its constructor), not a measurement of a BatchNorm model
    assert choose_executor("vectorized", FedAvg(), torch.nn.BatchNorm1d(2), CPU, fit=never)[0] == "vectorized"


def test_vectorized_by_name_that_cannot_fit_is_one_line_before_training():
    assert choose_executor("vectorized", FedAvg(), torch.nn.Linear(2, 2), CPU, fit=lambda: _fit(15.0, 20.0)) == \
        ("vectorized", "engine.executor=vectorized")
    with pytest.raises(ConfigError) as err:
        choose_executor("vectorized", FedAvg(), torch.nn.Linear(2, 2), CPU, fit=lambda: _fit(40.0, 20.0))
    assert str(err.value) == ("engine.executor=vectorized needs about 40.0 GiB for 10 clients at once, more than 80% "
                              "of the 20.0 GiB of RAM available: set engine.max_parallel_clients=3 (fits) or "
                              "engine.executor=sequential (or auto)")
    with pytest.raises(ConfigError, match=r"^engine.executor=vectorized needs about 40.0 GiB for 1 client at once, "
                                          r"more than 80% of the 20.0 GiB of RAM available; even one client at a time "
                                          r"needs 40.0 GiB: set engine.executor=sequential \(or auto\)$"):
        choose_executor("vectorized", FedAvg(), torch.nn.Linear(2, 2), CPU, fit=lambda: _fit(40.0, 20.0, clients=1))


@pytest.mark.parametrize("rule, vectors, cpu_chunk, h100_fits", [("scaffold", 1, 2, False), ("fedavg", 0, 2, True)])
def test_vit_b_round_on_a_cpu_machine_an_h100_and_an_h200(rule, vectors, cpu_chunk, h100_fits):
    """ViT-B/16 (built on the meta device: its d without its 344 MB), the rule's declared state, 10 clients of B = 16
    at once; the activations are the bytes activation_bytes measured for it once (VIT_B_ACTIVATIONS). The table of
    docs/scaling.md, Large models."""
    cfg = compose(["model=vit_b_16", "dataset=cifar100", f"algorithm={rule}"])
    with torch.device("meta"):
        model = build_model(cfg.model, "cifar100", (3, 32, 32), 100)
    spec = ParamSpec.from_model(model)
    algo = build_algorithm(cfg.algorithm, spec, model)
    state = diskstate.client_state_bytes(algo, spec.d, torch.float32)
    assert (spec.d, state) == (VIT_B_D, vectors * 4 * VIT_B_D)
    need = vectorized_memory(d=spec.d, float_bytes=4, round_clients=10, max_parallel_clients=0, batch_size=16,
                             activation_per_sample=VIT_B_ACTIVATIONS, state_bytes=state, sample_bytes=3 * 32 * 32 * 4,
                             extra_vectors=extra_vectors(algo, 0.0, "sgd"))
    vec = 4 * VIT_B_D
    assert need.per_client == 2 * vec + 2 * state + ACTIVATION_FACTOR * 16 * VIT_B_ACTIVATIONS + 16 * 3 * 32 * 32 * 4
    assert f"{need.total() / GIB:.1f}" == {"scaffold": "65.4", "fedavg": "59.0"}[rule]
    cpu = Fit(need, int(21.5 * GIB), "of RAM available")  # this project's 2-core machines: 23 GiB, ~21.5 available
    h100, h200 = Fit(need, int(77 * GIB), "free on cuda:0"), Fit(need, int(138 * GIB), "free on cuda:0")
    assert not cpu.fits and cpu.chunk == cpu_chunk
    assert h100.fits == h100_fits and (h100_fits or h100.chunk == 9)
    assert h200.fits
    name, reason = choose_executor("auto", algo, model, CPU, Probe(), fit=lambda: cpu)
    assert name == "sequential" and re.search(r"would need about [56]\d\.\d GiB for 10 clients at once, more than 80% of "
                                              r"the 21\.5 GiB of RAM available; engine.max_parallel_clients=2 would "
                                              r"fit$", reason)
    probe = Probe()
    assert choose_executor("auto", algo, model, CUDA, probe, fit=lambda: h200)[0] == "vectorized" and probe.calls == 1


# ------------------------------------------------------------------------------------------------ through the factory

def _build(digits, *overrides):
    cfg = tiny_cfg(*overrides)
    part = make_partition(cfg.partition, digits.y_train.numpy(), digits.num_classes)
    return build_simulator(cfg, digits, part)


def test_the_factory_checks_the_real_estimate_against_the_available_memory(digits, monkeypatch):
    seen = []
    real = factory.vectorized_fit

    def spy(*args, **kw):
        seen.append(real(*args, **kw))
        return seen[-1]

    monkeypatch.setattr(factory, "vectorized_fit", spy)
    sim = _build(digits, "algorithm=scaffold", "model=mlp", "engine.executor=vectorized")
    fit = seen[-1]
    d = sum(p.numel() for p in sim.model.parameters())
    assert sim.executor.name == "vectorized" and fit.fits
    n = len(sample_clients(6, 0.5, sim.sampler, 0, 1))  # round 1's clients (tiny_cfg's seed 0)
    assert fit.need.update == 4 * d and fit.need.clients == fit.need.round_clients == n
    assert fit.need.per_client >= 2 * 4 * d + 2 * 4 * d  # parameters, gradients and the state twice
    assert fit.need.held == 6 * 4 * d  # the in-memory store will hold the 6 clients' control variates in RAM
    _build(digits, "algorithm=scaffold", "model=mlp", "engine.executor=vectorized", "engine.client_state=disk")
    assert seen[-1].need.held == 0 and seen[-1].need.per_client == fit.need.per_client
    assert fit.available > 0 and fit.where == "of RAM available"
    # a machine with too little memory: auto trains sequentially, vectorized by name is refused in one line
    short = int((fit.need.total(1) + fit.need.total()) / 2 / FIT_FRACTION)  # room for one client, not for all
    monkeypatch.setattr(memory, "available_bytes", lambda device: (short, "of RAM available"))
    sim = _build(digits, "algorithm=scaffold", "model=mlp", "engine.executor=auto")
    assert sim.executor.name == "sequential"
    assert sim.executor.reason.startswith("auto: the vectorized executor would need about ")
    with pytest.raises(ConfigError, match=r"^engine.executor=vectorized needs about .* MiB for \d+ clients at once, "
                                          r"more than 80% of the .* MiB of RAM available: set "
                                          r"engine.max_parallel_clients=\d+ \(fits\) or engine.executor=sequential "
                                          r"\(or auto\)$"):
        _build(digits, "algorithm=scaffold", "model=mlp", "engine.executor=vectorized")


def test_fl_train_refuses_vectorized_that_cannot_fit_in_one_line_before_anything_is_written(tmp_path, monkeypatch,
                                                                                            capsys):
    from pipeline import train

    monkeypatch.setattr(memory, "available_bytes", lambda device: (2 ** 20, "of RAM available"))  # 1 MiB
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as done:
        train.main(["model=mlp", "engine.executor=vectorized", "tracking.enabled=false", "engine.progress=false",
                    f"results_dir={tmp_path / 'results'}", f"data_dir={tmp_path / 'data'}",
                    f"engine.checkpoint_dir={tmp_path / 'checkpoints'}"])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert re.fullmatch(r"error: engine.executor=vectorized needs about \d+\.\d MiB for \d+ clients at once, more "
                        r"than 80% of the 1\.0 MiB of RAM available; even one client at a time needs \d+\.\d MiB: "
                        r"set engine.executor=sequential \(or auto\)\n", err), err
    assert not (tmp_path / "results").exists() and not (tmp_path / "checkpoints").exists()
