"""The vectorised executor reproduces the sequential reference (docs/algorithms.md, One local step).

Tolerance: rounding only, ATOL = 1e-6 absolute on the global parameters (observed: <= 1.2e-7 in float32).
Batched matmuls and convolutions sum in another order than per-client ones, so results are not
bit-identical. The long comparisons use the MLP: with the CNNs on 8x8 digits, max-pool windows
often hold exactly equal maxima (flat image regions), and batched and per-client kernels may route
the gradient of such a tie to different positions (both valid subgradients); after a few rounds that
grows into a visible gap (3e-8 after 2 rounds, 1e-3 after 4). The CNN is therefore compared over
2 rounds.
Compressors (Top-k, QSGD) are not compared over several rounds for the same reason: they act on the
finished update outside the executors, and their selection / stochastic rounding turns a 1e-8 gap
into a different choice of entries (tests/test_compression.py covers them).

Rules that amplify rounding (AMPLIFYING: FedBCGD+ both variants, FedBCGD with freezing) are compared in
float64 over the same 4 rounds, with the same ATOL. In float32 their gap is not a rounding-sized one
(measured on an AMD EPYC, MLP on digits): FedBCGD+ paper stays at 6e-8 for 3 rounds and jumps to 2e-4 in
round 4 (1 and 2 threads); FedBCGD with freezing jumps from 4e-8 to 5e-5 in round 4 with 1 thread but
not with 2; FedBCGD+ code grows steadily, 1.2e-7 after 2 rounds, 5e-7 after 4, 8e-7 after 6. Whether
and when such a jump happens depends on the CPU's float32 summation order (SIMD width) and on the
thread count; in float64 every stack of STACKS stays below 3e-15 over 4 rounds. Their float32 path is
still compared, over 2 rounds (test_amplifying_rules_match_in_float32_over_two_rounds).

Every base rule alone, every wrapper over every base and every server optimiser are compared in float64 by the
conformance suite (tests/test_conformance.py, equal and unequal clients); STACKS here are the settings it does not
vary: float32, weight decay, clipping, lr decay, augmentation, unfreezing schedules, wrapper stacks, the CNN.

Every executor comparison runs with 1 and with 2 torch threads (fixture ``threads``; the per-stack
comparison with 2 threads for a cross-section of the stacks, ``TWO_THREADS``), so that none depends on
the thread count (batched kernels may split their sums by thread).
"""

from __future__ import annotations

import pytest
import torch

from fl_core.engine.factory import choose_executor

from conftest import run_sim

ATOL = 1e-6
# FedBCGD and FedBCGD+: server momentum / control variates amplify float32 rounding (see the module docstring)
AMPLIFYING = ("fedbcgd_plus_paper", "fedbcgd_plus_code", "fedbcgd_freezing")
FLOAT64 = ["engine.dtype=float64"]
UNEQUAL = ["partition=dirichlet", "partition.variant=per_class", "partition.alpha=0.5", "partition.min_size=5",
           "train.sampler=bernoulli", "train.participation=0.5", "train.rounds=4", "model=mlp"]

