"""FedNLR: neuron-wise learning rates (Wang et al., KDD'24; docs/algorithms.md, FedNLR). A wrapper.

Before its first local step, every client measures the received global model's mean activation
h_{l,m} of each neuron m of each weighted layer l = 1..L over its whole local data (eval mode;
conv neuron = channel, post-ReLU activation averaged over positions; classifier = raw logits), then
for every layer (Eqs. 15-17)::

    mu_l   = mu0 + a1 * (l / L) + a2 * log10(M_l)          (depth_term one_over_L: 1 / L)
    T_l    = (max_m h_{l,m} - min_m h_{l,m}) / ln(mu_l)
    q_l    = softmax_m(h_{l,m} / T_l)
    eta_lm = eta * M_l * q_{l,m}        => mean_m eta_lm = eta, max/min = mu_l exactly

The rate multiplies the whole step of the neuron's weights and bias (gradient, weight decay and the
base algorithm's terms; Eq. 18). A degenerate layer (max = min, or mu_l <= 1) keeps eta. The rates
are fixed for the round; the server rule is the base algorithm's. Logs per round ``fednlr_mu_l<l>``
and ``fednlr_T_l<l>`` (mean over the round's clients).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

from ..lazy import lazy_import
from ..schema import param
from .base import Algorithm, Wrapper
from .registry import Rule, neuron_layers, register

torch = lazy_import("torch")  # executed on first use: fl-train --help and --cfg load no torch


@dataclass
class FedNLRParams:
    mu0: float = param(1.0, "mu_l = mu0 + a1 * depth + a2 * log10(M_l) (FedNLR Eq. 17)", ge=0,
                       replica=True)
    a1: float = param(1.0, "weight of the depth term in mu_l", ge=0, replica=True)
    a2: float = param(1.0, "weight of log10(M_l) in mu_l", ge=0, replica=True)
    depth_term: str = param("l_over_L", "l/L (Eq. 17) | one_over_L (the paper's printed final formula)",
                            choices=("l_over_L", "one_over_L"))
    neuron_count: str = param("channels", "M_l of a conv layer: channels | channels_x_hw",
                              choices=("channels", "channels_x_hw"))


def mu_schedule(M: Sequence[int], mu0: float = 1.0, a1: float = 1.0, a2: float = 1.0,
                depth_term: str = "l_over_L") -> List[float]:
    """mu_l for layers with M_l neurons (FedNLR Eq. 17); ``depth_term`` l_over_L (default) or one_over_L."""
    L = len(M)
    depth = [(l / L) if depth_term == "l_over_L" else 1.0 / L for l in range(1, L + 1)]
    return [mu0 + a1 * dl + a2 * math.log10(m) for dl, m in zip(depth, M)]


def neuron_scales(h: torch.Tensor, mu: float) -> Tuple[torch.Tensor, float]:
    """Per-neuron multipliers M_l * softmax(h / T_l) (mean 1, max/min = mu) and T_l; ones if degenerate."""
    M = h.numel()
    span = float(h.max() - h.min()) if M > 1 else 0.0
    if not (span > 0.0 and mu > 1.0 and math.isfinite(span)):
        return torch.ones_like(h), float("inf")
    T = span / math.log(mu)
    return M * torch.softmax(h / T, dim=0), T


class FedNLR(Wrapper):
    name = "fednlr"

    def __init__(self, base: Algorithm, layers: Sequence[Tuple[str, str, int]], mu0: float = 1.0, a1: float = 1.0,
                 a2: float = 1.0, depth_term: str = "l_over_L", neuron_count: str = "channels"):
        """``layers``: (module name, kind, neurons M_l) of the model's weighted layers in forward order."""
        super().__init__(base)
        if not layers:
            raise ValueError("algorithm.wrappers=[fednlr] needs a model with neuron_layers()")
        self.layers = list(layers)
        self.mu0, self.a1, self.a2 = float(mu0), float(a1), float(a2)
        self.depth_term = depth_term
        self.neuron_count = neuron_count
        self._stats: Dict[int, List[Tuple[float, float]]] = {}
        self._round = None

    def client_begin(self, ctx, probe):
        means, spatial = probe()
        counts = [M * (hw if (self.neuron_count == "channels_x_hw" and kind == "conv") else 1)
                  for (_, kind, M), hw in zip(self.layers, spatial)]
        mus = mu_schedule(counts, self.mu0, self.a1, self.a2, self.depth_term)
        if self._round != ctx.round.round:
            self._round, self._stats = ctx.round.round, {}
        scales: Dict[str, torch.Tensor] = {}
        spec = ctx.round.spec
        ndim = {n: len(shape) for n, shape in zip(spec.names, spec.shapes)}
        for l, ((name, _, M), h, mu) in enumerate(zip(self.layers, means, mus), start=1):
            s, T = neuron_scales(h.to(torch.float64), mu)
            s = s.to(ctx.round.global_flat.dtype)
            self._stats.setdefault(l, []).append((mu, T))
            for suffix in ("weight", "bias"):
                pname = f"{name}.{suffix}"
                if pname in ndim:
                    scales[pname] = s.view(M, *([1] * (ndim[pname] - 1)))
        ctx.lr_scale = scales
        self.base.client_begin(ctx, probe)

    def aggregate(self, rctx, server_state, updates):
        """The base's server step; its metrics with the round's mu_l and mean T_l per layer added."""
        step = self.base.aggregate(rctx, server_state, updates)
        out = step.metrics = dict(step.metrics)
        for l, vals in sorted(self._stats.items()):
            out[f"fednlr_mu_l{l}"] = vals[0][0]
            finite = [T for _, T in vals if math.isfinite(T)]
            if finite:
                out[f"fednlr_T_l{l}"] = sum(finite) / len(finite)
        return step


register(Rule(
    name="fednlr", kind="wrapper", label="FedNLR", citation="Wang et al., KDD 2024, Eqs. (15)-(18)",
    summary="neuron-wise learning rates from the received model's activations (ratio mu_l per layer)",
    params=FedNLRParams, neutral=("algorithm.fednlr.mu0=1", "algorithm.fednlr.a1=0", "algorithm.fednlr.a2=0"),
    build=lambda base, p, ctx: FedNLR(base, neuron_layers(ctx.model), p.mu0, p.a1, p.a2, p.depth_term,
                                      p.neuron_count)))
