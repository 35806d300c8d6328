"""CCVR: classifier calibration with virtual representations (Luo et al. 2021; docs/algorithms.md, CCVR).

A wrapper that changes nothing during training. After the last round every client computes, with
the final global model, per-class count N_{c,i}, mean mu_{c,i} and covariance Sigma_{c,i} of its
penultimate features and uploads them once (C (f + f^2 + 1) floats); the server forms::

    N_c = sum_i N_{c,i};  mu_c = sum_i N_{c,i} / N_c mu_{c,i}
    Sigma_c = sum_i (N_{c,i} - 1)/(N_c - 1) Sigma_{c,i} + sum_i N_{c,i}/(N_c - 1) mu_{c,i} mu_{c,i}^T
              - N_c/(N_c - 1) mu_c mu_c^T

samples ``virtual_per_class`` features per class from N(mu_c, Sigma_c) and retrains only the classifier
(the model's last weighted layer) with cross-entropy: ``epochs`` passes of plain SGD (``lr``,
``batch_size``). The papers give neither M_c nor the schedule: these defaults are ours.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

from ..lazy import lazy_import
from ..seeding import torch_generator
from dataclasses import dataclass

from ..schema import param
from .base import Algorithm, Wrapper
from .registry import Rule, neuron_layers, register

torch = lazy_import("torch")  # executed on first use: fl-train --help and --cfg load no torch


@dataclass
class CCVRParams:
    virtual_per_class: int = param(200, "M_c virtual features sampled per class (not in the papers: our default)",
                                   ge=1)
    epochs: int = param(20, "classifier retraining epochs over the virtual features (our default)", ge=0)
    lr: float = param(0.01, "classifier retraining learning rate (our default)", gt=0)
    batch_size: int = param(64, "classifier retraining batch size", ge=1)


def client_feature_stats(feats: torch.Tensor, y: torch.Tensor, num_classes: int) -> List[Tuple[int, torch.Tensor, torch.Tensor]]:
    """Per class c: (N_c, mean [f], covariance [f, f] with ddof 1; zeros when N_c < 2)."""
    with torch.no_grad():
        out = []
        for c in range(num_classes):
            z = feats[y == c].double()
            n = z.shape[0]
            mean = z.mean(0) if n else torch.zeros(feats.shape[1], dtype=torch.float64, device=feats.device)
            cov = torch.cov(z.T) if n >= 2 else torch.zeros(feats.shape[1], feats.shape[1], dtype=torch.float64,
                                                            device=feats.device)
            out.append((n, mean, cov.reshape(feats.shape[1], feats.shape[1])))
        return out


def global_gaussians(stats: List[List[Tuple[int, torch.Tensor, torch.Tensor]]]) -> Dict[int, Tuple[int, torch.Tensor, torch.Tensor]]:
    """Combine the clients' per-class statistics into N_c, mu_c, Sigma_c (the formula above)."""
    out = {}
    for c in range(len(stats[0])):
        parts = [s[c] for s in stats if s[c][0] > 0]
        Nc = sum(n for n, _, _ in parts)
        if Nc == 0:
            continue
        mu = sum(n * m for n, m, _ in parts) / Nc
        if Nc < 2:
            out[c] = (Nc, mu, torch.zeros_like(parts[0][2]))
            continue
        cov = sum((n - 1) / (Nc - 1) * S + n / (Nc - 1) * torch.outer(m, m) for n, m, S in parts)
        cov = cov - Nc / (Nc - 1) * torch.outer(mu, mu)
        out[c] = (Nc, mu, cov)
    return out


class CCVR(Wrapper):
    name = "ccvr"

    def __init__(self, base: Algorithm, classifier: str, virtual_per_class: int = 200, epochs: int = 20,
                 lr: float = 0.01, batch_size: int = 64):
        super().__init__(base)
        self.classifier = classifier
        self.virtual_per_class = int(virtual_per_class)
        self.epochs, self.lr, self.batch_size = int(epochs), float(lr), int(batch_size)

    def post_training(self, post):
        inner = self.base.post_training(post)
        flat = inner if inner is not None else post.global_flat
        model, data = post.model, post.data
        from ..params import flatten_params, load_flat

        load_flat(model, flat)
        model.eval()
        stats = []
        with torch.no_grad():
            for idx in data.indices:
                if idx.numel() == 0:
                    continue
                feats = torch.cat([model.forward_features(data.x[idx[s:s + 512]])[1]
                                   for s in range(0, idx.numel(), 512)])
                stats.append(client_feature_stats(feats, data.y[idx], post.num_classes))
        gauss = global_gaussians(stats)
        g = torch_generator("ccvr", post.seed, device=str(flat.device) if flat.device.type == "cpu" else "cpu")
        vx, vy = [], []
        for c, (_, mu, cov) in gauss.items():
            f = mu.shape[0]
            jitter = 1e-5 * torch.eye(f, dtype=cov.dtype, device=cov.device)
            L = torch.linalg.cholesky(0.5 * (cov + cov.T) + jitter)
            eps = torch.randn(self.virtual_per_class, f, generator=g, dtype=torch.float64).to(cov.device)
            vx.append(mu + eps @ L.T)
            vy.append(torch.full((self.virtual_per_class,), c, dtype=torch.long, device=cov.device))
        vx = torch.cat(vx).to(flat.dtype)
        vy = torch.cat(vy)
        head = dict(model.named_modules())[self.classifier]
        model.train()
        for _ in range(self.epochs):
            perm = torch.randperm(vx.shape[0], generator=g).to(vx.device)
            for s in range(0, vx.shape[0], self.batch_size):
                b = perm[s:s + self.batch_size]
                loss = torch.nn.functional.cross_entropy(head(vx[b]), vy[b])
                grads = torch.autograd.grad(loss, list(head.parameters()))
                with torch.no_grad():
                    for p, gr in zip(head.parameters(), grads):
                        p.add_(gr, alpha=-self.lr)
        model.eval()
        return flatten_params(model).to(flat.device)

    def one_off_upload_floats(self, num_classes: int, f: int) -> int:
        """C (f + f^2 + 1): the statistics each client uploads once (docs/algorithms.md, Communication accounting)."""
        return num_classes * (f + f * f + 1)


def classifier_name(model) -> str:
    """The module CCVR retrains: the model's last neuron layer, else the last prefix of its last unit (where every
    FLModel keeps its linear classifier, :meth:`~fl_core.models.base.FLModel.feature_dim`: ``fc`` of the ResNets,
    ``heads.head`` of the ViTs), else ``fc``."""
    layers = neuron_layers(model)
    if layers:
        return layers[-1][0]
    units = getattr(model, "unit_prefixes", None)
    return str(list(units[-1])[-1]) if units else "fc"


register(Rule(
    name="ccvr", kind="wrapper", label="CCVR", citation="Luo et al., NeurIPS 2021, Sec. 4 (Eq. 4-5)",
    summary="after training, retrain the classifier on virtual features from the clients' class Gaussians",
    params=CCVRParams, neutral=("algorithm.ccvr.epochs=0",),
    build=lambda base, p, ctx: CCVR(base, classifier_name(ctx.model), p.virtual_per_class, p.epochs, p.lr,
                                    p.batch_size)))
