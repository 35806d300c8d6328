"""Server optimisers: the server part of a rule, chosen by ``algorithm.server_opt`` and composed over any rule that
has a pseudo-gradient (docs/algorithms.md, Server optimisers; FedAvgM; FedAdam, FedYogi, FedAdagrad; Invariants 9).

The rule's clients train as the rule says and its aggregator forms the pseudo-gradient ``Delta_bar`` [d]
(``ServerStep.direction`` of the rule's :meth:`~.base.Algorithm.aggregate`: FedAvg's ``sum_{i in S} p_i Delta_i``
with p_i = n_i / n_S, or 1/|S| with ``aggregation=uniform``; SCAFFOLD's mean Delta y; FedNova's tau_eff-scaled normalised mean). ``server_opt=sgd`` keeps
the plain step ``x <- x + eta_g Delta_bar``; the others feed Delta_bar to a stateful server rule. Over FedAvg they
are the published rules FedAvgM, FedAdam, FedYogi and FedAdagrad (conf/algorithm/<name>.yaml are those presets);
over FedProx, SCAFFOLD, FedNova, MOON, ... they compose the same way (``algorithm=fedprox algorithm.server_opt=adam``).

FedAvgM (Hsu et al. 2019, "Measuring the effects of non-identical data distribution ...")::

    heavy_ball:  v <- beta v + Delta_bar;                x <- x + eta_g v
    ema:         v <- beta v + (1 - beta) Delta_bar;     x <- x + v          (eta_g is ignored)

The EMA form is what FedDecorr's and FedBug's code call FedAvgM (beta = 0.9, server lr fixed to 1). Its state
is exactly (1 - beta) times the heavy-ball state, so EMA with beta == heavy-ball with eta_g = 1 - beta
(docs/algorithms.md, Invariants 9): the heavy-ball form's effective step on a constant pseudo-gradient is
eta_g / (1 - beta), the EMA form's is 1. beta = 0 (heavy-ball) is FedAvg.

FedAdam / FedYogi / FedAdagrad (Reddi et al. 2021, "Adaptive Federated Optimization", Alg. 2), all
element-wise, no bias correction::

    m <- beta1 m + (1 - beta1) Delta_bar
    adam:     v <- beta2 v + (1 - beta2) Delta_bar^2
    yogi:     v <- v - (1 - beta2) Delta_bar^2 sign(v - Delta_bar^2)      (sign(0) = 0)
    adagrad:  v <- v + Delta_bar^2                                        (beta2 unused)
    x <- x + eta_g m / (sqrt(v) + tau)

m starts at 0; v starts at 0 (``algorithm.adaptive.v0=zero``, the default) as in FedDecorr's
``approach/fedoptim.py`` (defaults beta1 = 0.9, beta2 = 0.99, tau = 1e-3, server lr 1.0; its run script uses
server lr 0.01), or at tau^2 (``v0=tau2``) as Reddi et al.'s Alg. 2 requires (v_{-1} >= tau^2). When
``algorithm.eta_g`` is unset (null, every preset) the optimiser's own step size applies whatever rule it composes
with: adam and yogi 0.03, adagrad 0.3 (the same first step, see ``ADAPTIVE_ETA_G``), momentum and sgd 1. With the zero init the first step of Adam and Yogi is, per coordinate,
``eta_g (1 - beta1) Delta / (sqrt(1 - beta2) |Delta| + tau)`` (Adagrad: ``sqrt(1 - beta2)`` -> 1), i.e.
up to eta_g (1 - beta1) / sqrt(1 - beta2) = eta_g for every coordinate with |Delta| >> tau: keep eta_g
small (0.03 unless set; FedDecorr's run scripts use 0.01). Yogi's v stays >= 0: it moves by exactly (1 - beta2) Delta_bar^2
towards Delta_bar^2, so where it decreases (v > Delta_bar^2) it ends above beta2 Delta_bar^2.

Every server optimiser but sgd logs ``server_update_norm`` = ||x_new - x|| each round (kept in the server state).
All arithmetic runs in the global vector's dtype and device; the optimiser's state (d floats for momentum, 2d for
the adaptive rules) lives in the server state beside the rule's own (keys ``opt.<name>``), so checkpoints resume
it. Communication: a server optimiser changes none (what the rule sends, up and down).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from ..lazy import lazy_import
from ..schema import ConfigError, checked, param, when
from .base import Algorithm, Description, ServerStep, Wrapper
from .fedavg import FedAvg
from .registry import Rule, register

torch = lazy_import("torch")  # executed on first use: fl-train --help and --cfg load no torch

OPT_PREFIX = "opt."  # server-state keys of the optimiser, beside the rule's own


@dataclass
class FedAvgMParams:
    beta: float = param(0.9, "server momentum", ge=0, lt=1, replica=True)
    form: str = param("heavy_ball", "heavy_ball: v <- beta v + D, x <- x + eta_g v | ema: m <- beta m + (1-beta) D, "
                      "x <- x + m", choices=("heavy_ball", "ema"))


@dataclass
class AdaptiveParams:
    beta1: float = param(0.9, "first-moment decay (adam, yogi, adagrad)", ge=0, lt=1, replica=True)
    beta2: float = param(0.99, "second-moment decay (adam, yogi)", ge=0, lt=1,
                         when=when("algorithm.server_opt", "adam", "yogi"), replica=True)
    tau: float = param(1.0e-3, "adaptivity: x <- x + eta_g m / (sqrt(v) + tau)", gt=0, replica=True)
    v0: str = param("zero", "initial second moment: zero (v = 0, FedDecorr's code) | tau2 (v = tau^2, Reddi et al. "
                    "Alg. 2: v_{-1} >= tau^2)", choices=("zero", "tau2"))


# eta_g when algorithm.eta_g is unset: adam and yogi 0.03 (~10^-1.5 of Reddi et al.'s grid; docs/algorithms.md gives the
# measurement against FedDecorr's 0.01); adagrad 0.3, the same first step:
# with v0 = zero a coordinate with |D| >> tau moves by eta_g (1 - beta1) / sqrt(1 - beta2) = eta_g under adam and
# yogi (beta2 = 0.99) but by eta_g (1 - beta1) under adagrad (v = D^2), a tenth of it at the same eta_g
ADAPTIVE_ETA_G = {"adam": 0.03, "yogi": 0.03, "adagrad": 0.3}


def _check_momentum(a, prefix: str) -> None:
    if a.fedavgm.form == "ema" and a.eta_g is not None and float(a.eta_g) != 1.0:
        raise ConfigError(f"algorithm.eta_g={float(a.eta_g):g} is not used by server_opt=momentum with "
                          f"{prefix}.form=ema (x <- x + m); use form=heavy_ball for a server learning rate, or leave "
                          "algorithm.eta_g=1")


class ServerOptimizer:
    """One server optimiser: ``step(x, D, state) -> (x_new, state)`` with x, D [d] and a state of [d] tensors.

    ``name`` is its ``algorithm.server_opt`` value, ``preset`` the name of the published rule it makes over plain
    FedAvg (``fedavgm``, ``fedadam``, ...)."""

    name = "server_opt"
    preset = ""

    def __init__(self, eta_g: float = 1.0):
        self.eta_g = float(eta_g)

    def init_state(self, global_flat: torch.Tensor) -> Dict[str, torch.Tensor]:
        return {}

    def step(self, x: torch.Tensor, direction: torch.Tensor,
             state: Dict[str, torch.Tensor]) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        raise NotImplementedError

    def shown(self) -> Tuple[Tuple[str, str], ...]:
        """The (key, value text) pairs the stack's description shows (key "" for a bare item)."""
        return ()


