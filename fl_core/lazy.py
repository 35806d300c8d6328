"""Modules executed on first use, so that commands which never compute do not pay for importing them.

``fl-train --help``, ``--cfg`` and ``--info`` need the rule registry (every rule file registers its parameter
dataclass on import), and the rule files compute with torch. Importing torch takes about a second on two
cores; the rule files, the parameter layout (:mod:`fl_core.params`) and the seeding helpers therefore bind
``torch = lazy_import("torch")``: the module object exists at once, its code runs when one of its attributes is
first read (``torch.zeros``, ``torch.Tensor``), i.e. when a run builds its first model. This is the standard
library's :class:`importlib.util.LazyLoader`, as in the recipe of the ``importlib`` documentation.

Rules for a module that binds a lazy module: read its attributes only inside functions (no ``@torch.no_grad()``
decorator or ``torch.float32`` default at module level; ``with torch.no_grad():`` in the body instead), and
reach submodules through it (``torch.nn.functional.relu``), since ``import torch.nn.functional as F`` at module
level executes torch.
"""

from __future__ import annotations

import importlib.util
import sys
import types


def lazy_import(name: str) -> types.ModuleType:
    """The top-level module ``name``, executed only when one of its attributes is first read.

    Args:
        name: a top-level module name such as ``"torch"`` (no dots: finding a submodule would execute its
            parent package).

    Returns:
        ``sys.modules[name]`` if the module is imported already (lazily or not); else a new module object,
        registered in ``sys.modules``, whose code runs on first attribute access. An ``import name`` statement
        anywhere returns the same object and runs it (the import system reads the module's ``__spec__``), so a
        module that needs ``name`` at once simply imports it.

    Raises:
        ValueError: ``name`` names a submodule.
        ModuleNotFoundError: no module ``name`` is installed (raised here, not at first use).
    """
    if "." in name:
        raise ValueError(f"lazy_import takes a top-level module, got {name!r}")
    module = sys.modules.get(name)
    if module is not None:
        return module
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None:
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)
    loader = importlib.util.LazyLoader(spec.loader)
    spec.loader = loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    loader.exec_module(module)
    return module

