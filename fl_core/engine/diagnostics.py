"""Per-round diagnostics of the IID -> non-IID study (docs/algorithms.md, The IID-to-non-IID study) and its
update measure.

Pure functions of a round's client updates; the simulator calls them only when the matching
``tracking.*`` switch is on, so they cost nothing otherwise:

- :func:`layer_cosine` (``tracking.layer_cosine``): layer-wise cosine similarity of the client updates,
  mean over client pairs [S2 Fig. 13];
- :func:`client_loss_trace` (``tracking.client_loss_trace``): local training losses of chosen clients [S2 Fig. 12];
- :func:`update_drift` (``tracking.drift``, on by default, every 5 rounds): client drift, update dissimilarity, the clients' cosine to
  their mean update (whole model and per layer) and the effective local progress (docs/algorithms.md, Drift
  measures);
- :func:`effective_update`: the effective update amount u of a configuration [S2 Eq. 3] (docs/algorithms.md,
  Effective update amount).
"""

from __future__ import annotations

import functools
import math
from typing import Dict, List, Sequence

import torch

from ..params import ParamSpec


def layer_groups(spec: ParamSpec) -> Dict[str, List[int]]:
    """Layer name -> indices (ParamSpec order) of its parameter tensors, layers in order of first appearance.

    A layer is a module: the parameter name up to its last dot (``conv1.weight`` + ``conv1.bias`` ->
    ``conv1``; ``layer1.0.conv1.weight`` -> ``layer1.0.conv1``); a name without a dot is its own layer.
    """
    groups: Dict[str, List[int]] = {}
    for j, name in enumerate(spec.names):
        groups.setdefault(name.rpartition(".")[0] or name, []).append(j)
    return groups


@torch.no_grad()
def layer_cosine(deltas: torch.Tensor, spec: ParamSpec) -> Dict[str, float]:
    """Mean pairwise cosine similarity of the clients' updates, per layer [S2 Fig. 13] (docs/algorithms.md,
    Layer cosine similarity).

    For each layer l (:func:`layer_groups`: weight and bias of one module together) and every pair
    i < j of the S clients, cos(Delta_i^l, Delta_j^l) = <Delta_i^l, Delta_j^l> / (|Delta_i^l| |Delta_j^l|),
    averaged over the pairs. Computed per layer as the Gram matrix of the S flattened layer updates
    (float64, summed over the layer's tensors) divided by the outer product of its diagonal's square
    roots; the mean is over the strict upper triangle.

    Zero updates: a pair in which either client's update of layer l has norm exactly 0 (a client that
    uploads only another block, a layer kept frozen all round, a layer a sparsifier sent nothing of)
    has no defined cosine and is left out of that layer's mean. A layer with no pair left (S < 2, or
    fewer than two clients moved it) gets no ``cos_<layer>`` key that round.

    Args:
        deltas: [S, d] the round's client updates Delta_i = theta_i - theta (as uploaded, after
            ``finish_client``), one row per participating client.
        spec: the model's :class:`~fl_core.engine.state.ParamSpec` (``d`` and the tensor layout).

    Returns:
        ``{"cos_<layer>": mean over pairs}`` for every layer with at least one pair, in [-1, 1], plus
        ``cos_mean``: the unweighted mean over those layers ({} when no layer has a pair).
    """
    if deltas.dim() != 2 or deltas.shape[1] != spec.d:
        raise ValueError(f"layer_cosine needs client updates [S, {spec.d}], got {tuple(deltas.shape)}")
    S = deltas.shape[0]
    if S < 2:
        return {}
    i, j = torch.triu_indices(S, S, 1, device=deltas.device)  # the S(S-1)/2 pairs i < j
    names, means = [], []
    for layer, members in layer_groups(spec).items():
        gram = torch.zeros(S, S, dtype=torch.float64, device=deltas.device)
        for p in members:
            x = deltas[:, spec.offsets[p]:spec.offsets[p] + spec.numels[p]].double()  # [S, numel_p]
            gram += x @ x.T
        sq = gram.diagonal()  # [S] squared norms of the layer updates
        norm = sq.clamp_min(torch.finfo(torch.float64).tiny).sqrt()
        cos = (gram / (norm[:, None] * norm[None, :])).clamp(-1.0, 1.0)
        valid = (sq[i] > 0) & (sq[j] > 0)  # [pairs]
        names.append(layer)
        means.append(torch.where(valid, cos[i, j], torch.zeros_like(cos[i, j])).sum() / valid.sum())
    values = torch.stack(means).tolist()  # one device sync; NaN where a layer has no valid pair
    out = {f"cos_{n}": v for n, v in zip(names, values) if not math.isnan(v)}
    if out:
        out["cos_mean"] = sum(out.values()) / len(out)
    return out


