"""Model registry. ``build_model`` turns a :class:`~fl_core.config.ModelConfig` into an :class:`FLModel`."""

from __future__ import annotations

from typing import Callable, Dict, Optional, Sequence, Tuple

from .base import FLModel
from .char_lstm import CharLSTM
from .quadratic import QuadraticModel
from .cnn import McMahanCNN, PflCNN, SmallCNN, StandardCNN, TinyCNN, resolve_units
from .linear import MLP, LogisticRegression
from .logreg_binary import BinaryLogisticRegression
from .mnist1d import MNIST1DCNN, MNIST1DGRU, MNIST1DMLP
from .resnet import ResNet18GN, ResNet34GN, ResNetGN
from .vgg import VGG9, VGG11, VGG19
from .vit import ViTB16, ViTTiny

MODELS: Dict[str, Callable[..., FLModel]] = {
    "small_cnn": SmallCNN,
    "std_cnn": StandardCNN,
    "mcmahan_cnn": McMahanCNN,
    "mlp": MLP,
    "logreg": LogisticRegression,
    "tiny_cnn": TinyCNN,
    "resnet18": ResNet18GN,
    "resnet34": ResNet34GN,
    "vgg9": VGG9,
    "vgg11": VGG11,  # FedBCGD (docs/algorithms.md, Model catalogue): repository head 512->100->10 / 512->256->100
    "vgg19": VGG19,
    # the MNIST-1D authors' models (docs/algorithms.md, Model catalogue); their logistic regression is logreg
    "m1d_mlp": MNIST1DMLP,
    "m1d_cnn": MNIST1DCNN,
    "m1d_gru": MNIST1DGRU,
    # torchvision's Vision Transformers (docs/algorithms.md, Model catalogue): ViT-B/16 (FedBCGD's ViT runs), a small one
    "vit_b_16": ViTB16,
    "vit_tiny": ViTTiny,
    "logreg_binary": BinaryLogisticRegression,  # docs/algorithms.md, FedBCGD's convex problem
    "quadratic": QuadraticModel,  # x itself, for dataset=quadratic (fl_core/models/quadratic.py)
    "pfl_cnn": PflCNN,  # pfl-research's CIFAR-10 CNN (docs/benchmarks.md, pfl-research's CIFAR-10 cross-device set-up)
    "char_lstm": CharLSTM,  # LEAF's / FedProx's Shakespeare model (fl_core/models/char_lstm.py)
}

# model.name=auto picks the paper model of each dataset (small_cnn for the 8x8 digits; VGG-9 for CINIC-10,
# which only FedNLR uses; FedProx's multinomial logistic regression for synthetic; the MNIST-1D authors' CNN)
AUTO_MODEL = {"digits": "small_cnn", "mnist": "mcmahan_cnn", "fmnist": "mcmahan_cnn",
              "cifar10": "std_cnn", "cifar100": "std_cnn", "tiny_imagenet": "tiny_cnn", "cinic10": "vgg9",
              "synthetic": "logreg", "mnist1d": "m1d_cnn", "quadratic": "quadratic",
              "emnist": "mcmahan_cnn",  # as MNIST (every dataset.split; 28x28 grey characters)
              "femnist": "mcmahan_cnn", "shakespeare": "char_lstm"}  # LEAF's baselines' models


def resolve_model_name(name: str, dataset: str) -> str:
    """``auto`` -> the dataset's default model; other names unchanged."""
    return AUTO_MODEL[dataset] if name == "auto" else name


def unit_layouts(name: str) -> Tuple[str, ...]:
    """The FedBug unit layouts ``model.units`` may name for model ``name`` besides ``default``.

    Empty for models with a single layout (they accept only ``default``).
    """
    return tuple(getattr(MODELS[name], "UNIT_LAYOUTS", ()))


def build_model(cfg, dataset: str, input_shape: Tuple[int, int, int], num_classes: int,
                input_norm: Optional[Tuple[Sequence[float], Sequence[float]]] = None) -> FLModel:
    """Build the model named by ``cfg.name`` for inputs ``[B, *input_shape]`` and ``num_classes`` logits.

    ``cfg.units`` picks the FedBug unit layout (``tiny_cnn``: code5 | paper6; ``resnet18``/``resnet34``:
    module | block; ``default`` everywhere, the only value for the other models); ``cfg.norm_groups`` is
    the ResNets' GroupNorm group count; ``cfg.weights`` a local file of pretrained ``vit_b_16`` weights.
    ``input_norm`` = (mean, std) per channel of ``x / scale`` the inputs were normalised with
    (``FLDataset.mean`` / ``.std``): ``vit_b_16`` undoes it to apply ImageNet's (None: inputs in [0, 1]); the
    other models ignore it.

    Raises:
        ValueError: unknown model name (``model.name``), a unit layout the model does not have
            (``model.units``), a bad ``model.norm_groups``, or an input too small for the model (or, for the
            ``m1d_*`` sequence models and ``char_lstm``, not a sequence ``[1, 1, L]``: names ``model.name`` and ``dataset``).
        ConfigError: ``model.weights`` cannot be loaded (one line naming the path and the first bad key).
        ConfigError: ``logreg_binary``: a ``model.binary_map`` the dataset's classes do not allow.
    """
    name = resolve_model_name(cfg.name, dataset)
    if name not in MODELS:
        raise ValueError(f"model.name must be one of auto, {', '.join(MODELS)}, got {name!r}")
    units = str(getattr(cfg, "units", "default"))
    layouts = unit_layouts(name)
    resolve_units(name, units, layouts, "default")  # one-line ValueError naming model.units
    if name == "mlp":
        return MLP(input_shape, num_classes, hidden=cfg.hidden)
    if name == "tiny_cnn":
        return TinyCNN(input_shape, num_classes, units=units)
    if name in ("resnet18", "resnet34"):
        return MODELS[name](input_shape, num_classes, units=units, norm_groups=int(getattr(cfg, "norm_groups", 2)))
    if name in ("vgg11", "vgg19"):
        return MODELS[name](input_shape, num_classes, init=str(getattr(cfg, "vgg_init", "kaiming")))
    if name.startswith("m1d_") or name == "char_lstm":
        return MODELS[name](input_shape, num_classes, dataset=dataset)
    if name == "vit_b_16":
        mean, std = input_norm if input_norm is not None else (None, None)
        return ViTB16(input_shape, num_classes, weights=getattr(cfg, "weights", None), input_mean=mean, input_std=std)
    if name == "logreg_binary":
        return BinaryLogisticRegression(input_shape, num_classes, binary_map=str(cfg.binary_map),
                                        lambda_factor=float(cfg.lambda_factor), nonconvex=bool(cfg.nonconvex))
    return MODELS[name](input_shape, num_classes)


__all__ = ["FLModel", "QuadraticModel", "CharLSTM", "MODELS", "AUTO_MODEL", "BinaryLogisticRegression", "MNIST1DCNN", "MNIST1DGRU", "MNIST1DMLP",
           "PflCNN", "ResNetGN", "VGG9", "VGG11", "VGG19", "build_model", "resolve_model_name", "unit_layouts", "ViTB16",
           "ViTTiny"]
