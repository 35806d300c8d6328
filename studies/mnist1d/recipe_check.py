"""MNIST-1D federated FedAvg: the project's engine against a plain PyTorch loop of the same recipe, one detail at a time.

The recipe (docs/algorithms.md, MNIST-1D): the MNIST-1D CNN (``m1d_cnn``), 100 clients, per-class Dirichlet
alpha = 0.1 without the balancing cap (``partition.balance_cap=false``, ``partition.min_size=1``), 10 clients per
round without replacement, plain SGD eta_l = 0.05, B = 32, E = 1, R = 2000 rounds, FedAvg weighted by client size.

``--impl engine`` trains it with the project (:func:`pipeline.api.run`, the seeds of a partition as one population);
``--impl plain`` with a loop written here in plain PyTorch: the same data arrays, and either the project's partition
(``--partition project``) or a per-class Dirichlet split drawn here with NumPy (``--partition plain``). The plain
loop's details can be switched one at a time: ``--drop-last`` (no last partial batch), ``--fixed-order`` (the same
batch order every epoch), ``--weights uniform`` (plain mean of the uploads), ``--tie-seeds`` (the partition drawn
with the training seed, as a loop with one ``seed`` does, instead of partition seed P for every training seed).

Prints one CSV line per run: impl, variant, partition seed, training seed, final accuracy (last round), the mean
of the last 5 rounds (fractions) and a digest of the final model. ``--same-draws`` gives the plain loop the project's
random draws (initial model, clients, batches) and nothing else: its digest then equals the project's sequential
executor's, bit for bit; ``--draws`` takes one or two of the three (``init``, ``sampling``, ``batches``) to find
which stream a difference comes from. Usage (from the project root)::

    .venv/bin/python studies/mnist1d/recipe_check.py --impl plain --partition project --partition-seeds 0 1 2 \\
        --seeds 1 2 3 >> studies/mnist1d/results/findings_recipe.csv
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from typing import List

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

RECIPE = ["dataset=mnist1d", "model=m1d_cnn", "algorithm=fedavg", "partition=dirichlet", "partition.variant=per_class",
          "partition.alpha=0.1", "partition.balance_cap=false", "partition.min_size=1", "partition.num_clients=100",
          "train.participation=0.1", "train.sampler=fixed", "train.lr=0.05", "train.batch_size=32",
          "train.local_epochs=1", "engine.progress=false", "engine.checkpoint_every=0", "tracking.enabled=false"]
LAST = 5  # the final accuracy's window


def _cfg(rounds: int, partition_seed: int, seed: int = 1):
    from fl_core.config import compose

    return compose(RECIPE + [f"train.rounds={rounds}", f"partition.seed={partition_seed}", f"seed={seed}"])


def plain_partition(labels: np.ndarray, num_clients: int, alpha: float, seed: int, min_size: int = 1) -> List:
    """Per-class Dirichlet split written here: for each class, shares p ~ Dir(alpha 1_N) of its shuffled indices
    (no cap), redrawn until every client holds ``min_size`` samples."""
    rng = np.random.default_rng(seed)
    classes = np.unique(labels)
    while True:
        idx: List[List[int]] = [[] for _ in range(num_clients)]
        for c in classes:
            members = rng.permutation(np.flatnonzero(labels == c))
            p = rng.dirichlet(np.full(num_clients, alpha))
            cuts = (np.cumsum(p) * len(members)).astype(int)[:-1]
            for i, part in enumerate(np.split(members, cuts)):
                idx[i].extend(part.tolist())
        if min(len(x) for x in idx) >= min_size:
            return [np.array(sorted(x), dtype=np.int64) for x in idx]


STREAMS = ("init", "sampling", "batches")  # the project's random draws the plain loop can take, one at a time


def run_plain(ds, clients: List[np.ndarray], seed: int, rounds: int, drop_last: bool, fixed_order: bool,
              uniform: bool, draws: tuple = (), decorrelate: bool = False) -> tuple:
    """The plain loop; ``draws`` names the project's random draws it takes (``STREAMS``: the initial model's seed,
    each round's clients, each client's batches: fl_core's seeding, sampling and batch schedule) and nothing else of
    it; all three make it the project's sequential executor bit for bit. A stream it does not take is its own: the
    initial model drawn by ``torch.manual_seed(seed)``, the clients by a NumPy generator seeded with ``seed``, the
    batch orders by a torch generator seeded with ``seed`` (the init and batch streams then replay the same Mersenne
    Twister numbers), unless ``decorrelate`` seeds the batch generator and the client sampler with seed + 10,000 and
    seed + 20,000."""
    from fl_core.data.sampling import sample_clients
    from fl_core.engine.executors import batch_schedule
    from fl_core.models import build_model
    from fl_core.seeding import derive_seed

    cfg = _cfg(rounds, 0, seed)
    torch.manual_seed(derive_seed("init", seed) if "init" in draws else seed)
    model = build_model(cfg.model, "mnist1d", tuple(ds.x_train.shape[1:]), ds.num_classes)
    x, y = ds.x_train.float(), ds.y_train
    xt, yt = ds.x_test.float(), ds.y_test
    rng = np.random.default_rng(seed + (20_000 if decorrelate else 0))
    gen = torch.Generator().manual_seed(seed + (10_000 if decorrelate else 0))
    orders = {i: torch.randperm(len(c), generator=gen) for i, c in enumerate(clients)} if fixed_order else None
    local = copy.deepcopy(model)
    flat = torch.nn.utils.parameters_to_vector
    accs = []
    for r in range(1, rounds + 1):
        chosen = (sample_clients(len(clients), 0.1, "fixed", seed, r) if "sampling" in draws
                  else rng.choice(len(clients), size=10, replace=False))
        start_state = flat(model.parameters()).detach().clone()
        uploads, sizes = [], []
        for i in chosen:
            copy_into(start_state, local)
            opt = torch.optim.SGD(local.parameters(), lr=0.05)
            idx = torch.from_numpy(clients[i])
            order = orders[i] if fixed_order else torch.randperm(len(idx), generator=gen)
            batches = ([idx[pos] for pos in batch_schedule(seed, r, int(i), len(idx), 32, 1)] if "batches" in draws
                       else [idx[order[first:first + 32]] for first in range(0, len(idx), 32)])
            for b in batches:
                if drop_last and len(b) < 32:
                    break
                opt.zero_grad()
                F.cross_entropy(local(x[b]), y[b]).backward()
                opt.step()
            uploads.append(flat(local.parameters()).detach().clone())
            sizes.append(len(idx))
        w = (torch.full((len(sizes),), 1.0 / len(sizes), dtype=torch.float64) if uniform
             else torch.tensor(sizes, dtype=torch.float64) / sum(sizes))
        # theta + sum_i w_i (theta_i - theta), the weights in float64 as the project forms them
        deltas = torch.stack(uploads) - start_state
        new = start_state + (w.to(deltas.dtype) @ deltas)
        copy_into(new, model)
        if r > rounds - LAST:
            with torch.no_grad():
                accs.append(float((model(xt).argmax(1) == yt).float().mean()))
    return accs[-1], float(np.mean(accs)), digest(model.state_dict())


def copy_into(vec: torch.Tensor, module: torch.nn.Module) -> None:
    """Copy the flat vector ``vec`` into the module's own parameter tensors. Not
    ``torch.nn.utils.vector_to_parameters``: that makes the parameters views into ``vec`` at its offsets, and CPU
    kernels on such unaligned memory can round differently in the last bit (seen on a one-sample batch: 7e-9)."""
    with torch.no_grad():
        for p, v in zip(module.parameters(), torch.split(vec, [q.numel() for q in module.parameters()])):
            p.copy_(v.view_as(p))


def digest(state) -> str:
    """The first 12 hex digits of a SHA-256 over the model's tensors in name order (equal models, equal digests)."""
    import hashlib

    h = hashlib.sha256()
    for k in sorted(state):
        h.update(k.encode())
        h.update(state[k].detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()[:12]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--impl", choices=("engine", "plain"), required=True)
    ap.add_argument("--partition", choices=("project", "plain"), default="project")
    ap.add_argument("--partition-seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--rounds", type=int, default=2000)
    ap.add_argument("--drop-last", action="store_true")
    ap.add_argument("--fixed-order", action="store_true")
    ap.add_argument("--weights", choices=("size", "uniform"), default="size")
    ap.add_argument("--tie-seeds", action="store_true")
    ap.add_argument("--decorrelate", action="store_true", help="--impl plain: seed the batch orders and the client "
                    "sampling apart from the initial model's seed (seed + 10,000, seed + 20,000)")
    ap.add_argument("--same-draws", action="store_true", help="--impl plain: the project's initial model, clients "
                    "and batches (fl_core's seeding, sampling and batch schedule); the model's digest then equals "
                    "--impl engine --executor sequential's (= --draws init sampling batches)")
    ap.add_argument("--draws", nargs="+", choices=STREAMS, default=[], help="--impl plain: take only these of the "
                    "project's random draws (init: the initial model's seed; sampling: each round's clients; "
                    "batches: each client's batch orders), the others drawn by the plain loop")
    ap.add_argument("--executor", default="vectorized", help="--impl engine: engine.executor")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from fl_core.data.access import dataset_for
    from fl_core.data import make_partition

    ds = dataset_for(_cfg(args.rounds, 0), write_cache=False)
    if args.impl == "engine":
        from pipeline.api import run

        for p in args.partition_seeds:
            res = run(RECIPE + [f"train.rounds={args.rounds}", f"partition.seed={p}",
                                f"engine.executor={args.executor}"], seeds=args.seeds, progress=False)
            h = res.history
            for s in args.seeds:
                acc = h[h.seed == s].sort_values("round").test_acc.to_numpy()
                print(f"engine,{args.executor},{p},{s},{acc[-1]:.4f},{acc[-LAST:].mean():.4f},"
                      f"{digest(res.models[s])}", flush=True)
        return 0
    draws = tuple(STREAMS) if args.same_draws else tuple(d for d in STREAMS if d in args.draws)
    variant = "+".join([args.partition + "-partition"] + [n for n, on in (
        ("drop-last", args.drop_last), ("fixed-order", args.fixed_order), ("uniform", args.weights == "uniform"),
        ("tie-seeds", args.tie_seeds), ("decorrelate", args.decorrelate)) if on]
        + (["same-draws"] if draws == STREAMS else [f"project-{d}" for d in draws]))
    for p in args.partition_seeds:
        for s in args.seeds:
            pseed = s if args.tie_seeds else p
            if args.partition == "project":
                clients = make_partition(_cfg(args.rounds, pseed).partition, ds.y_train.numpy(),
                                         ds.num_classes).client_indices
            else:
                clients = plain_partition(ds.y_train.numpy(), 100, 0.1, pseed)
            last, mean5, dig = run_plain(ds, clients, s, args.rounds, args.drop_last, args.fixed_order,
                                         args.weights == "uniform", draws, args.decorrelate)
            print(f"plain,{variant},{pseed},{s},{last:.4f},{mean5:.4f},{dig}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