class Momentum(ServerOptimizer):
    """Server momentum (Hsu et al. 2019), heavy-ball or EMA form (module docstring)."""

    name, preset = "momentum", "fedavgm"

    def __init__(self, beta: float = 0.9, form: str = "heavy_ball", eta_g: float = 1.0):
        super().__init__(eta_g)
        p = checked(FedAvgMParams, "algorithm.fedavgm", beta=float(beta), form=form)
        self.beta, self.form = p.beta, p.form

    def shown(self):
        lr = (("eta_g", f"{self.eta_g:g}"),) if self.form == "heavy_ball" and self.eta_g != 1.0 else ()
        return (("beta", f"{self.beta:g}"), ("", self.form)) + lr

    def init_state(self, global_flat):
        return {"v": torch.zeros_like(global_flat)}

    def step(self, x, direction, state):
        v = state["v"].to(x.device, x.dtype)
        if self.form == "heavy_ball":
            v = self.beta * v + direction
            return x + self.eta_g * v, {"v": v}
        v = self.beta * v + (1.0 - self.beta) * direction
        return x + v, {"v": v}


class Adaptive(ServerOptimizer):
    """Reddi et al.'s adaptive server optimisers; ``rule`` in {adam, yogi, adagrad} (module docstring)."""

    RULES = ("adam", "yogi", "adagrad")

    def __init__(self, rule: str, beta1: float = 0.9, beta2: float = 0.99, tau: float = 1e-3,
                 eta_g: Optional[float] = None, v0: str = "zero"):
        super().__init__(ADAPTIVE_ETA_G.get(rule, ADAPTIVE_ETA_G["adam"]) if eta_g is None else eta_g)
        if rule not in self.RULES:
            raise ValueError(f"algorithm.server_opt must be one of {', '.join(self.RULES)} here, got {rule!r}")
        self.name, self.preset = rule, f"fed{rule}"
        p = checked(AdaptiveParams, "algorithm.adaptive", beta1=float(beta1), beta2=float(beta2), tau=float(tau),
                    v0=v0)
        self.beta1, self.beta2, self.tau, self.v0 = p.beta1, p.beta2, p.tau, p.v0

    def shown(self):
        b2 = () if self.name == "adagrad" else (("beta2", f"{self.beta2:g}"),)
        v0 = (("v0", "tau2"),) if self.v0 == "tau2" else ()
        return (("eta_g", f"{self.eta_g:g}"), ("beta1", f"{self.beta1:g}")) + b2 + (("tau", f"{self.tau:g}"),) + v0

    def init_state(self, global_flat):
        """m = 0 [d]; v = 0 [d] (``v0=zero``) or tau^2 [d] (``v0=tau2``, Reddi et al. Alg. 2)."""
        v = torch.zeros_like(global_flat) if self.v0 == "zero" else torch.full_like(global_flat, self.tau ** 2)
        return {"m": torch.zeros_like(global_flat), "v": v}

    def step(self, x, direction, state):
        d2 = direction * direction
        m = self.beta1 * state["m"].to(x.device, x.dtype) + (1.0 - self.beta1) * direction
        v = state["v"].to(x.device, x.dtype)
        if self.name == "adam":
            v = self.beta2 * v + (1.0 - self.beta2) * d2
        elif self.name == "yogi":
            v = v - (1.0 - self.beta2) * d2 * torch.sign(v - d2)
        else:
            v = v + d2
        return x + self.eta_g * m / (v.sqrt() + self.tau), {"m": m, "v": v}


