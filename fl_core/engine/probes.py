"""Activation probes: mean activation per neuron of a model's weighted layers over some data.

A model exposes its weighted layers in forward order with ``neuron_layers()`` -> [(name, module,
kind)], kind ``conv`` or ``linear``, the last one being the classifier. A neuron is an output channel
(conv) or an output unit (linear). Its activation is the post-ReLU output, averaged over spatial
positions for convolutions; the classifier's raw logits are used as they are (an implementation
choice, docs/algorithms.md).
"""

from __future__ import annotations

from typing import List, Tuple

import torch
import torch.nn.functional as F


@torch.no_grad()
def layer_activation_means(model: torch.nn.Module, x: torch.Tensor, batch_size: int = 512,
                           y: torch.Tensor = None, num_classes: int = 0) -> Tuple[List[torch.Tensor], List[int]]:
    """Mean activation per neuron of every layer in ``model.neuron_layers()`` over ``x`` [N, ...].

    Runs in eval mode (no dropout) without gradients. Returns ``(means, spatial)``: ``means[l]`` is
    [M_l] (or [num_classes, M_l], per-class means, when ``y`` is given), ``spatial[l]`` the number of
    output positions H*W of a conv layer (1 for linear layers).

    Raises:
        AttributeError: the model has no ``neuron_layers()``.
    """
    layers = model.neuron_layers()
    last = len(layers) - 1
    sums: List = [None] * len(layers)
    spatial = [1] * len(layers)
    current = {}

    def make_hook(i, kind):
        def hook(_module, _inp, out):
            a = out if i == last else F.relu(out)
            if kind == "conv":
                spatial[i] = int(out.shape[-1] * out.shape[-2])
                a = a.mean(dim=(-2, -1))
            a = a.double()
            if y is None:
                s = a.sum(0)
            else:
                s = torch.zeros(num_classes, a.shape[1], dtype=a.dtype, device=a.device)
                s.index_add_(0, current["y"], a)
            sums[i] = s if sums[i] is None else sums[i] + s
        return hook

    handles = [m.register_forward_hook(make_hook(i, kind)) for i, (_, m, kind) in enumerate(layers)]
    was_training = model.training
    model.eval()
    try:
        for s in range(0, x.shape[0], batch_size):
            if y is not None:
                current["y"] = y[s:s + batch_size]
            model(x[s:s + batch_size])
        if x.shape[0] == 0:  # no data (an empty client): shapes from one blank input, all means 0
            if y is not None:
                current["y"] = torch.zeros(1, dtype=torch.long, device=x.device)
            model(torch.zeros((1,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device))
            sums = [torch.zeros_like(t) for t in sums]
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    if y is None:
        n = max(1, x.shape[0])
        return [s / n for s in sums], spatial
    counts = torch.bincount(y, minlength=num_classes).clamp_min(1).to(sums[0].dtype)[:, None]
    return [s / counts for s in sums], spatial


@torch.no_grad()
def neuron_drift(model: torch.nn.Module, load, global_flat: torch.Tensor, updates, label_counts,
                 x: torch.Tensor, y: torch.Tensor, num_classes: int) -> dict:
    """Share of bound neurons that drift (the neuron-drift probe of docs/algorithms.md), per hidden layer, over a probe set.

    A neuron of a hidden layer is bound to class c when its mean activation over the probe samples of
    class c is larger than over every other class (Definition 1 with class means instead of the
    per-sample min/max). For each participating client i and each class c missing from its data,
    the metric counts c's bound neurons whose class-c mean activation fell after the client's local
    training (model theta + Delta_i vs the broadcast theta). Returns ``{"neuron_drift_l<l>": share}``
    for the hidden layers (1-indexed) and ``neuron_drift`` for the last hidden layer; {} when no client
    missed a class.

    Args:
        load: ``load(model, flat)`` copies a flat parameter vector into ``model``.
        updates: the round's client updates (``client_id``, ``delta``).
        label_counts: per client id, the local class counts [C].
        x, y: probe samples [n, ...] and labels [n].
    """
    load(model, global_flat)
    before, _ = layer_activation_means(model, x, y=y, num_classes=num_classes)
    hidden = len(before) - 1
    present = torch.bincount(y, minlength=num_classes) > 0
    bound = []
    for l in range(hidden):
        m = before[l]  # [C, M]
        top2 = torch.topk(m, 2, dim=0).values if num_classes > 1 else m
        owner = torch.argmax(m, dim=0)
        strict = top2[0] > top2[1] if num_classes > 1 else torch.ones_like(owner, dtype=torch.bool)
        bound.append([(owner == c) & strict for c in range(num_classes)])
    dropped = [0] * hidden
    total = [0] * hidden
    for u in updates:
        missing = [c for c in range(num_classes) if int(label_counts[u.client_id][c]) == 0 and bool(present[c])]
        if not missing:
            continue
        load(model, global_flat + u.delta)
        after, _ = layer_activation_means(model, x, y=y, num_classes=num_classes)
        for l in range(hidden):
            for c in missing:
                b = bound[l][c]
                total[l] += int(b.sum())
                dropped[l] += int((after[l][c][b] < before[l][c][b]).sum())
    load(model, global_flat)
    out = {f"neuron_drift_l{l + 1}": dropped[l] / total[l] for l in range(hidden) if total[l] > 0}
    if hidden and total[hidden - 1] > 0:
        out["neuron_drift"] = out[f"neuron_drift_l{hidden}"]
    return out