def client_loss_trace(updates: Sequence, num_traced: int) -> Dict[str, float]:
    """Local training losses of the traced clients that trained this round [S2 Fig. 12].

    Args:
        updates: the round's :class:`~fl_core.algorithms.base.ClientUpdate` s; ``train_loss`` is the
            client's mean task loss (CE) over its local steps.
        num_traced: ``tracking.client_loss_trace``: clients ``0..num_traced-1`` are traced.

    Returns:
        ``client_loss/<i>`` for every traced client i in ``updates`` (MLflow groups the ``client_loss/``
        keys in one section), plus ``train_loss_clients_min`` / ``train_loss_clients_max`` over all the
        round's clients; {} when ``num_traced`` is 0 or there are no updates.
    """
    if num_traced <= 0 or not updates:
        return {}
    out = {f"client_loss/{u.client_id}": float(u.train_loss) for u in sorted(updates, key=lambda u: u.client_id)
           if u.client_id < num_traced}
    losses = [float(u.train_loss) for u in updates]
    out["train_loss_clients_min"] = min(losses)
    out["train_loss_clients_max"] = max(losses)
    return out


def effective_update(lr: float, local_epochs: int, num_samples: int, batch_size: int, num_clients: int,
                     local_steps: int = 0) -> float:
    """Effective update amount per round u = eta * E * |D| / (B * K) [S2 Eq. 3] (docs/algorithms.md, Effective
    update amount).

    u is the local learning rate times the number of local SGD steps a client takes per round in a
    balanced federation: each of the K clients holds |D| / K samples, so E epochs are E |D| / (B K)
    steps (the paper's formula; the executors take E * ceil(n_i / B), the same when B divides n_i).
    With ``local_steps`` > 0 (``train.local_steps``) every client takes exactly that many steps and
    u = eta * local_steps, whatever E, |D|, B and K. Base of the study: 0.005 * 1 * 50000 / (50 * 10) = 0.5
    = the centralised 0.005 * 1 * 50000 / (500 * 1).

    Args:
        lr: eta, the local learning rate (``train.lr``; round 1, before any decay).
        local_epochs: E (``train.local_epochs``).
        num_samples: |D|, the total number of training samples over all clients.
        batch_size: B (``train.batch_size``).
        num_clients: K (``partition.num_clients``).
        local_steps: ``train.local_steps`` (0: E epochs).

    Returns:
        u in units of learning rate x steps (dimensionless for the model).
    """
    if batch_size < 1 or num_clients < 1:
        raise ValueError(f"effective_update needs train.batch_size >= 1 and partition.num_clients >= 1, "
                         f"got {batch_size} and {num_clients}")
    if local_steps > 0:
        return float(lr) * local_steps
    return float(lr) * local_epochs * num_samples / (batch_size * num_clients)


STACK_LIMIT = 1 << 24  # update_drift stacks the S updates [S, d] once up to this many entries, else per tensor


@functools.lru_cache(maxsize=8)
def _membership(spec: ParamSpec) -> torch.Tensor:
    """float64 [1 + L, T] on the CPU: row 0 sums all T parameter tensors (the whole model), row 1 + l those of layer l
    (:func:`layer_groups`); built once per model layout, not every round."""
    groups = list(layer_groups(spec).values())
    member = torch.zeros(1 + len(groups), len(spec.numels), dtype=torch.float64)
    member[0] = 1.0
    for li, members in enumerate(groups):
        member[1 + li, members] = 1.0
    return member