STACKS = {
    "fedavg": ["algorithm=fedavg"],
    "fedavg_uniform_clip_wd": ["algorithm=fedavg", "algorithm.aggregation=uniform", "train.grad_clip=0.5",
                               "train.weight_decay=0.01", "train.lr_decay=0.9"],
    "fedbug_fedprox": ["algorithm=fedbug", "algorithm.name=fedprox", "algorithm.fedprox.mu=0.1",
                       "algorithm.fedbug.gu_percentage=0.4", "train.weight_decay=0.01", "train.grad_clip=1.0"],
    "fedavg_crop_flip": ["algorithm=fedavg", "train.augmentation=crop_flip", "train.crop_padding=2"],
    "fedbug_fedbug_augmentation": ["algorithm=fedbug", "train.augmentation=fedbug", "train.crop_padding=2"],
    "fedbug_feddyn": ["algorithm=fedbug", "algorithm.name=feddyn", "algorithm.feddyn.alpha=0.1",
                      "train.weight_decay=0.001"],
    "fedbug_fedexp": ["algorithm=fedbug", "algorithm.name=fedexp"],
    "fedbug_top_down": ["algorithm=fedbug", "algorithm.fedbug.strategy=top_down"],
    "fedbug_fixed_last_two": ["algorithm=fedbug", "algorithm.fedbug.strategy=fixed_last_two"],
    "scaffold": ["algorithm=scaffold"],
    "fednlr_feddyn": ["algorithm=fednlr", "algorithm.name=feddyn"],
    "fedbug_fednlr_fedprox": ["algorithm=fednlr", "algorithm.name=fedprox", "algorithm.wrappers=[fednlr,fedbug]",
                              "algorithm.fedbug.gu_percentage=0.5", "train.weight_decay=0.001"],
    "feddc": ["algorithm=feddc", "algorithm.feddc.alpha=0.1"],
    "fedbcgd_plus_paper": ["algorithm=fedbcgd_plus", "algorithm.fedbcgd.blocks=2"],
    "fedbcgd_plus_code": ["algorithm=fedbcgd_plus", "algorithm.fedbcgd.blocks=2",
                          "algorithm.fedbcgd.plus_variant=code"],
    "fedbcgd_freezing": ["algorithm=fedbcgd", "algorithm.fedbcgd.blocks=2", "algorithm.fedbcgd.freezing=true"],
    "fedbug_code_schedule": ["algorithm=fedbug", "algorithm.fedbug.schedule=code",
                             "algorithm.fedbug.gu_percentage=0.8"],
    # the forward_of service (global and per-client previous model) on augmented, padded batches
    "fedbug_moon_crop_flip": ["algorithm=fedbug", "algorithm.name=moon", "algorithm.moon.mu=5",
                              "train.augmentation=crop_flip", "train.crop_padding=2"],
}


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    """Run the test with ``torch.set_num_threads(n)``, n = 1 and 2; the previous count is restored after."""
    previous = torch.get_num_threads()
    torch.set_num_threads(request.param)
    try:
        yield request.param
    finally:
        torch.set_num_threads(previous)


def test_threads_fixture_sets_the_thread_count(threads):
    assert torch.get_num_threads() == threads


# every stack with 1 thread; with 2 threads a cross-section (plain, stateful, wrapped, rounding-amplifying
# and server-state rules) that keeps the suite's time in bounds
TWO_THREADS = ("fedavg", "scaffold", "fedbug_feddyn", "fednlr_feddyn", "feddc", "fedbcgd_plus_paper")


@pytest.mark.parametrize("stack,threads", [(s, 1) for s in STACKS] + [(s, 2) for s in TWO_THREADS],
                         ids=[f"1thread-{s}" for s in STACKS] + [f"2threads-{s}" for s in TWO_THREADS],
                         indirect=["threads"])
def test_vectorized_matches_sequential(digits, stack, threads):
    ov = UNEQUAL + STACKS[stack] + (FLOAT64 if stack in AMPLIFYING else [])
    _, seq = run_sim(digits, *ov, "engine.executor=sequential")
    _, vec = run_sim(digits, *ov, "engine.executor=vectorized")
    assert seq.final_flat.dtype == (torch.float64 if stack in AMPLIFYING else torch.float32)
    sizes = {r["num_clients"] for r in seq.history}
    assert len(sizes) >= 1
    diff = (seq.final_flat - vec.final_flat).abs().max().item()
    assert diff < ATOL, f"max |seq - vec| = {diff}"
    if threads == 1:  # and the run actually trained (the comparison is not between two untouched models)
        _, first = run_sim(digits, *[o for o in ov if not o.startswith("train.rounds=")], "train.rounds=1",
                           "engine.executor=sequential")
        assert (first.final_flat - seq.final_flat).abs().max().item() > 100 * ATOL
    for a, b in zip(seq.history, vec.history):
        assert a["num_clients"] == b["num_clients"]
        assert abs(a["train_loss"] - b["train_loss"]) < 1e-4
        assert abs(a["test_loss"] - b["test_loss"]) < 1e-4


@pytest.mark.parametrize("stack", AMPLIFYING)
def test_amplifying_rules_match_in_float32_over_two_rounds(digits, stack, threads):
    """The float32 path of the rules compared in float64 above, over 2 rounds (gap <= 1.2e-7 measured)."""
    ov = [o for o in UNEQUAL if not o.startswith("train.rounds=")] + STACKS[stack] + ["train.rounds=2"]
    _, seq = run_sim(digits, *ov, "engine.executor=sequential")
    _, vec = run_sim(digits, *ov, "engine.executor=vectorized")
    assert seq.final_flat.dtype == torch.float32 and len(seq.history) == 2
    diff = (seq.final_flat - vec.final_flat).abs().max().item()
    assert diff < ATOL, f"max |seq - vec| = {diff}"


