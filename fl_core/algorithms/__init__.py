"""The rules. Each file describes and registers its rule(s) (:mod:`.registry`); ``build_algorithm`` turns an
``algorithm`` config node into a (possibly wrapped) Algorithm.

The imports below load the rule files in the order of the config's ``algorithm`` sections (and of
``fl-train --help``); :func:`_load_rule_files` then loads every other module of this package, so a new rule is its
file, its yaml and its tests (docs/architecture.md, Adding a rule).
"""

from __future__ import annotations

import importlib
import pkgutil

from ..params import ParamSpec
from . import registry
from .base import Algorithm, ClientContext, ClientUpdate, InfeasibleSetting, RoundContext, Wrapper
from .fedavg import FedAvg
from .fedprox import FedProx
from .feddyn import FedDyn
from .fedexp import FedExP
from .feddecorr import FedDecorr, decorrelation_loss
from .scaffold import Scaffold
from .fednova import FedNova, normalizer
from .fedlogits import FedLC, FedRS
from .fednlr import FedNLR, mu_schedule, neuron_scales
from .ccvr import CCVR
from .serveropt import Adaptive, FedAdagrad, FedAdam, FedAvgM, FedYogi, Momentum, ServerOptimized
from .feddc import FedDC
from .fedbcgd import FedBCGD, FedBCGDPlus, assign_blocks, block_partition
from .compression import QSGD, TopK
from .fedbug import FedBug, unfrozen_units
from .moon import Moon, contrastive_loss


def _load_rule_files() -> None:
    """Import every module of this package not imported above (a new rule file registers itself on import),
    in name order, so the registry and the config schema know it without an edit here."""
    for module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
        importlib.import_module(f"{__name__}.{module}")


_load_rule_files()


def prepare_model(cfg, model) -> None:
    """Let the rules of ``cfg`` (the ``algorithm`` section) add their own parameters to ``model`` (MOON's head)
    before its layout is taken; :func:`registry.prepare_model`."""
    registry.prepare_model(cfg, model)


def build_algorithm(cfg, spec: ParamSpec, model=None, momentum: float = 0.0, optimizer: str = "sgd") -> Algorithm:
    """Build ``cfg.name`` and wrap it with ``cfg.wrappers`` in order (first = innermost); :func:`registry.build`.

    ``model`` gives rules the structure they need (FedNLR's neuron layers, CCVR's classifier, FedBCGD's blocks);
    ``momentum`` is ``train.momentum``, the clients' local SGD momentum (FedNova's normaliser depends on it; rules
    whose math assumes plain local SGD refuse it); ``optimizer`` is ``train.optimizer`` (``sgd`` | ``adam``; the
    same rules refuse adam, and FedNova, whose normaliser a_i is derived for SGD steps).

    Raises:
        ConfigError: unknown base (``algorithm.name``) or wrapper (``algorithm.wrappers``), a value out of range,
            a shared key (``algorithm.aggregation``, ``algorithm.eta_g``) the base would ignore, or
            ``train.momentum`` > 0 or ``train.optimizer=adam`` with a rule that assumes plain local SGD.
    """
    return registry.build(cfg, spec, model, momentum, optimizer)


__all__ = ["Algorithm", "Wrapper", "InfeasibleSetting", "ClientContext", "ClientUpdate", "RoundContext", "FedAvg",
           "FedProx", "FedBug", "FedDyn", "FedExP", "FedDecorr", "decorrelation_loss", "unfrozen_units", "Scaffold",
           "FedNova", "normalizer", "FedRS", "FedLC", "FedNLR", "mu_schedule", "neuron_scales", "CCVR", "FedDC",
           "FedBCGD", "FedBCGDPlus", "assign_blocks", "block_partition", "FedAvgM", "FedAdam", "FedYogi",
           "FedAdagrad", "Momentum", "Adaptive", "ServerOptimized", "TopK", "QSGD", "Moon", "contrastive_loss",
           "build_algorithm", "prepare_model", "registry"]
