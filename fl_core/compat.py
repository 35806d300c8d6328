"""The one place where torchvision is imported.

The torchvision wheel on the package index is a CUDA build. Next to the CPU
torch wheel its compiled extension (``torchvision._C``) cannot load, and the
module ``torchvision._meta_registrations`` then fails at import time with
``RuntimeError: operator torchvision::nms does not exist``. Everything this
project uses from torchvision (model definitions, dataset readers) is pure
Python, so when, and only when, that exact failure happens we import
torchvision again with the meta registrations replaced by an empty module.
The compiled operators (``torchvision.ops.nms`` etc.) stay unavailable in that
case; :data:`TORCHVISION_OPS` says which case we are in.

Every module of the project imports torchvision through :func:`torchvision`.
"""

from __future__ import annotations

import sys
import types
from functools import lru_cache

TORCHVISION_OPS: bool | None = None  # set by torchvision(): True if the C ops loaded


def _drop_partial_import() -> None:
    for name in list(sys.modules):
        if name == "torchvision" or name.startswith("torchvision."):
            del sys.modules[name]


@lru_cache(maxsize=1)
def torchvision() -> types.ModuleType:
    """Import and return the torchvision module, working around a CPU/CUDA build mismatch.

    Raises:
        RuntimeError: any import failure other than the known missing-operator one.
    """
    global TORCHVISION_OPS
    import torch  # noqa: F401  (torchvision needs torch first)

    try:
        import torchvision as tv

        TORCHVISION_OPS = True
        return tv
    except RuntimeError as err:
        if "torchvision::" not in str(err):
            raise
    _drop_partial_import()
    stub = types.ModuleType("torchvision._meta_registrations")
    stub.__doc__ = "Stub: torchvision's C operators are unavailable with this torch build."
    sys.modules["torchvision._meta_registrations"] = stub
    import torchvision as tv

    TORCHVISION_OPS = bool(tv.extension._has_ops())
    return tv
