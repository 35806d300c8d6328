"""The round loop (docs/architecture.md, "The flow of one experiment").

Each round r = 1..R: sample clients -> broadcast -> local training (executor) -> aggregate ->
evaluate (every ``eval_every`` rounds and at the last) -> log -> checkpoint (every
``checkpoint_every`` rounds). The loop knows no algorithm by name: it calls the hooks.

Every random draw is a function of ``(seed, round, client)`` (:mod:`fl_core.seeding`), so a run
resumed from a checkpoint ends with exactly the parameters of an uninterrupted run.
"""

from __future__ import annotations

import math
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Protocol, Tuple

import torch
import torch.nn.functional as F

from ..store import durable, faults
from ..algorithms.base import Algorithm, PostTraining, RoundContext
from ..data.sampling import sample_clients
from ..seeding import derive_seed
from . import diskstate, gcpause
from .diagnostics import client_loss_trace, layer_cosine, update_drift
from .executors import NonFiniteLossError
from .localwork import LocalWork, RoundWork, plan_round
from .probes import neuron_drift
from .state import ClientStateStore, ParamSpec, flatten_params, load_flat

CHECKPOINT_VERSION = 1


class RunLogger(Protocol):
    """Where per-round metrics go (MLflow in :mod:`fl_core.store.tracking`; tests may pass their own)."""

    def open(self, saved: Optional[dict]) -> None: ...
    def state(self) -> dict: ...
    def log_round(self, step: int, metrics: Dict[str, float]) -> None: ...
    def flush(self) -> None: ...
    def close(self, status: str, reason: Optional[str] = None) -> None: ...


class NullLogger:
    def open(self, saved):
        pass

    def state(self):
        return {}

    def log_round(self, step, metrics):
        pass

    def flush(self):
        pass

    def close(self, status, reason=None):
        pass


class RunFailed(RuntimeError):
    """The run ended as FAILED; the message is the one-line reason, ``history`` the rounds run until then, ``cause``
    the exception that ended it (a :class:`~.executors.NonFiniteLossError`, or in a population the
    :class:`~fl_core.algorithms.base.InfeasibleSetting` of this replica's rule), if any."""

    def __init__(self, reason: str, history: Optional[List[Dict[str, float]]] = None,
                 cause: Optional[BaseException] = None):
        super().__init__(reason)
        self.history = list(history or [])
        self.cause = cause


class RunStopped(RunFailed):
    """The run was stopped by its caller before its last round (a replica a sweep's pruner stopped,
    :func:`~.population.run_together`); its logger's run is closed KILLED with the reason, no checkpoint is kept."""


@dataclass
class RunResult:
    history: List[Dict[str, float]]  # one row per round: round, test_acc, test_loss, train_loss, ...
    final_flat: torch.Tensor  # [d] final model as evaluated (ServerStep.evaluate: the global model for most rules)
    state_dict: Dict[str, torch.Tensor]
    resumed_from: int = 0  # round of the checkpoint the run resumed from (0: fresh)
    extra: Dict[str, Any] = field(default_factory=dict)


def client_accuracy(correct_per_class, count_per_class, client_label_counts) -> torch.Tensor:
    """Accuracy of the model on each client's own label distribution: the test set reweighted by the
    client's label histogram (as FLGo and PFLlib report per-client accuracy of the global model).

    ``a_k = sum_c h_k(c) acc_c`` with ``acc_c = correct_c / count_c`` the per-class test accuracy and
    ``h_k`` client k's training label counts normalised to sum 1 over the classes present in the test
    set (a class absent from the test set contributes nothing; its weight is dropped and the rest
    renormalised). A client whose training labels are all absent from the test set (or that holds no
    sample) gets NaN.

    Args:
        correct_per_class: [C] correctly classified test samples per class.
        count_per_class: [C] test samples per class.
        client_label_counts: [N, C] training samples of class c held by client k (counts, not fractions).

    Returns:
        float64 [N] on the CPU: a_k as fractions in [0, 1] (NaN as above).
    """
    correct = torch.as_tensor(correct_per_class).detach().to("cpu", torch.float64)
    count = torch.as_tensor(count_per_class).detach().to("cpu", torch.float64)
    hist = torch.as_tensor(client_label_counts).detach().to("cpu", torch.float64)
    present = count > 0
    acc = torch.where(present, correct / count.clamp(min=1.0), torch.zeros_like(count))
    w = hist * present  # [N, C]: weights of the classes the test set has
    return (w * acc).sum(1) / w.sum(1)


