"""Algorithm registry: ``build_algorithm`` turns an AlgorithmConfig into a (possibly wrapped) Algorithm.

Base rules are one file each (fedavg.py, fedprox.py); wrappers (fedbug.py) take a base.
"""

from __future__ import annotations

from typing import Callable, Dict

from ..engine.state import ParamSpec
from .base import Algorithm, ClientContext, ClientUpdate, RoundContext, Wrapper
from .fedavg import FedAvg
from .fedbug import FedBug, unfrozen_units
from .feddecorr import FedDecorr, decorrelation_loss
from .feddyn import FedDyn
from .fedexp import FedExP
from .fedprox import FedProx

BASES: Dict[str, Callable[..., Algorithm]] = {
    "fedavg": lambda cfg: FedAvg(cfg.aggregation, cfg.eta_g),
    "fedprox": lambda cfg: FedProx(cfg.fedprox.mu, cfg.aggregation, cfg.eta_g),
    "feddyn": lambda cfg: FedDyn(cfg.feddyn.alpha, cfg.feddyn.adaptive_alpha, cfg.feddyn.eval_model),
    "fedexp": lambda cfg: FedExP(cfg.aggregation, cfg.fedexp.variant, cfg.fedexp.eps, cfg.fedexp.eps_decay,
                                 cfg.fedexp.average_last_two),
    "feddecorr": lambda cfg: FedDecorr(cfg.feddecorr.beta, cfg.aggregation, cfg.eta_g),
}

WRAPPERS: Dict[str, Callable[..., Algorithm]] = {
    "fedbug": lambda base, cfg, spec: FedBug(base, cfg.fedbug.gu_percentage, list(spec.unit_of), spec.num_units,
                                             cfg.fedbug.schedule, cfg.fedbug.strategy),
}


def build_algorithm(cfg, spec: ParamSpec) -> Algorithm:
    """Build ``cfg.name`` and wrap it with ``cfg.wrappers`` in order (first = innermost).

    Raises:
        ValueError: unknown base (``algorithm.name``) or wrapper (``algorithm.wrappers``).
    """
    if cfg.name not in BASES:
        raise ValueError(f"algorithm.name must be one of {', '.join(BASES)}, got {cfg.name!r}")
    algo = BASES[cfg.name](cfg)
    for w in cfg.wrappers:
        if w not in WRAPPERS:
            raise ValueError(f"algorithm.wrappers: unknown wrapper {w!r} (known: {', '.join(WRAPPERS)})")
        algo = WRAPPERS[w](algo, cfg, spec)
    return algo


__all__ = ["Algorithm", "Wrapper", "ClientContext", "ClientUpdate", "RoundContext", "FedAvg", "FedProx",
           "FedBug", "FedDyn", "FedExP", "FedDecorr", "decorrelation_loss", "unfrozen_units", "build_algorithm", "BASES", "WRAPPERS"]
