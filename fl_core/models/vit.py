"""Vision Transformers (Dosovitskiy et al., ICLR 2021) from torchvision: ViT-B/16 for the FedBCGD ViT settings and
a small ViT for CPU runs (docs/algorithms.md, Model catalogue, FedBCGD blocks and FedBCGD).

Both are torchvision's ``VisionTransformer`` (pre-norm encoder blocks ``ln_1 -> MultiheadAttention -> ln_2 -> MLP``
with GELU, a learned class token and learned position embeddings, LayerNorm eps 1e-6, no dropout, the head
``heads.head = Linear(hidden, C)`` initialised to zero), whose children are adopted so that the parameter names
are torchvision's (``class_token``, ``conv_proj.weight``, ``encoder.pos_embedding``,
``encoder.layers.encoder_layer_0.self_attention.in_proj_weight``, ``encoder.ln.weight``, ``heads.head.weight``, ...)
and a torchvision state dict loads as it is. There are no buffers.

``vit_b_16`` (:class:`ViTB16`): ``torchvision.models.vit_b_16(weights=None)`` with a C-way head: patch 16, 12
layers, 12 heads, hidden 768, MLP 3072, 224x224 inputs. d = 85,798,656 + 769 C (85,875,556 for C = 100,
85,952,456 for C = 200). Per encoder layer 7,087,872; embeddings 742,656 (conv_proj 590,592, class_token 768,
pos_embedding 151,296); final LayerNorm 1,536. ``weights`` loads a local file of torchvision's ImageNet weights
(:func:`load_torchvision_weights`). The data are stored at their own size (32x32 CIFAR, 64x64 Tiny-ImageNet) and
normalised with the dataset's statistics (``FLDataset.normalize``); :meth:`ViTB16.prepare` turns every batch into
what the pretrained network expects, inside the forward pass:

1. undo the dataset's normalisation and apply ImageNet's, one per-channel affine map
   ``x * std / s_in + (mean - m_in) / s_in`` (m_in = (0.485, 0.456, 0.406), s_in = (0.229, 0.224, 0.225));
2. resize (bilinear) so that the shorter side is 256, then take the central 224x224 crop.

Step 2 is torchvision's preset of these weights (``ViT_B_16_Weights.IMAGENET1K_V1.transforms``: resize 256,
centre crop 224) and the FedBCGD paper's Tiny-ImageNet preprocessing (section 12.2: "adjusted the size to 256 x 256
and crop to 224 x 224"); the paper states none for CIFAR-100, and the same two steps are used for every dataset
(on 32x32 images the crop drops the outer 2 of the 32 pixels on each side). Bilinear interpolation commutes with a
per-channel affine map, so step 1 runs on the small image. Only the batch in flight is ever 224x224.

``vit_tiny`` (:class:`ViTTiny`): ``VisionTransformer`` with patch 4, 12 layers, 4 heads, hidden 64, MLP 256 on
the images as stored (32x32: 64 patches + the class token), trained from scratch; no resize, no renormalisation.
It has ViT-B's layer layout at a CPU-friendly width, so ViT-B's FedBCGD block grouping applies to it unchanged.
d = 607,296 + 65 C for 3x32x32 inputs (613,796 for C = 100).

Initialisation (:meth:`VisionTransformerFL.init_parameters`): torchvision's, drawn from torch's global generator; a
run seeds it and calls it after the layers' own resets (:meth:`FLModel.init_parameters`), so the global model is a
function of the run's seed. With ``weights`` the file's tensors then replace everything but the head, at
construction and again at the run's initialisation: a run starts from the pretrained network.

Units (FedBug, ``unit_prefixes``; docs/algorithms.md, FedBug units): one per encoder layer; the embeddings
(``conv_proj``, ``class_token``, ``encoder.pos_embedding``) join the first, the final ``encoder.ln`` and the head
``heads.head`` the last (the classifier is the last prefix of the last unit, as :meth:`FLModel.feature_dim`
reads it). Features: the class token's output after ``encoder.ln`` ``[B, hidden]``, the head's input.

FedNLR refuses both (no ``neuron_layers()``, as the ResNets): its neuron-wise rates need conv / linear layers whose
forward hooks see their outputs before a ReLU, while the attention's input projection is the raw parameter
``in_proj_weight`` of ``nn.MultiheadAttention``, whose output projection is applied functionally (its module hook
never fires), the MLP uses GELU, and ``class_token`` / ``pos_embedding`` / the LayerNorms have no neurons.

torchvision is imported through :func:`fl_core.compat.torchvision` only.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from fl_core.compat import torchvision
from fl_core.schema import ConfigError

from .base import FLModel

IMAGENET_MEAN = (0.485, 0.456, 0.406)  # torchvision's ImageNet preset
IMAGENET_STD = (0.229, 0.224, 0.225)
RESIZE, CROP = 256, 224  # ViT_B_16_Weights.IMAGENET1K_V1: resize the shorter side to 256, centre crop 224
HEAD = "heads.head"  # the classifier; never loaded from a weights file
_EMBEDDINGS = ("conv_proj", "class_token", "encoder.pos_embedding")
_FINAL_NORM = "encoder.ln"
# torchvision < 0.13 named the MLP's linears linear_1 / linear_2 (what the published file may hold); torchvision's
# MLPBlock renames them on loading the same way
_LEGACY_MLP = {"mlp.linear_1.": "mlp.0.", "mlp.linear_2.": "mlp.3."}


def encoder_layer(i: int) -> str:
    """The name of encoder layer ``i`` (0-based): ``encoder.layers.encoder_layer_<i>``."""
    return f"encoder.layers.encoder_layer_{i}"


def vit_units(num_layers: int) -> List[List[str]]:
    """One unit per encoder layer, the embeddings in the first and ``encoder.ln`` + ``heads.head`` in the last."""
    units = [[encoder_layer(i)] for i in range(num_layers)]
    units[0] = [*_EMBEDDINGS, *units[0]]
    units[-1] = [*units[-1], _FINAL_NORM, HEAD]
    return units


def vit_blocks(num_layers: int, per_block: int) -> Tuple[List[List[str]], List[str]]:
    """FedBCGD blocks of ``per_block`` consecutive encoder layers, the embeddings in the first block and
    ``encoder.ln`` in the last; the shared block is the head (docs/algorithms.md, FedBCGD blocks)."""
    blocks = [[encoder_layer(i) for i in range(s, s + per_block)] for s in range(0, num_layers, per_block)]
    blocks[0] = [*_EMBEDDINGS, *blocks[0]]
    blocks[-1] = [*blocks[-1], _FINAL_NORM]
    return blocks, [HEAD]


class VisionTransformerFL(FLModel):
    """A torchvision ``VisionTransformer`` as an :class:`FLModel` (module docstring).

    Input ``[B, C_in, H, W]``; :meth:`prepare` maps it to the network's ``[B, C_in, S, S]``; output logits ``[B, C]``;
    features ``[B, hidden]``.
    """

    def __init__(self, net: nn.Module):
        super().__init__()
        self.image_size = int(net.image_size)
        self.patch_size = int(net.patch_size)
        self.hidden_dim = int(net.hidden_dim)
        self.num_layers = len(net.encoder.layers)
        self.class_token = net.class_token
        # adopt torchvision's children so that parameter names carry no wrapper prefix
        for name, child in net.named_children():
            self.add_module(name, child)
        self.unit_prefixes = vit_units(self.num_layers)

    @torch.no_grad()
    def init_parameters(self) -> None:
        """torchvision's ``VisionTransformer`` initialisation, every parameter drawn again from torch's global
        generator (the run seeds it; :meth:`FLModel.init_parameters`): patch embedding truncated normal with std
        sqrt(1 / fan_in) and zero bias, class token 0, position embeddings N(0, 0.02^2), attention
        ``in_proj_weight`` Xavier-uniform with zero biases and ``out_proj.weight`` PyTorch's Linear default, MLP
        weights Xavier-uniform with biases N(0, 1e-12), LayerNorms 1 / 0, head 0."""
        c = self.conv_proj
        nn.init.trunc_normal_(c.weight, std=math.sqrt(1 / (c.in_channels * c.kernel_size[0] * c.kernel_size[1])))
        nn.init.zeros_(c.bias)
        nn.init.zeros_(self.class_token)
        nn.init.normal_(self.encoder.pos_embedding, std=0.02)
        for layer in self.encoder.layers:
            layer.ln_1.reset_parameters()
            layer.self_attention.out_proj.reset_parameters()
            layer.self_attention._reset_parameters()  # Xavier in_proj_weight, zero in_proj_bias and out_proj.bias
            layer.ln_2.reset_parameters()
            for m in layer.mlp.modules():
                if isinstance(m, nn.Linear):
                    nn.init.xavier_uniform_(m.weight)
                    nn.init.normal_(m.bias, std=1e-6)
        self.encoder.ln.reset_parameters()
        nn.init.zeros_(self.heads.head.weight)
        nn.init.zeros_(self.heads.head.bias)

    def prepare(self, x: torch.Tensor) -> torch.Tensor:
        """The network's input for a batch of stored inputs; identity here."""
        return x

    def forward_features(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        x = self.prepare(x)
        n = x.shape[0]
        x = self.conv_proj(x)  # [B, hidden, S/p, S/p]: torchvision's VisionTransformer.forward from here on
        x = x.reshape(n, self.hidden_dim, -1).permute(0, 2, 1)
        x = torch.cat([self.class_token.expand(n, -1, -1), x], dim=1)
        f = self.encoder(x)[:, 0]
        return self.heads(f), f


class ViTB16(VisionTransformerFL):
    """torchvision's ViT-B/16 with a ``num_classes``-way head, optionally ImageNet-pretrained from a local file.

    Args:
        input_shape: ``(3, H, W)``, any H, W (resized in :meth:`prepare`).
        num_classes: C.
        weights: path of a torchvision ViT-B/16 state dict (``ViT_B_16_Weights.IMAGENET1K_V1``,
            ``vit_b_16-c867db91.pth``); every tensor but the head's is loaded (:func:`load_torchvision_weights`).
            None: torchvision's random initialisation.
        input_mean, input_std: per-channel mean and std of ``x / scale`` the inputs were normalised with
            (``FLDataset.mean`` / ``.std``); None: the inputs are ``x / scale`` in [0, 1] (mean 0, std 1).

    Raises:
        ValueError: inputs without 3 channels (names the model), or a mean/std of another length.
        ConfigError: ``weights`` cannot be loaded (one line naming ``model.weights``, the path and the first
            missing or mismatched key).
    """

    def __init__(self, input_shape: Tuple[int, int, int], num_classes: int, weights: Optional[str] = None,
                 input_mean: Optional[Sequence[float]] = None, input_std: Optional[Sequence[float]] = None):
        if len(input_shape) != 3 or int(input_shape[0]) != 3:
            raise ValueError(f"vit_b_16 needs RGB images [3, H, W] (its patch embedding is the ImageNet one), "
                             f"got inputs {list(input_shape)}")
        mean = tuple(float(m) for m in (input_mean if input_mean is not None else (0.0,) * 3))
        std = tuple(float(s) for s in (input_std if input_std is not None else (1.0,) * 3))
        if len(mean) != 3 or len(std) != 3:
            raise ValueError(f"vit_b_16 needs one input mean and std per channel (3), got {mean} / {std}")
        super().__init__(torchvision().models.vit_b_16(weights=None, num_classes=num_classes))
        # step 1 of prepare(): x * scale + shift, with x the dataset-normalised input
        self.input_scale = tuple(s / si for s, si in zip(std, IMAGENET_STD))
        self.input_shift = tuple((m - mi) / si for m, mi, si in zip(mean, IMAGENET_MEAN, IMAGENET_STD))
        self.weights = None if weights is None else str(weights)
        if weights is not None:
            load_torchvision_weights(self, weights)

    @torch.no_grad()
    def init_parameters(self) -> None:
        """torchvision's initialisation (:meth:`VisionTransformerFL.init_parameters`), then, with ``weights``, the
        file's tensors for everything but the head (read again: a run's initialisation keeps the pretrained
        network)."""
        super().init_parameters()
        if self.weights is not None:
            load_torchvision_weights(self, self.weights)

    def prepare(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, 3, H, W]`` dataset-normalised -> ``[B, 3, 224, 224]`` ImageNet-normalised (module docstring): the
        per-channel affine map, a bilinear resize of the shorter side to 256 (antialiased when shrinking, as
        torchvision's preset) and the central 224x224 crop."""
        scale = torch.tensor(self.input_scale, dtype=x.dtype, device=x.device).view(1, 3, 1, 1)
        shift = torch.tensor(self.input_shift, dtype=x.dtype, device=x.device).view(1, 3, 1, 1)
        x = x * scale + shift
        h, w = int(x.shape[-2]), int(x.shape[-1])
        short = min(h, w)
        size = (RESIZE, int(RESIZE * w / h)) if h == short else (int(RESIZE * h / w), RESIZE)
        if (h, w) != size:
            x = F.interpolate(x, size=size, mode="bilinear", align_corners=False, antialias=short > RESIZE)
        top = int(round((size[0] - CROP) / 2.0))
        left = int(round((size[1] - CROP) / 2.0))
        return x[..., top:top + CROP, left:left + CROP]


class ViTTiny(VisionTransformerFL):
    """A small torchvision ``VisionTransformer`` trained from scratch on the stored images (module docstring).

    Patch 4, 12 layers, 4 heads, hidden 64, MLP 256; ``C_in`` other than 3 gets its own patch embedding (with
    torchvision's init: truncated normal, std sqrt(1 / fan_in), zero bias).

    Args:
        input_shape: ``(C_in, S, S)`` with S a multiple of 4.
        num_classes: C.

    Raises:
        ValueError: inputs that are not square images with a side divisible by 4 (names the model).
    """

    PATCH, LAYERS, HEADS, HIDDEN, MLP = 4, 12, 4, 64, 256

    def __init__(self, input_shape: Tuple[int, int, int], num_classes: int):
        c_in, h, w = (int(v) for v in input_shape)
        if h != w or h % self.PATCH or h < self.PATCH:
            raise ValueError(f"vit_tiny needs square images with a side divisible by its patch size {self.PATCH}, "
                             f"got inputs {list(input_shape)}")
        net = torchvision().models.VisionTransformer(
            image_size=h, patch_size=self.PATCH, num_layers=self.LAYERS, num_heads=self.HEADS,
            hidden_dim=self.HIDDEN, mlp_dim=self.MLP, num_classes=num_classes)
        if c_in != 3:
            stem = nn.Conv2d(c_in, self.HIDDEN, kernel_size=self.PATCH, stride=self.PATCH)
            nn.init.trunc_normal_(stem.weight, std=math.sqrt(1 / (c_in * self.PATCH * self.PATCH)))
            nn.init.zeros_(stem.bias)
            net.conv_proj = stem
        super().__init__(net)


def _shape(t: torch.Tensor) -> List[int]:
    return list(t.shape)


def load_torchvision_weights(model: VisionTransformerFL, path: str) -> None:
    """Load a torchvision ViT state dict from the local file ``path`` into ``model``, all but the head.

    The file is read with ``torch.load(weights_only=True)``; it must hold every tensor of the model but
    ``heads.head.*`` under torchvision's name and with the model's shape (the legacy names ``mlp.linear_1`` /
    ``mlp.linear_2`` of older torchvision files are read as ``mlp.0`` / ``mlp.3``, as torchvision does) and no other
    tensor but a head of any size (ImageNet's 1000 classes), which is left out: the model keeps its own freshly
    initialised C-way head. Nothing is downloaded.

    Raises:
        ConfigError: one line starting ``model.weights=<path>: ``: no such file, not readable by ``torch.load``,
            not a mapping of names to tensors, or the first key the model needs that the file lacks (with the first
            key it has that the model lacks), the first key of another shape, or the first key the model lacks.
    """
    where = f"model.weights={path}"
    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(f"{where}: no such file (a local copy of torchvision's vit_b_16 ImageNet weights, "
                          "vit_b_16-c867db91.pth)")
    try:
        raw = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 (any unreadable file: one line)
        first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        raise ConfigError(f"{where}: torch.load cannot read it: {first}") from None
    if not isinstance(raw, Mapping) or not all(isinstance(v, torch.Tensor) for v in raw.values()):
        raise ConfigError(f"{where}: not a state dict (a mapping of parameter names to tensors), got "
                          f"{type(raw).__name__}")
    state: Dict[str, torch.Tensor] = {}
    for key, value in raw.items():
        name = key
        for old, new in _LEGACY_MLP.items():
            name = name.replace(old, new)
        state[name] = value
    own = model.state_dict()
    needed = [k for k in own if not k.startswith(HEAD + ".")]
    extra = [k for k in state if k not in own and not k.startswith(HEAD + ".")]
    for key in needed:
        if key not in state:
            also = f" (it has {extra[0]}, which the model has not)" if extra else ""
            raise ConfigError(f"{where}: key {key} is missing{also}; expected a torchvision vit_b_16 state dict")
        if state[key].shape != own[key].shape:
            raise ConfigError(f"{where}: key {key} has shape {_shape(state[key])}, the model needs "
                              f"{_shape(own[key])}")
    if extra:
        raise ConfigError(f"{where}: key {extra[0]} is not in the model")
    model.load_state_dict({k: (own[k] if k.startswith(HEAD + ".") else state[k]) for k in own})