def client_acc_summary(acc: torch.Tensor) -> Dict[str, float]:
    """``client_acc_mean`` / ``client_acc_std`` / ``client_acc_worst10`` of the per-client accuracies
    ``acc`` [N] (fractions, :func:`client_accuracy`).

    mean: unweighted mean over the clients; std: sample standard deviation (ddof = 1; 0.0 for a single
    client); worst10: mean of the ceil(0.1 N) lowest. NaN entries (clients without a weight on the test
    classes) are left out; {} if none is left.
    """
    a = acc[~torch.isnan(acc)].to(torch.float64)
    n = int(a.numel())
    if n == 0:
        return {}
    k = -(-n // 10)  # ceil(0.1 n) in integers (0.1 * 30 is 3.0000000000000004 in floats)
    return {"client_acc_mean": float(a.mean()),
            "client_acc_std": float(a.std(correction=1)) if n > 1 else 0.0,
            "client_acc_worst10": float(torch.sort(a).values[:k].mean())}


@torch.no_grad()
def evaluate(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int,
             client_label_counts: Optional[torch.Tensor] = None) -> Dict[str, float]:
    """Accuracy (fraction in [0, 1]) and mean cross-entropy of ``model`` on ``x`` [M, C, H, W], ``y`` [M].

    With ``client_label_counts`` [N, num_classes] (training label counts per client) the same pass also
    counts correct predictions per class and adds ``client_acc_mean``, ``client_acc_std`` and
    ``client_acc_worst10`` (fractions; :func:`client_accuracy`, :func:`client_acc_summary`).
    """
    model.eval()
    loss = torch.zeros((), dtype=torch.float64, device=x.device)
    correct = torch.zeros((), dtype=torch.long, device=x.device)
    per_class = client_label_counts is not None
    if per_class:
        nc = int(client_label_counts.shape[1])
        tally = torch.zeros(2 * nc, dtype=torch.long, device=x.device)  # [2c]: misses of c, [2c + 1]: hits
    for s in range(0, x.shape[0], batch_size):
        logits = model(x[s:s + batch_size])
        t = y[s:s + batch_size]
        loss += F.cross_entropy(logits, t, reduction="sum").double()
        hit = logits.argmax(1) == t
        correct += hit.sum()
        if per_class:  # integer index_add: exact, no host sync
            tally.index_add_(0, 2 * t + hit.long(), torch.ones_like(t))
    model.train()
    n = max(1, x.shape[0])
    out = {"test_acc": float(correct) / n, "test_loss": float(loss) / n}
    if per_class:
        tally = tally.view(nc, 2).cpu()
        out.update(client_acc_summary(client_accuracy(tally[:, 1], tally.sum(1), client_label_counts)))
    return out


@dataclass
class RoundStart:
    """Round ``round`` up to local training (:meth:`Simulator.start_round`)."""

    round: int
    t0: float  # time.perf_counter() when the round began
    lr: float  # eta_l of the round
    sampled: List[int]  # the sampled clients
    work: Optional[RoundWork]  # the round's local-work plan (None without one)
    clients: List[int]  # the clients that train (the sampled ones less dropped stragglers)
    rctx: RoundContext  # what they receive


class Simulator:
    """Runs R rounds of one algorithm for one seed, with checkpoints and resume.

    Args:
        model: the model (its parameters are overwritten by the seeded initialisation or the checkpoint).
        algorithm: the (possibly wrapped) algorithm.
        executor: an executor built on the same model/algorithm (``run_round``).
        x_test, y_test: test tensors on the device.
        num_clients, participation, sampler: client sampling (docs/algorithms.md, Client sampling).
        rounds, lr, lr_decay, eval_every, eval_batch_size: the schedule.
        seed: the run seed.
        checkpoint_path: file for the round state (None: no checkpoints); ``checkpoint_every`` in rounds.
        logger: a :class:`RunLogger`.
        callbacks: called as ``cb(round, row)`` after each round is logged (progress bars, tests).
        neuron_drift_samples: ``tracking.neuron_drift_samples`` (> 0: the neuron-drift probe).
        layer_cosine: ``tracking.layer_cosine``: log ``cos_<layer>`` and ``cos_mean`` every round
            (:func:`~fl_core.engine.diagnostics.layer_cosine`).
        drift_every: ``tracking.drift`` = k > 0: the drift measures every k rounds (and the last), 0 never
            (:func:`~fl_core.engine.diagnostics.update_drift`).
        client_loss_trace: ``tracking.client_loss_trace`` = n > 0: log ``client_loss/<i>`` of the clients
            i < n that trained, and ``train_loss_clients_min`` / ``_max``
            (:func:`~fl_core.engine.diagnostics.client_loss_trace`).
        client_label_counts: [num_clients, num_classes] training label counts of each client (the
            partition's label histogram), or None. Given, every evaluation also logs ``client_acc_mean``,
            ``client_acc_std`` and ``client_acc_worst10``: the global model's accuracy on each client's
            label distribution (test set reweighted by the client's label histogram, as FLGo / PFLlib
            report), summarised over clients (:func:`evaluate`); the post-training step logs them as
            ``post_client_acc_*``.
        client_state: where per-client states live: ``memory`` or ``disk`` (:mod:`~.diskstate`, beside the
            checkpoint); ``engine.client_state=auto`` is resolved by the factory (:func:`~.diskstate.choose`).
        local_work: drawn local epochs and stragglers (:class:`~.localwork.LocalWork`), or None: every client
            runs the executor's E. Each round's plan (:func:`~.localwork.plan_round`) sets ``RoundContext.epochs``;
            dropped stragglers are left out of the round as if not sampled (``RoundContext.sampled`` is then the
            clients that train), except that they received the broadcast: the per-participant uplink and
            downlink are means over all sampled clients, a dropped one sending nothing. The row gets
            ``stragglers`` (their count) when ``local_work.stragglers`` > 0.

    Every row has ``local_steps_mean`` / ``_min`` / ``_max``: the local steps K_i of the round's aggregated clients,
    and the model's ``objective_metrics`` of the new global model (``FLModel``; none for most models).
    """

    def __init__(self, *, model, algorithm: Algorithm, executor, x_test, y_test, num_clients: int,
                 participation: float, sampler: str, rounds: int, lr: float, lr_decay: float = 1.0,
                 eval_every: int = 1, eval_batch_size: int = 1024, seed: int = 0,
                 checkpoint_path: Optional[Path] = None, checkpoint_every: int = 0,
                 logger: Optional[RunLogger] = None,
                 callbacks: Optional[List[Callable[[int, Dict[str, float]], None]]] = None,
                 neuron_drift_samples: int = 0, layer_cosine: bool = False, client_loss_trace: int = 0,
                 client_label_counts=None, client_state: str = "memory", local_work: Optional[LocalWork] = None,
                 drift_every: int = 0):
        self.model = model
        self.algo = algorithm
        self.executor = executor
        self.x_test, self.y_test = x_test, y_test
        self.num_clients, self.participation, self.sampler = num_clients, participation, sampler
        self.rounds, self.lr, self.lr_decay = rounds, lr, lr_decay
        self.eval_every, self.eval_batch_size = eval_every, eval_batch_size
        self.seed = seed
        self.checkpoint_path = Path(checkpoint_path) if checkpoint_path else None
        self.checkpoint_every = checkpoint_every
        self.logger = logger or NullLogger()
        self.callbacks = list(callbacks or [])
        if client_state not in ("memory", "disk"):
            raise ValueError(f"client_state must be memory or disk (the factory resolves auto), got {client_state!r}")
        self.client_state = client_state
        self.local_work = local_work if local_work is not None and local_work.varies else None
        self.count_stragglers = local_work is not None and local_work.stragglers > 0
        self.client_state_reason = f"client_state={client_state}"  # the factory says why (engine.client_state)
        self.replica_key: Optional[str] = None  # what a population's replicas share (factory.replica_key)
        self.neuron_drift_samples = neuron_drift_samples
        self.layer_cosine = bool(layer_cosine)
        if int(drift_every) < 0:
            raise ValueError(f"tracking.drift must be >= 0, got {drift_every}")
        self.drift_every = int(drift_every)
        self.client_loss_trace = int(client_loss_trace)
        self.client_label_counts: Optional[torch.Tensor] = None  # float64 [N, C] on the CPU
        if client_label_counts is not None:
            counts = torch.as_tensor(client_label_counts).detach().to("cpu", torch.float64)
            if counts.dim() != 2 or counts.shape[0] != num_clients:
                raise ValueError(f"client_label_counts must be [num_clients={num_clients}, num_classes], "
                                 f"got {tuple(counts.shape)}")
            self.client_label_counts = counts
        self.spec = ParamSpec.from_model(model)
        self.device = next(model.parameters()).device
        data = getattr(executor, "data", None)
        self.mean_client_size = (sum(data.size(i) for i in range(num_clients)) / num_clients) if data else 1.0
        self._restored: Optional[dict] = None  # state loaded by restore(), consumed by run()
        self._saved = False  # a checkpoint was written by this process

    # ------------------------------------------------------------------ state
    def _fresh_state(self) -> dict:
        torch.manual_seed(derive_seed("init", self.seed))
        for m in self.model.modules():
            if m is not self.model and hasattr(m, "reset_parameters"):
                m.reset_parameters()
        if hasattr(self.model, "init_parameters"):  # the model's own init over its layers' (FLModel.init_parameters)
            self.model.init_parameters()
        g = flatten_params(self.model).to(self.device)
        return {"round": 0, "global": g, "server": self.algo.init_server_state(g), "clients": {},
                "history": [], "comm_up": 0.0, "comm_down": 0.0, "logger": None}

    @staticmethod
    def _eval_model(st: dict) -> torch.Tensor:
        """The model [d] evaluated after the last round: the rule's (``ServerStep.evaluate``) or the global one."""
        return st["global"] if st.get("eval") is None else st["eval"]

    def _save(self, st: dict, store: ClientStateStore) -> None:
        """Write the round's checkpoint (:func:`fl_core.store.durable.save`). It holds only tensors and plain Python values
        (the history rows' numbers are floats and ints, the logger's state strings), as :func:`fl_core.store.durable.load`
        reads it with the weights-only loader."""
        if self.checkpoint_path is None:
            return
        if not self._saved:
            faults.point("before_first_checkpoint")
        durable.save({"version": CHECKPOINT_VERSION, "round": st["round"], "global": st["global"].cpu(),
                      "server": {k: v.cpu() for k, v in st["server"].items()},
                      "clients": store.state_dict(), "history": st["history"],
                      "comm_up": st["comm_up"], "comm_down": st["comm_down"],
                      "eval": None if st.get("eval") is None else st["eval"].cpu(),
                      "logger": self.logger.state(), "torch_rng": torch.get_rng_state()},
                     self.checkpoint_path)
        self._saved = True

    @staticmethod
    def _checkpoint_problem(ck: Any) -> Optional[str]:
        """None if ``ck`` is a checkpoint this version can resume from, else why not."""
        if not isinstance(ck, dict):
            return "not a checkpoint"
        if ck.get("version") != CHECKPOINT_VERSION:
            return f"checkpoint version {ck.get('version')!r}, this code writes {CHECKPOINT_VERSION}"
        missing = {"round", "global", "server", "clients", "history", "torch_rng"} - set(ck)
        return f"missing {', '.join(sorted(missing))}" if missing else None

    def _load(self) -> Optional[dict]:
        """The newest readable checkpoint (its ``.prev`` if the newest is unreadable; each unreadable
        file is moved aside as ``*.corrupt`` with a warning line), or None: start from scratch."""
        if self.checkpoint_path is None:
            return None
        ck = durable.load(self.checkpoint_path, self._checkpoint_problem)
        if ck is None:
            return None
        ck["global"] = ck["global"].to(self.device)
        ck["server"] = {k: v.to(self.device) for k, v in ck["server"].items()}
        if ck.get("eval") is not None:
            ck["eval"] = ck["eval"].to(self.device)
        torch.set_rng_state(ck.pop("torch_rng"))
        return ck

    def restore(self) -> int:
        """Load the checkpoint (if any) now; returns the round it resumes from (0: a fresh run).

        :meth:`run` calls it itself; call it first to learn the resume round before training."""
        if self._restored is None:
            self._restored = self._load() or self._fresh_state()
        return int(self._restored["round"])

    # ------------------------------------------------------------------ loop
    def _diagnostics(self, start: "RoundStart", updates) -> Dict[str, float]:
        """The per-round diagnostics that are switched on (docs/algorithms.md, Drift measures, Layer cosine
        similarity and Client loss trace); {} (no work) when none is."""
        out: Dict[str, float] = {}
        r = start.round
        if self.drift_every and updates and (r % self.drift_every == 0 or r == self.rounds):
            out.update(update_drift([u.delta for u in updates], start.rctx.global_flat,
                                    [u.num_samples for u in updates], [u.num_steps for u in updates], start.lr,
                                    self.spec))
        if self.layer_cosine:
            out.update(layer_cosine(torch.stack([u.delta for u in updates]), self.spec))
        if self.client_loss_trace:
            out.update(client_loss_trace(updates, self.client_loss_trace))
        return out

    def run(self) -> RunResult:
        """Run (or resume) the rounds.

        The objects alive when the run starts are kept out of Python's garbage collections until it ends
        (:func:`.gcpause.frozen_heap`; again after the first round), so no round pays for a collection over the whole process's heap.

        Raises:
            RunFailed: non-finite loss; the logger's run is closed as FAILED with the reason.
        """
        with gcpause.frozen_heap():
            return self._run()

    def begin(self) -> Tuple[dict, ClientStateStore, int]:
        """Resume (or start): the round state, the client-state store and the round resumed from, the logger
        opened. :meth:`run` and a population (:mod:`.population`) begin here."""
        resumed_from = self.restore()
        st, self._restored = self._restored, None
        store = self._open_store(st)
        self.logger.open(st.get("logger"))
        return st, store, resumed_from

    def fail(self, st: dict, store: ClientStateStore, err: Exception) -> RunFailed:
        """The run ends FAILED on ``err`` (:meth:`_close_failed`; a :class:`NonFiniteLossError`, or an
        ``InfeasibleSetting`` of a replica in a population); the :class:`RunFailed` to raise or report."""
        self._close_failed(store, str(err))
        return RunFailed(str(err), st["history"], err)

    def stop(self, st: dict, store: ClientStateStore, reason: str) -> RunStopped:
        """Its caller ends the run before its last round (``reason``: why): the store closed, the logger's run closed
        KILLED with the reason, the checkpoint dropped; the :class:`RunStopped` to report."""
        getattr(store, "close", lambda: None)()
        self.logger.flush()
        self.logger.close("KILLED", reason)
        self.discard_checkpoint()
        return RunStopped(reason, st["history"])

    def _run(self) -> RunResult:
        """Resume (or start), run rounds ``st["round"] + 1 .. R``, then the post-training step and the result."""
        st, store, resumed_from = self.begin()
        try:
            for r in range(st["round"] + 1, self.rounds + 1):
                self._round(r, st, store)
                if r == resumed_from + 1:  # the first round imported what it uses: freeze it too
                    gcpause.refreeze()
        except NonFiniteLossError as err:
            raise self.fail(st, store, err) from None
        return self.finish_run(st, store, resumed_from)

    def _round(self, r: int, st: dict, store: ClientStateStore) -> None:
        """Round r: sample, broadcast, train, aggregate, the round's row (metrics, evaluation), log, checkpoint."""
        start = self.start_round(r, st)
        self.end_round(start, st, store, self.executor.run_round(start.rctx, start.clients, store))

    def start_round(self, r: int, st: dict) -> "RoundStart":
        """Round r up to local training: its clock, eta_l, the sampled clients, the local-work plan and what the
        clients receive (:meth:`_sample`, :meth:`_broadcast`). A population (:mod:`.population`) trains the
        clients of several replicas' starts in one pass, then ends each replica's round with :meth:`end_round`."""
        t0 = time.perf_counter()
        lr = self.lr * self.lr_decay ** (r - 1)
        sampled, work, clients = self._sample(r)
        return RoundStart(r, t0, lr, sampled, work, clients, self._broadcast(r, lr, st, clients, work))

    def end_round(self, start: "RoundStart", st: dict, store: ClientStateStore, updates) -> None:
        """Round ``start.round`` after local training: aggregate ``updates``, the round's row (metrics,
        evaluation), log, checkpoint.

        Raises:
            NonFiniteLossError: the evaluated model's test loss is not finite.
        """
        r, rctx = start.round, start.rctx
        diag = self._diagnostics(start, updates)  # before aggregate: the uploaded updates as they are
        step = self._aggregate(rctx, st, updates, len(start.sampled))
        row = self._round_row(r, start.lr, st, updates, start.work, step, diag)
        self._probe_row(row, st, rctx, updates)
        self._evaluate_round(r, st, row)
        self._record_round(r, st, store, row, start.t0)

    def _sample(self, r: int) -> Tuple[List[int], Optional[RoundWork], List[int]]:
        """The clients sampled in round r, the round's local-work plan (None without one) and the clients that
        train (the sampled ones less dropped stragglers)."""
        sampled = sample_clients(self.num_clients, self.participation, self.sampler, self.seed, r).tolist()
        work = plan_round(self.local_work, self.seed, r, sampled) if self.local_work else None
        clients = list(work.train) if work else sampled
        return sampled, work, clients

    def _broadcast(self, r: int, lr: float, st: dict, clients: List[int], work: Optional[RoundWork]) -> RoundContext:
        """What the clients of round r receive: the global model and the rule's broadcast (``algo.broadcast``)."""
        return RoundContext(round=r, lr=lr, lr0=self.lr, global_flat=st["global"], spec=self.spec,
                            num_clients=self.num_clients, mean_client_size=self.mean_client_size,
                            sampled=tuple(clients), seed=self.seed, extra=self.algo.broadcast(st["server"]),
                            epochs=dict(work.epochs) if work else {})

    def _aggregate(self, rctx: RoundContext, st: dict, updates, num_sampled: int):
        """The rule's server step over ``updates`` into ``st`` (global model, server state, evaluated model) and
        the round's communication; returns the step (its ``metrics``)."""
        step = self.algo.aggregate(rctx, st["server"], updates)
        st["global"], st["server"], st["eval"] = step.model, step.state, step.evaluate
        # what was sent, per participating client: the mean upload over the round's sampled clients (their
        # messages, ClientUpdate.sent; a dropped straggler sends nothing) and the broadcast (the model and
        # the rule's extra vectors)
        st["comm_up"] += sum(u.up_floats() for u in updates) / num_sampled
        st["comm_down"] += self.spec.d + sum(float(v.numel()) for v in rctx.extra.values())
        return step

    def _round_row(self, r: int, lr: float, st: dict, updates, work: Optional[RoundWork], step,
                   diag: Dict[str, float]) -> Dict[str, float]:
        """The round's metrics: training loss, communication, local steps, stragglers, the step's and the
        diagnostics'."""
        steps = [u.num_steps for u in updates]
        row: Dict[str, float] = {
            "round": r,
            "train_loss": sum(u.train_loss for u in updates) / len(updates),
            "lr": lr, "num_clients": len(updates),
            "comm_up_floats": st["comm_up"], "comm_down_floats": st["comm_down"],
            "local_steps_mean": sum(steps) / len(steps), "local_steps_min": min(steps),
            "local_steps_max": max(steps),
        }
        if self.count_stragglers:
            row["stragglers"] = len(work.stragglers)
        row.update(step.metrics)
        row.update(diag)
        return row

    def _probe_row(self, row: Dict[str, float], st: dict, rctx: RoundContext, updates) -> None:
        """Adds the model's objective metrics of the new global model and the neuron-drift probe where on."""
        if hasattr(self.model, "objective_metrics"):  # the model's own, e.g. f(x_r) - f* of a convex problem
            row.update(self.model.objective_metrics(self.spec.views(st["global"])))
        if self.neuron_drift_samples and hasattr(self.model, "neuron_layers"):
            n = self.neuron_drift_samples
            data = self.executor.data
            row.update(neuron_drift(self.model, load_flat, rctx.global_flat, updates, data.label_counts,
                                    self.x_test[:n], self.y_test[:n], data.num_classes))

    def _evaluate_round(self, r: int, st: dict, row: Dict[str, float]) -> None:
        """Every ``eval_every`` rounds and at the last: the test metrics of the evaluated model into ``row``; a
        non-finite test loss raises :class:`NonFiniteLossError`."""
        if r % self.eval_every == 0 or r == self.rounds:
            load_flat(self.model, self._eval_model(st))
            row.update(evaluate(self.model, self.x_test, self.y_test, self.eval_batch_size,
                                self.client_label_counts))
            if not math.isfinite(row["test_loss"]):
                raise NonFiniteLossError(f"non-finite test loss in round {r}")

    def _record_round(self, r: int, st: dict, store: ClientStateStore, row: Dict[str, float], t0: float) -> None:
        """Round r done: its row into the history and the logger, a checkpoint every ``checkpoint_every`` rounds
        (not after the last), the callbacks."""
        row["round_time_s"] = time.perf_counter() - t0
        st["history"].append(row)
        st["round"] = r
        self.logger.log_round(r, {k: v for k, v in row.items() if k != "round"})
        if self.checkpoint_every and r % self.checkpoint_every == 0 and r < self.rounds:
            self.logger.flush()
            self._save(st, store)
        for cb in self.callbacks:
            cb(r, row)

    def _close_failed(self, store: ClientStateStore, reason: str) -> None:
        """A failed run: close the store, the logger's run as FAILED with ``reason``, and drop the checkpoint."""
        getattr(store, "close", lambda: None)()
        self.logger.flush()
        self.logger.close("FAILED", reason)
        self.discard_checkpoint()

    def finish_run(self, st: dict, store: ClientStateStore, resumed_from: int) -> RunResult:
        """After the last round: the post-training step, the logger flushed, the result (the store closed)."""
        final = self._post_training(st)
        self.logger.flush()
        load_flat(self.model, final)
        result = RunResult(st["history"], final.detach().cpu().clone(),
                           {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()},
                           resumed_from=resumed_from)
        getattr(store, "close", lambda: None)()
        return result

    def _post_training(self, st: dict) -> torch.Tensor:
        """The final model [d]: the rule's ``post_training`` result (evaluated and logged as ``post_*`` on the last
        round's row, once) or the evaluated model of the last round."""
        final = self._eval_model(st)
        data = getattr(self.executor, "data", None)
        post = self.algo.post_training(PostTraining(self.model, final, self.spec, data, self.seed,
                                                    getattr(data, "num_classes", 0)))
        if post is not None:  # e.g. a recalibrated classifier: evaluate and keep it
            final = post
            load_flat(self.model, final)
            ev = evaluate(self.model, self.x_test, self.y_test, self.eval_batch_size, self.client_label_counts)
            ev = {f"post_{k}": v for k, v in ev.items()}  # post_test_acc, post_test_loss, post_client_acc_*
            last = st["history"][-1]
            if "post_test_acc" not in last:
                last.update(ev)
                self.logger.log_round(int(last["round"]), ev)
        return final

    def discard_checkpoint(self) -> None:
        """Remove the checkpoint and its ``.prev`` (and a disk store's folder) once the run's result is safely
        recorded."""
        if self.checkpoint_path is not None:
            durable.remove(self.checkpoint_path)
            shutil.rmtree(self._states_folder(), ignore_errors=True)

    def _states_folder(self) -> Optional[Path]:
        """Where ``engine.client_state=disk`` keeps the states: beside the checkpoint (None without one)."""
        return None if self.checkpoint_path is None else self.checkpoint_path.with_name(
            self.checkpoint_path.name + ".states")

    def _open_store(self, st: dict):
        """The client-state store of ``client_state`` (``memory`` or ``disk``; the factory resolves ``auto`` with
        :func:`~.diskstate.choose`), holding the states of ``st["clients"]`` (a checkpoint of either kind of store
        is read into either kind)."""
        saved = st["clients"]
        on_disk = diskstate.DISK_KEY in saved
        disk = self.client_state == "disk"
        store = diskstate.DiskClientStateStore(self.num_clients, self._states_folder()) if disk \
            else ClientStateStore("cpu")
        if on_disk == disk or not saved:
            store.load_state_dict(saved)
            return store
        if not on_disk:  # a memory checkpoint into the disk store
            for cid, state in saved.items():
                store.put(int(cid), state)
            return store
        source = diskstate.DiskClientStateStore(self.num_clients, Path(saved[diskstate.DISK_KEY]["folder"]))
        source.load_state_dict(saved)
        for cid, state in source.items():  # a disk checkpoint into the memory store
            store.put(cid, state)
        source.close()
        return store
