"""Algorithm registry: ``build_algorithm`` turns an AlgorithmConfig into a (possibly wrapped) Algorithm.

Base rules are one file each (fedavg.py, fedprox.py); wrappers (fedbug.py) take a base.
"""

from __future__ import annotations

from typing import Callable, Dict

from ..engine.state import ParamSpec
from .base import Algorithm, ClientContext, ClientUpdate, InfeasibleSetting, RoundContext, Wrapper
from .fedavg import FedAvg
from .fedbug import FedBug, unfrozen_units
from .feddecorr import FedDecorr, decorrelation_loss
from .feddyn import FedDyn
from .fedexp import FedExP
from .fedprox import FedProx
from .ccvr import CCVR
from .fedlogits import FedLC, FedRS
from .fednlr import FedNLR, mu_schedule, neuron_scales
from .fednova import FedNova, normalizer
from .scaffold import Scaffold
from .feddc import FedDC
from .serveropt import FedAdagrad, FedAdam, FedAvgM, FedYogi
from .compression import QSGD, TopK
from .fedbcgd import FedBCGD, FedBCGDPlus, assign_blocks, block_partition

BASES: Dict[str, Callable[..., Algorithm]] = {
    "fedavg": lambda cfg: FedAvg(cfg.aggregation, cfg.eta_g),
    "fedprox": lambda cfg: FedProx(cfg.fedprox.mu, cfg.aggregation, cfg.eta_g),
    "feddyn": lambda cfg: FedDyn(cfg.feddyn.alpha, cfg.feddyn.adaptive_alpha, cfg.feddyn.eval_model),
    "fedexp": lambda cfg: FedExP(cfg.aggregation, cfg.fedexp.variant, cfg.fedexp.eps, cfg.fedexp.eps_decay,
                                 cfg.fedexp.average_last_two),
    "feddecorr": lambda cfg: FedDecorr(cfg.feddecorr.beta, cfg.aggregation, cfg.eta_g),
    "scaffold": lambda cfg: Scaffold(cfg.eta_g, cfg.scaffold.lr_in_update),
    "fednova": lambda cfg: FedNova(cfg.fednova.mu, cfg.eta_g),
    "fedrs": lambda cfg: FedRS(cfg.fedrs.alpha, cfg.aggregation, cfg.eta_g),
    "fedlc": lambda cfg: FedLC(cfg.fedlc.tau, cfg.fedlc.missing, cfg.aggregation, cfg.eta_g),
    "feddc": lambda cfg: FedDC(cfg.feddc.alpha),
    "fedavgm": lambda cfg: FedAvgM(cfg.fedavgm.beta, cfg.fedavgm.form, cfg.aggregation, cfg.eta_g),
    "fedadam": lambda cfg: FedAdam(cfg.server_opt.beta1, cfg.server_opt.beta2, cfg.server_opt.tau, cfg.aggregation,
                                   cfg.eta_g),
    "fedyogi": lambda cfg: FedYogi(cfg.server_opt.beta1, cfg.server_opt.beta2, cfg.server_opt.tau, cfg.aggregation,
                                   cfg.eta_g),
    "fedadagrad": lambda cfg: FedAdagrad(cfg.server_opt.beta1, cfg.server_opt.beta2, cfg.server_opt.tau,
                                         cfg.aggregation, cfg.eta_g),
}

# rules that need the model's structure: (cfg, spec, model) -> Algorithm
STRUCTURED: Dict[str, Callable[..., Algorithm]] = {
    "fedbcgd": lambda cfg, spec, model: FedBCGD(
        spec, *block_partition(model, spec.names, cfg.fedbcgd.blocks, cfg.fedbcgd.block_partition,
                               cfg.fedbcgd.shared),
        lam=cfg.fedbcgd.lam, momentum=cfg.fedbcgd.momentum, freezing=cfg.fedbcgd.freezing),
    "fedbcgd_plus": lambda cfg, spec, model: FedBCGDPlus(
        spec, *block_partition(model, spec.names, cfg.fedbcgd.blocks, cfg.fedbcgd.block_partition,
                               cfg.fedbcgd.shared),
        lam=cfg.fedbcgd.lam, momentum=cfg.fedbcgd.momentum, freezing=cfg.fedbcgd.freezing,
        variant=cfg.fedbcgd.plus_variant),
}


def _neuron_layers(model):
    """(name, kind, M_l) of the model's weighted layers, or [] if it does not expose them."""
    if model is None or not hasattr(model, "neuron_layers"):
        return []
    out = []
    for name, module, kind in model.neuron_layers():
        out.append((name, kind, module.out_channels if kind == "conv" else module.out_features))
    return out

WRAPPERS: Dict[str, Callable[..., Algorithm]] = {
    "fedbug": lambda base, cfg, spec, model: FedBug(base, cfg.fedbug.gu_percentage, list(spec.unit_of),
                                                    spec.num_units, cfg.fedbug.schedule, cfg.fedbug.strategy),
    "fednlr": lambda base, cfg, spec, model: FedNLR(base, _neuron_layers(model), cfg.fednlr.mu0, cfg.fednlr.a1,
                                                    cfg.fednlr.a2, cfg.fednlr.depth_term, cfg.fednlr.neuron_count),
    "topk": lambda base, cfg, spec, model: TopK(base, cfg.compression.topk_ratio, cfg.compression.error_feedback),
    "qsgd": lambda base, cfg, spec, model: QSGD(base, cfg.compression.qsgd_levels),
    "ccvr": lambda base, cfg, spec, model: CCVR(base, (_neuron_layers(model) or [("fc", "linear", 0)])[-1][0],
                                                cfg.ccvr.virtual_per_class, cfg.ccvr.epochs, cfg.ccvr.lr,
                                                cfg.ccvr.batch_size),
}


def build_algorithm(cfg, spec: ParamSpec, model=None) -> Algorithm:
    """Build ``cfg.name`` and wrap it with ``cfg.wrappers`` in order (first = innermost).

    ``model`` gives wrappers the structure they need (FedNLR's neuron layers, CCVR's classifier).

    Raises:
        ValueError: unknown base (``algorithm.name``) or wrapper (``algorithm.wrappers``).
    """
    if cfg.name in STRUCTURED:
        algo = STRUCTURED[cfg.name](cfg, spec, model)
    elif cfg.name in BASES:
        algo = BASES[cfg.name](cfg)
    else:
        raise ValueError(f"algorithm.name must be one of {', '.join(list(BASES) + list(STRUCTURED))}, "
                         f"got {cfg.name!r}")
    for w in cfg.wrappers:
        if w not in WRAPPERS:
            raise ValueError(f"algorithm.wrappers: unknown wrapper {w!r} (known: {', '.join(WRAPPERS)})")
        algo = WRAPPERS[w](algo, cfg, spec, model)
    return algo


__all__ = ["Algorithm", "Wrapper", "InfeasibleSetting", "ClientContext", "ClientUpdate", "RoundContext", "FedAvg", "FedProx",
           "FedBug", "FedDyn", "FedExP", "FedDecorr", "decorrelation_loss", "unfrozen_units", "Scaffold", "FedNova",
           "normalizer", "FedRS", "FedLC", "FedNLR", "mu_schedule", "neuron_scales", "CCVR", "FedDC", "FedBCGD", "FedBCGDPlus",
           "assign_blocks", "block_partition", "STRUCTURED", "FedAvgM", "FedAdam", "FedYogi", "FedAdagrad", "TopK", "QSGD", "build_algorithm", "BASES", "WRAPPERS"]