@torch.no_grad()
def update_drift(deltas: Sequence[torch.Tensor], global_flat: torch.Tensor, num_samples: Sequence[int],
                 num_steps: Sequence[int], lr: float, spec: ParamSpec) -> Dict[str, float]:
    """The round's drift measures (docs/algorithms.md, Drift measures, which gives each one's source), from the S
    uploaded updates and the model the clients received.

    With Delta_i the update of client i (theta_i - theta, as uploaded), theta the received global model,
    p_i = n_i / sum_j n_j over the round's clients and Delta_bar = sum_i p_i Delta_i (the sample-weighted mean):

    - ``drift_client_mean`` / ``drift_client_max``: mean / max over i of ||Delta_i|| / ||theta|| (client drift, the
      local model's relative distance from the one it started from);
    - ``drift_dissimilarity``: sum_i p_i ||Delta_i - Delta_bar||^2 / ||Delta_bar||^2 (the bounded-dissimilarity
      constant B^2 of the local-SGD analyses, here of whole updates);
    - ``drift_cosine``: mean over i of cos(Delta_i, Delta_bar), whole model; ``drift_cos_<layer>`` the same per
      layer (:func:`layer_groups`), the per-layer update similarity of the IID -> non-IID study [S2 Fig. 13] as the
      clients' agreement with the update the server applies;
    - ``drift_progress``: mean over i of ||Delta_i|| / (K_i eta_l), the update per local step and unit of step size
      (equal for clients that walk equally fast, whatever K_i).

    The sums are taken per parameter tensor in the updates' dtype (float32 by default: the measures carry
    float32 rounding, about 1e-7 of ||Delta_i||^2, which matters only for a dissimilarity below about 1e-6) and
    summed in float64. A quantity whose denominator is 0 is left out: clients with a zero update (a frozen or
    unsent model) have no cosine, a zero mean update gives no dissimilarity or cosine, theta = 0 no client drift,
    K_i = 0 or eta_l = 0 no progress; a key with no client left is absent from the round's row.

    Args:
        deltas: S tensors [d], the round's uploaded updates (S >= 1).
        global_flat: [d] the model the clients received.
        num_samples: n_i per client (all 0: equal weights); num_steps: K_i per client; lr: eta_l of the round.
        spec: the model's :class:`~fl_core.params.ParamSpec`.

    Returns:
        The keys above, floats (one device synchronisation).
    """
    S = len(deltas)
    if S == 0:
        return {}
    dim = spec.d
    if any(t.shape != (dim,) for t in deltas) or global_flat.shape != (dim,):
        raise ValueError(f"update_drift needs S updates [{dim}] and the global model [{dim}]")
    dev = global_flat.device
    n = torch.tensor([float(x) for x in num_samples], dtype=torch.float64)
    p = (n / n.sum() if float(n.sum()) > 0 else torch.full((S,), 1.0 / S, dtype=torch.float64)).to(dev)
    layers = list(layer_groups(spec).items())
    # per parameter tensor t in the updates' dtype (no float64 copy of them): ||Delta_i^t||^2, <Delta_i^t,
    # Delta_bar^t> and ||Delta_bar^t||^2, each O(S numel_t); then summed per layer in float64
    whole = torch.stack(list(deltas)) if S * dim <= STACK_LIMIT else None  # [S, d] once, or per tensor
    pw = p.to(deltas[0].dtype)
    t_sq, t_dot, t_msq = [], [], []
    for a, n_t in zip(spec.offsets, spec.numels):
        x = whole[:, a:a + n_t] if whole is not None else torch.stack([dl[a:a + n_t] for dl in deltas])  # [S, n_t]
        m = pw @ x  # [n_t] the weighted mean update
        t_sq.append(x.pow(2).sum(1))
        t_dot.append(x @ m)
        t_msq.append(m @ m)
    member = _membership(spec).to(dev)  # [1 + L, T]
    sq = member @ torch.stack(t_sq).double()  # [1 + L, S]
    dot = member @ torch.stack(t_dot).double()  # [1 + L, S]
    msq = member @ torch.stack(t_msq).double()  # [1 + L]
    theta_sq = global_flat.double().pow(2).sum()
    tiny = torch.finfo(torch.float64).tiny
    ok = (sq > 0) & (msq[:, None] > 0)  # the cosine of client i to the mean is defined
    cos = (dot / (sq.clamp_min(tiny).sqrt() * msq[:, None].clamp_min(tiny).sqrt())).clamp(-1.0, 1.0)
    cos = torch.where(ok, cos, torch.zeros_like(cos)).sum(1) / ok.sum(1)  # [1 + L]; NaN (0 / 0) without a client
    norms = sq[0].sqrt()  # [S] ||Delta_i||
    theta = theta_sq.sqrt()  # 0: the relative drifts are inf / NaN and left out
    dissim = (p * (sq[0] - 2 * dot[0] + msq[0]).clamp_min(0)).sum() / msq[0]  # inf / NaN for a zero mean update
    nums = torch.cat([torch.stack([norms.mean() / theta, norms.max() / theta, dissim]), cos, norms])
    nums = nums.tolist()  # the one synchronisation
    values = dict(zip(("drift_client_mean", "drift_client_max", "drift_dissimilarity", "drift_cosine"), nums[:4]))
    moved = [nrm / (k * lr) for nrm, k in zip(nums[4 + len(layers):], num_steps) if k > 0 and lr > 0]
    values["drift_progress"] = sum(moved) / len(moved) if moved else math.nan
    values.update({f"drift_cos_{layer}": v for (layer, _), v in zip(layers, nums[4:4 + len(layers)])})
    return {k: v for k, v in values.items() if math.isfinite(v)}