class ServerOptimized(Wrapper):
    """``base`` with its plain server step replaced by ``opt`` on the base's pseudo-gradient; every client-side part
    is the base's. Over plain FedAvg it is the published rule ``opt.preset`` (FedAvgM, FedAdam, ...)."""

    def __init__(self, base: Algorithm, opt: ServerOptimizer):
        super().__init__(base)
        self.opt = opt
        self.name = opt.preset if base.describe() == "fedavg" else opt.name

    def shown(self):
        return self.opt.shown()

    def describe(self) -> Description:
        return Description(self.name, self.shown(), None if self.name == self.opt.preset else self.base.describe())

    def init_server_state(self, global_flat):
        state = dict(self.base.init_server_state(global_flat))
        state.update({OPT_PREFIX + k: v for k, v in self.opt.init_state(global_flat).items()})
        state[OPT_PREFIX + "update_norm"] = torch.zeros((), dtype=global_flat.dtype, device=global_flat.device)
        return state

    def aggregate(self, rctx, server_state, updates):
        own = {k: v for k, v in server_state.items() if not k.startswith(OPT_PREFIX)}
        opt = {k[len(OPT_PREFIX):]: v for k, v in server_state.items() if k.startswith(OPT_PREFIX)}
        base = self.base.aggregate(rctx, own, updates)
        if base.direction is None:
            raise NotImplementedError(f"{self.base.describe()} has no pseudo-gradient (it does not take "
                                      "algorithm.server_opt)")
        g = rctx.global_flat
        new, opt = self.opt.step(g, base.direction.to(g.device, g.dtype), opt)
        opt["update_norm"] = torch.linalg.vector_norm(new - g)
        return ServerStep(new, {**base.state, **{OPT_PREFIX + k: v for k, v in opt.items()}},
                          metrics={**base.metrics, "server_update_norm": float(opt["update_norm"])})


