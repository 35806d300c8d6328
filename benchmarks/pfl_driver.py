#!/usr/bin/env python
"""The pfl-research side of ``benchmarks/pfl_cifar.py``: FedAvg rounds simulated by pfl-research itself.

Run by ``pfl_cifar.py --pfl PYTHON`` with that interpreter (a virtual environment holding ``pfl`` and ``torch``; the
project's own environment need not have ``pfl``), never imported by the project. It uses pfl's public API only:
``FederatedDataset.from_slices`` with the ``random`` user sampler, ``PyTorchModel`` with ``torch.optim.SGD`` as the
local optimiser and ``torch.optim.SGD(lr=eta_g)`` as the central one, ``SimulatedBackend`` (every user of a cohort
trained one after another in this process), ``WeightByUser`` (each user's update weighs 1, the ``weight_by_samples:
false`` of pfl-research's CIFAR-10 config), ``FederatedAveraging`` with ``NNAlgorithmParams`` and
``NNTrainHyperParams``. The network is the project's :class:`fl_core.models.cnn.PflCNN` (pfl-research's CIFAR-10 CNN;
importing it needs only torch), loaded with the initial weights the caller saved, wrapped in the ``loss`` /
``metrics`` methods that pfl's ``PyTorchModel`` calls.

Input (``--data``, written by ``pfl_cifar.py`` with ``torch.save``): a dict with ``x`` uint8 ``[N, C, H, W]`` raw
images, ``y`` int64 ``[N]``, ``scale``, ``mean`` and ``std`` (per channel, of ``x / scale``), ``users`` int64 ``[U, n]``
(each user's sample indices), ``num_classes`` and ``init`` (the network's initial ``state_dict``).

Output: one JSON line on stdout, last: ``times`` (seconds of each timed round: between the ends of consecutive
central iterations, measured in pfl's ``after_central_iteration`` callback), ``cpu_times`` (the process's CPU seconds,
``time.process_time``, over the same intervals), ``pfl`` and ``torch`` versions, torch
``threads``, ``moved`` (L2 norm of the change of the global parameters over all rounds: training happened).

Timing: ``--warmup`` central iterations, then ``--rounds`` timed ones. pfl evaluates the cohort before and after local
training in iteration 0 (``0 % evaluation_frequency == 0``); the frequency is set past the last iteration, so that
happens in the warm-up only. No central evaluation, no privacy mechanism, no metrics written.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("PFL_PYTORCH_DEVICE", "cpu")  # pfl's device choice: the CPU, as the project's rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="FedAvg rounds of pfl-research on the data pfl_cifar.py saved "
                                            "(seconds per round as one JSON line)")
    p.add_argument("--data", type=Path, required=True, help="the torch.save file written by pfl_cifar.py")
    p.add_argument("--project-root", type=Path, required=True, help="the project's root (for fl_core.models.cnn)")
    p.add_argument("--rounds", type=int, required=True, help="timed central iterations")
    p.add_argument("--warmup", type=int, required=True, help="untimed central iterations before them (>= 1)")
    p.add_argument("--cohort", type=int, required=True, help="users per central iteration")
    p.add_argument("--epochs", type=int, required=True, help="local epochs E")
    p.add_argument("--batch-size", type=int, required=True, help="local batch size B")
    p.add_argument("--lr", type=float, required=True, help="local learning rate eta_l")
    p.add_argument("--eta-g", type=float, required=True, help="central (server) learning rate")
    p.add_argument("--seed", type=int, default=0, help="numpy and torch seed (pfl samples users with numpy)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    args = p.parse_args(argv)
    if args.warmup < 1 or args.rounds < 1:
        p.error("--warmup and --rounds must be >= 1")

    import numpy as np
    import torch
    import torch.nn.functional as F

    import pfl.version
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.aggregate.weighting import WeightByUser
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.callback.base import TrainingProcessCallback
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.data.sampling import get_user_sampler
    from pfl.hyperparam import NNTrainHyperParams
    from pfl.metrics import Metrics, Weighted
    from pfl.model.pytorch import PyTorchModel

    sys.path.insert(0, str(args.project_root))
    from fl_core.models.cnn import PflCNN

    if args.threads:
        torch.set_num_threads(args.threads)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    blob = torch.load(args.data, weights_only=True)
    shape = (-1, 1, 1)
    mean = torch.tensor(blob["mean"], dtype=torch.float32).view(shape)
    std = torch.tensor(blob["std"], dtype=torch.float32).view(shape)
    x = (blob["x"].to(torch.float32) / float(blob["scale"]) - mean) / std  # as FLDataset.normalize
    y = blob["y"]
    users = blob["users"]
    slices = {u: (x[users[u]], y[users[u]]) for u in range(users.shape[0])}
    federated = FederatedDataset.from_slices(slices, get_user_sampler("random", list(slices)))

    class Net(torch.nn.Module):
        """PflCNN with the ``loss`` and ``metrics`` pfl's PyTorchModel calls."""

        def __init__(self):
            super().__init__()
            self.net = PflCNN(tuple(x.shape[1:]), int(blob["num_classes"]))
            self.net.load_state_dict(blob["init"])

        def forward(self, inputs):
            return self.net(inputs)

        def loss(self, inputs, targets, eval=False):  # noqa: A002 (pfl's keyword)
            self.eval() if eval else self.train()
            return F.cross_entropy(self(inputs), targets)

        @torch.no_grad()
        def metrics(self, inputs, targets, eval=True):  # noqa: A002
            self.eval() if eval else self.train()
            logits = self(inputs)
            n = len(inputs)
            return {"loss": Weighted(F.cross_entropy(logits, targets, reduction="sum").item(), n),
                    "accuracy": Weighted((logits.argmax(-1) == targets).sum().item(), n)}

    net = Net()
    start = torch.cat([q.detach().flatten().clone() for q in net.parameters()])
    model = PyTorchModel(model=net, local_optimizer_create=torch.optim.SGD,
                         central_optimizer=torch.optim.SGD(net.parameters(), args.eta_g))
    backend = SimulatedBackend(training_data=federated, val_data=None, postprocessors=[WeightByUser()])
    stamps, cpu = [], []

    class Stamp(TrainingProcessCallback):
        def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
            stamps.append(time.perf_counter())
            cpu.append(time.process_time())
            print(f"  pfl-research round {central_iteration + 1}: "
                  + (f"{1e3 * (stamps[-1] - stamps[-2]):.0f} ms" if len(stamps) > 1 else "done"),
                  file=sys.stderr, flush=True)
            return False, Metrics()

    iterations = args.warmup + args.rounds
    FederatedAveraging().run(
        algorithm_params=NNAlgorithmParams(central_num_iterations=iterations, evaluation_frequency=iterations + 1,
                                           train_cohort_size=args.cohort, val_cohort_size=0),
        backend=backend, model=model,
        model_train_params=NNTrainHyperParams(local_learning_rate=args.lr, local_num_epochs=args.epochs,
                                              local_batch_size=args.batch_size),
        model_eval_params=None, callbacks=[Stamp()])
    times = [b - a for a, b in zip(stamps[args.warmup - 1:], stamps[args.warmup:])]
    cpu_times = [b - a for a, b in zip(cpu[args.warmup - 1:], cpu[args.warmup:])]
    moved = float((torch.cat([q.detach().flatten() for q in net.parameters()]) - start).norm())
    print(json.dumps({"times": times, "cpu_times": cpu_times, "pfl": pfl.version.__version__, "torch": torch.__version__,
                      "threads": torch.get_num_threads(), "moved": moved}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
