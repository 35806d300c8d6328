"""Model registry. ``build_model`` turns a :class:`~fl_core.config.ModelConfig` into an :class:`FLModel`."""

from __future__ import annotations

from typing import Callable, Dict, Tuple

from .base import FLModel
from .cnn import McMahanCNN, SmallCNN, StandardCNN
from .linear import MLP, LogisticRegression

MODELS: Dict[str, Callable[..., FLModel]] = {
    "small_cnn": SmallCNN,
    "std_cnn": StandardCNN,
    "mcmahan_cnn": McMahanCNN,
    "mlp": MLP,
    "logreg": LogisticRegression,
}

# model.name=auto picks the paper model of each dataset (small_cnn for the 8x8 digits)
AUTO_MODEL = {"digits": "small_cnn", "mnist": "mcmahan_cnn", "fmnist": "mcmahan_cnn",
              "cifar10": "std_cnn", "cifar100": "std_cnn"}


def resolve_model_name(name: str, dataset: str) -> str:
    """``auto`` -> the dataset's default model; other names unchanged."""
    return AUTO_MODEL[dataset] if name == "auto" else name


def build_model(cfg, dataset: str, input_shape: Tuple[int, int, int], num_classes: int) -> FLModel:
    """Build the model named by ``cfg.name`` for inputs ``[B, *input_shape]`` and ``num_classes`` logits.

    Raises:
        ValueError: unknown model name (``model.name``) or an input too small for it.
    """
    name = resolve_model_name(cfg.name, dataset)
    if name not in MODELS:
        raise ValueError(f"model.name must be one of auto, {', '.join(MODELS)}, got {name!r}")
    if name == "mlp":
        return MLP(input_shape, num_classes, hidden=cfg.hidden)
    return MODELS[name](input_shape, num_classes)


__all__ = ["FLModel", "MODELS", "build_model", "resolve_model_name"]
