"""Uplink compression baselines: Top-k with error feedback, QSGD and FedPAQ (docs/algorithms.md,
Top-k, QSGD, FedPAQ).

Both compressors are message transforms (:class:`~fl_core.algorithms.base.Transform`, ``algorithm.transforms``, applied
first to last; ``[topk, qsgd]`` quantises the sparsified update): the rule trains and finishes the client as usual
(its ``finish_client`` runs FIRST, on the raw update), then the model update Delta_i it returns is replaced by its
compressed version before it is "sent". The
server rule is the base's, applied to the compressed deltas. Everything else the base uploads
(``update.extra``: SCAFFOLD's Delta c, FedNova's a_i, ...) is sent uncompressed and counted as such,
except what the base lists in ``compressed_extras`` (FedBCGD+'s block of Delta c), which QSGD
quantises as a message of its own ("QSGD + FedBCGD+", FedBCGD Table 6).

Top-k (Aji & Heafield 2017, "Sparse Communication for Distributed Gradient Descent"; with the error
feedback of Stich et al. 2018 / Karimireddy et al. 2019). With the client's residual e_i (0 at the
start, carried between its participations)::

    u_i    = Delta_i + e_i
    sent_i = topk(u_i, k)            k = max(1, round(ratio * d)): the k largest |u_i,a|, others 0
    e_i   <- u_i - sent_i            (error feedback; without it nothing is carried: e_i = 0)

so over a client's participations  sum(sent) + e_final = sum(Delta)  (nothing is lost, only
delayed). The compressor is biased. Upload: k values + k indices, each counted as one float
(a 32-bit index addresses d < 2^32 entries; entropy-coding the indices, ~log2(d) bits each, is not
modelled), i.e. 2k floats; for ratio >= 0.5 sending Delta dense would be cheaper, which is not
modelled either.

QSGD (Alistarh et al. 2017, "QSGD: Communication-Efficient SGD via Gradient Quantization",
Sec. 3.1) with s levels, on a flat vector v::

    Q_s(v)_a = ||v||_2 * sign(v_a) * xi_a / s,   l = floor(s |v_a| / ||v||_2),
    xi_a     = l + 1  with probability  s |v_a| / ||v||_2 - l,   l otherwise

which is unbiased, E[Q_s(v)] = v, with Var <= min(d/s^2, sqrt(d)/s) ||v||^2 (QSGD Lemma 3.1).
Q_s(0) = 0. Cost (fixed-length code, not QSGD's Elias code): one float for the norm plus, per entry,
one sign bit and ceil(log2(s + 1)) bits for xi in {0..s}, in float equivalents (32 bits)::

    qsgd_floats(d, s) = d * (1 + ceil(log2(s + 1))) / 32 + 1

The random draws of client i in round r come from ``torch_generator("qsgd", run seed, salt, r, i)``
(run seed: ``RoundContext.seed``; salt: the transform's ``seed`` argument, 0 by default), so they do not
depend on the executor or on which other clients trained.

Communication of a base that uploads less than d floats (FedBCGD: one block, the rest of Delta_i is 0):
the compressor acts on the dense Delta_i, which for QSGD equals quantising the block (zeros stay 0, the
norm is the block's), and is charged on the base's payload m = base up (k = ratio * m for Top-k). A base
that uploads more than d sends the extra floats (SCAFFOLD's Delta c) uncompressed.

FedPAQ (Reisizadeh et al. 2020, "FedPAQ: A Communication-Efficient Federated Learning Method with
Periodic Averaging and Quantization") = local SGD with partial participation + Q_s on the model
update + uniform averaging, theta <- theta + (1/|S|) sum_i Q_s(Delta_i): FedAvg(uniform) wrapped in
QSGD (conf/algorithm/fedpaq.yaml: ``transforms: [qsgd]``), not a class of its own.

Per round the transforms log ``topk_residual_norm`` (mean ||e_i|| after the round over its clients;
with error feedback) and ``qsgd_rel_error`` (mean ||Q(Delta_i) - Delta_i|| / ||Delta_i||).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Optional, Tuple

from ..lazy import lazy_import
from ..schema import checked, param, when
from ..seeding import torch_generator
from .base import Algorithm, ClientContext, ClientUpdate, Transform
from .registry import Rule, register

torch = lazy_import("torch")  # executed on first use: fl-train --help and --cfg load no torch


@dataclasses.dataclass
class CompressionParams:
    """``algorithm.compression``: shared by Top-k and QSGD."""

    topk_ratio: float = param(0.1, "Top-k: share of the entries sent (values + indices)", gt=0, le=1,
                              when=when("algorithm.transforms", "topk"))
    qsgd_levels: int = param(16, "QSGD / FedPAQ: s quantisation levels", ge=1, integer=True,
                             when=when("algorithm.transforms", "qsgd"))
    error_feedback: bool = param(True, "Top-k: keep the residual on the client", when=when("algorithm.transforms", "topk"))


# ----------------------------------------------------------------------------- QSGD

def qsgd_bits(d: int, s: int) -> int:
    """Bits of one QSGD message of d entries with s levels: a 32-bit norm + (1 + ceil(log2(s+1))) per entry."""
    return int(d) * (1 + math.ceil(math.log2(int(s) + 1))) + 32


def qsgd_floats(d: float, s: int) -> float:
    """Float equivalents (32 bits) of one QSGD message: d * (1 + ceil(log2(s + 1))) / 32 + 1 (= qsgd_bits / 32;
    d may be a fractional mean payload, e.g. FedBCGD's mean block size)."""
    return float(d) * (1 + math.ceil(math.log2(int(s) + 1))) / 32.0 + 1.0


def qsgd(v: torch.Tensor, s: int, generator: torch.Generator) -> Tuple[torch.Tensor, int]:
    """The unbiased QSGD quantiser Q_s of a flat vector ``v`` (see the module docstring).

    Args:
        v: [d] vector (any float dtype/device).
        s: number of levels, >= 1.
        generator: source of the uniform draws (one per entry); drawn on its own device, then moved.

    Returns:
        (q, bits): q [d] like ``v``, every entry a multiple of ||v||_2 / s with the sign of v (or 0);
        bits = :func:`qsgd_bits` of the message.
    """
    s = int(s)
    if s < 1:
        raise ValueError(f"qsgd: levels s must be >= 1, got {s}")
    flat = v.reshape(-1)
    bits = qsgd_bits(flat.numel(), s)
    norm = torch.linalg.vector_norm(flat.to(torch.float64))
    if flat.numel() == 0 or float(norm) == 0.0:
        return torch.zeros_like(v), bits
    u = torch.rand(flat.numel(), generator=generator, dtype=torch.float64, device=generator.device).to(flat.device)
    r = flat.abs().to(torch.float64) * (s / norm)  # in [0, s]
    low = torch.floor(r)
    xi = (low + (u < (r - low)).to(torch.float64)).clamp_(max=s)  # rounding can push r a hair above s
    q = (norm / s) * torch.sign(flat.to(torch.float64)) * xi
    return q.to(v.dtype).reshape(v.shape), bits


# ----------------------------------------------------------------------------- Top-k

def topk_k(d: int, ratio: float) -> int:
    """k = max(1, round(ratio * d)), at most d (Python's round: half to even)."""
    return max(1, min(int(d), int(round(float(ratio) * int(d)))))


def topk(v: torch.Tensor, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The k entries of the flat vector ``v`` with the largest magnitude: (values [k], indices [k])."""
    flat = v.reshape(-1)
    k = max(0, min(int(k), flat.numel()))
    idx = torch.topk(flat.abs(), k, sorted=True).indices
    return flat[idx], idx


def topk_floats(k: int) -> float:
    """Upload of one Top-k message: k values + k indices, one float each (module docstring)."""
    return 2.0 * int(k)


def topk_dense(v: torch.Tensor, k: int) -> torch.Tensor:
    """``v`` with every entry but the top-k (by magnitude) set to 0 (what the server reconstructs)."""
    values, idx = topk(v, k)
    out = torch.zeros_like(v).reshape(-1)
    out[idx] = values
    return out.reshape(v.shape)


class _RoundStats:
    """Per-round list of floats, reset when a new round starts (like FedNLR's statistics)."""

    def __init__(self):
        self.round: Optional[int] = None
        self.values: List[float] = []

    def add(self, rnd: int, value: float) -> None:
        if self.round != rnd:
            self.round, self.values = rnd, []
        self.values.append(float(value))

    def mean(self, rnd: int) -> Optional[float]:
        if self.round != rnd or not self.values:
            return None
        return sum(self.values) / len(self.values)


def _payload(base: Algorithm, d: int) -> Tuple[float, float]:
    """(m, extra): the base's upload split into its model-update payload m and what it sends besides.

    A base that uploads at least d floats sends its whole delta (m = d) plus ``base_up - d`` further
    floats (SCAFFOLD: Delta c, d; FedNova: a_i, 1); one that uploads less sends only part of the delta
    (FedBCGD: its block, ~d/N; the rest of ``update.delta`` is 0), so m = base_up / (1 + #extras), where
    the extras are the equally sized vectors of ``base.compressed_extras`` (FedBCGD+: its block of Delta c),
    and extra = base_up - m.
    """
    base_up = float(base.comm_floats(d)[0])
    if base.compressed_extras:
        m = base_up / (1 + len(base.compressed_extras))
        return m, base_up - m
    if base_up >= d:
        return float(d), base_up - float(d)
    return base_up, 0.0


class TopK(Transform):
    """Top-k sparsification of the uploaded delta, with client-side error feedback (module docstring)."""

    name = "topk"
    STATE_KEY = "residual"

    def __init__(self, ratio: float, error_feedback: bool = True):
        self.ratio = float(checked(CompressionParams, "algorithm.compression", topk_ratio=float(ratio)).topk_ratio)
        self.error_feedback = bool(error_feedback)
        self._stats = _RoundStats()

    def shown(self):
        return (("", f"{self.ratio:g}"), ("", "ef" if self.error_feedback else "no_ef"))

    def k(self, inner: Algorithm, d: int) -> int:
        """The closed form's k for a model of d entries: ratio times ``inner``'s mean delta payload (d, or the mean
        block for FedBCGD). Each client uses ratio times its own payload (:meth:`apply`)."""
        m, _ = _payload(inner, d)
        return topk_k(max(1, int(round(m))), self.ratio)

    def init_state(self, global_flat):
        """With error feedback, the residual e_i = 0 [d] (no state is kept without it)."""
        return {self.STATE_KEY: torch.zeros_like(global_flat)} if self.error_feedback else {}

    def apply(self, ctx: ClientContext, update: ClientUpdate, inner: Algorithm) -> ClientUpdate:
        delta = update.delta
        # k = ratio x this client's model-update payload as its rule sends it (d, or its block for FedBCGD)
        k = topk_k(max(1, int(round(update.sent["delta"]))), self.ratio)
        if not self.error_feedback:
            return dataclasses.replace(update, delta=topk_dense(delta, k),
                                       sent={**update.sent, "delta": topk_floats(k)})
        if ctx.state is None:
            ctx.state = {}
        e = ctx.state.get(self.STATE_KEY)
        u = delta if e is None else delta + e.to(delta.device, delta.dtype)
        sent = topk_dense(u, k)
        residual = u - sent
        ctx.state[self.STATE_KEY] = residual
        self._stats.add(ctx.round.round, float(torch.linalg.vector_norm(residual)))
        return dataclasses.replace(update, delta=sent, sent={**update.sent, "delta": topk_floats(k)})

    def comm_floats(self, inner: Algorithm, d: int) -> Tuple[float, float]:
        _, extra = _payload(inner, d)
        return topk_floats(self.k(inner, d)) + extra, float(inner.comm_floats(d)[1])

    def round_metrics(self, rnd: int) -> Dict[str, float]:
        m = self._stats.mean(rnd)
        return {} if m is None else {"topk_residual_norm": m}


class QSGD(Transform):
    """QSGD quantisation (s levels) of the uploaded delta; FedPAQ = FedAvg(uniform) + QSGD (module docstring)."""

    name = "qsgd"

    def __init__(self, levels: int, seed: int = 0):
        self.levels = int(checked(CompressionParams, "algorithm.compression", qsgd_levels=levels).qsgd_levels)
        self.seed = int(seed)
        self._stats = _RoundStats()

    def shown(self):
        return (("s", self.levels),)

    def generator(self, run_seed: int, rnd: int, client_id: int, *message: str) -> torch.Generator:
        """The generator of client ``client_id``'s draws in round ``rnd`` of the run with seed ``run_seed``: for its
        delta, or for the ``compressed_extras`` vector ``message`` (a message of its own)."""
        return torch_generator("qsgd", int(run_seed), self.seed, int(rnd), int(client_id), *message)

    def apply(self, ctx: ClientContext, update: ClientUpdate, inner: Algorithm) -> ClientUpdate:
        delta = update.delta
        run_seed = getattr(ctx.round, "seed", 0)
        q, _ = qsgd(delta, self.levels, self.generator(run_seed, ctx.round.round, ctx.client_id))
        norm = float(torch.linalg.vector_norm(delta))
        if norm > 0:
            self._stats.add(ctx.round.round, float(torch.linalg.vector_norm(q - delta)) / norm)
        extra = dict(update.extra)
        for key in inner.compressed_extras:  # FedBCGD+'s Delta c: a message of its own
            extra[key], _ = qsgd(update.extra[key], self.levels,
                                 self.generator(run_seed, ctx.round.round, ctx.client_id, key))
        sent = dict(update.sent)  # each quantised message costs qsgd_floats of its payload (a block: its size)
        for key in ("delta", *inner.compressed_extras):
            sent[key] = qsgd_floats(sent.get(key, float(update.delta.numel())), self.levels)
        return dataclasses.replace(update, delta=q, extra=extra, sent=sent)

    def comm_floats(self, inner: Algorithm, d: int) -> Tuple[float, float]:
        """Each quantised message (the delta and every ``compressed_extras`` vector) costs qsgd_floats(m);
        anything else ``inner`` sends is uncompressed."""
        m, extra = _payload(inner, d)
        msgs = 1 + len(inner.compressed_extras)
        return msgs * qsgd_floats(m, self.levels) + extra - (msgs - 1) * m, float(inner.comm_floats(d)[1])

    def round_metrics(self, rnd: int) -> Dict[str, float]:
        m = self._stats.mean(rnd)
        return {} if m is None else {"qsgd_rel_error": m}


register(Rule(
    name="topk", kind="transform", label="Top-k", citation="Aji & Heafield, EMNLP 2017; error feedback: Stich et al., "
                                                         "NeurIPS 2018",
    summary="upload only the k largest entries of the update (values + indices), keep the rest as a residual",
    params=CompressionParams, section="compression", neutral=("algorithm.compression.topk_ratio=1",),
    build=lambda p, ctx: TopK(p.topk_ratio, p.error_feedback)))

register(Rule(
    name="qsgd", kind="transform", label="QSGD", citation="Alistarh et al., NeurIPS 2017, Sec. 3.1",
    summary="unbiased stochastic quantisation of the update to s levels (FedPAQ = FedAvg(uniform) + QSGD)",
    params=CompressionParams, section="compression",
    build=lambda p, ctx: QSGD(p.qsgd_levels)))


__all__ = ["qsgd", "qsgd_bits", "qsgd_floats", "topk", "topk_k", "topk_dense", "topk_floats", "TopK", "QSGD"]