# the published FedAvg + server optimiser rules, as Python presets (conf/algorithm/<name>.yaml are the config ones)

def FedAvgM(beta: float = 0.9, form: str = "heavy_ball", aggregation: str = "weighted",  # noqa: N802
            eta_g: float = 1.0) -> ServerOptimized:
    """FedAvgM: FedAvg with server momentum."""
    return ServerOptimized(FedAvg(aggregation, eta_g), Momentum(beta, form, eta_g))


def _adaptive_preset(rule: str):
    def make(beta1: float = 0.9, beta2: float = 0.99, tau: float = 1e-3, aggregation: str = "weighted",
             eta_g: Optional[float] = None, v0: str = "zero") -> ServerOptimized:
        eta_g = ADAPTIVE_ETA_G[rule] if eta_g is None else eta_g
        return ServerOptimized(FedAvg(aggregation, eta_g), Adaptive(rule, beta1, beta2, tau, eta_g, v0))

    make.__name__ = make.__qualname__ = f"Fed{rule.capitalize()}"
    make.__doc__ = f"Fed{rule.capitalize()}: FedAvg with the adaptive server optimiser {rule} (Reddi et al. 2021)."
    return make


FedAdam, FedYogi, FedAdagrad = (_adaptive_preset(r) for r in Adaptive.RULES)


register(Rule(
    name="sgd", kind="server", label="server SGD", citation="McMahan et al., AISTATS 2017, Alg. 1",
    summary="the rule's own server step (x <- x + eta_g D for the rules with a pseudo-gradient D)",
    build=lambda base, p, ctx: base))

register(Rule(
    name="momentum", kind="server", label="FedAvgM", citation="Hsu et al., arXiv:1909.06335, 2019, Sec. 3",
    summary="server momentum on the pseudo-gradient (heavy-ball or EMA form); over FedAvg: FedAvgM",
    params=FedAvgMParams, section="fedavgm", check=_check_momentum, preset="fedavgm",
    neutral=("algorithm.fedavgm.beta=0", "algorithm.fedavgm.form=heavy_ball"),
    build=lambda base, p, ctx: ServerOptimized(base, Momentum(p.beta, p.form, ctx.eta_g))))

for _rule in Adaptive.RULES:
    register(Rule(
        name=_rule, kind="server", label=f"Fed{_rule.capitalize()}", citation="Reddi et al., ICLR 2021, Alg. 2",
        summary=f"the adaptive server optimiser {_rule.capitalize()} on the pseudo-gradient; over FedAvg: "
                f"Fed{_rule.capitalize()}",
        params=AdaptiveParams, section="adaptive", preset=f"fed{_rule}", default_eta_g=ADAPTIVE_ETA_G[_rule],
        build=lambda base, p, ctx, _rule=_rule: ServerOptimized(base, Adaptive(_rule, p.beta1, p.beta2, p.tau,
                                                                               ctx.eta_g, p.v0))))