@pytest.mark.parametrize("stack", ["fedavg", "fedbug_fedprox"])
def test_vectorized_matches_sequential_on_the_cnn(digits, stack, threads):
    ov = UNEQUAL + STACKS[stack] + ["model=small_cnn", "train.rounds=2"]
    _, seq = run_sim(digits, *ov, "engine.executor=sequential")
    _, vec = run_sim(digits, *ov, "engine.executor=vectorized")
    diff = (seq.final_flat - vec.final_flat).abs().max().item()
    assert diff < ATOL, f"max |seq - vec| = {diff}"


@pytest.mark.parametrize("stack", [["algorithm=feddecorr", "algorithm.feddecorr.beta=0.1"],
                                   ["algorithm=fedbug", "algorithm.name=feddecorr", "algorithm.feddecorr.beta=0.1"]])
def test_feddecorr_executors_match_in_float64(digits, stack, threads):
    """FedDecorr is compared over one round in float64. For a feature with a tiny spread in a small batch
    (here the 2-sample tail batch of a client) the z-score (d/2)/sqrt(d^2/2 + 1e-8) has a slope of ~1e4,
    so the method itself magnifies any difference: in float64 a 3e-15 gap after the first local step
    grows to 7e-9 after 16 steps and to 5e-2 after three rounds (0.04 after one round in float32).
    One round still covers every client, unequal K_i and the padded tail batches."""
    ov = [o for o in UNEQUAL if not o.startswith("train.rounds")] + stack + ["engine.dtype=float64",
                                                                             "train.rounds=1"]
    _, seq = run_sim(digits, *ov, "engine.executor=sequential")
    _, vec = run_sim(digits, *ov, "engine.executor=vectorized")
    assert seq.final_flat.dtype == torch.float64
    diff = (seq.final_flat - vec.final_flat).abs().max().item()
    assert diff < 1e-6, f"max |seq - vec| = {diff}"


def test_unequal_step_counts_really_occur(digits):
    """The equivalence above covers clients with different K_i (not only equal ones)."""
    from fl_core.data import make_partition
    from fl_core.engine.executors import local_steps

    from conftest import tiny_cfg

    cfg = tiny_cfg(*UNEQUAL)
    part = make_partition(cfg.partition, digits.y_train.numpy(), digits.num_classes)
    ks = {local_steps(int(n), cfg.train.batch_size, cfg.train.local_epochs) for n in part.sizes}
    assert len(ks) > 1


def test_chunked_clients_match_all_at_once(digits, threads):
    ov = UNEQUAL + STACKS["fedbug_fedprox"] + ["engine.executor=vectorized"]
    _, whole = run_sim(digits, *ov)
    _, chunked = run_sim(digits, *ov, "engine.max_parallel_clients=2")
    assert (whole.final_flat - chunked.final_flat).abs().max().item() < ATOL


def test_vectorized_is_deterministic(digits, threads):
    ov = UNEQUAL + ["algorithm=fedbug", "engine.executor=vectorized"]
    _, a = run_sim(digits, *ov)
    _, b = run_sim(digits, *ov)
    assert torch.equal(a.final_flat, b.final_flat)


def test_auto_times_both_executors_and_says_why(digits):
    sim, _ = run_sim(digits, "engine.executor=auto", "train.rounds=1")
    assert sim.executor.name in ("sequential", "vectorized")  # whichever the probe found faster here
    assert sim.executor.reason.startswith(f"auto: {sim.executor.name} (") and "predicted" in sim.executor.reason
    name, reason = choose_executor("auto", sim.algo, sim.model, torch.device("cuda"))  # no probe: device default
    assert name == "vectorized" and "CUDA" in reason


def test_vectorized_rejects_sequential_only_algorithms(digits):
    from fl_core.algorithms import FedAvg

    class SeqOnly(FedAvg):
        vectorizable = False

    name, reason = choose_executor("auto", SeqOnly(), torch.nn.Linear(2, 2), torch.device("cuda"))
    assert name == "sequential" and "only run sequentially" in reason
