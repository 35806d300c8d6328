"""Portable CPU kernels: ``engine.kernels=portable`` gives the same float results on any x86-64 CPU with AVX2.

docs/reliability.md, "Numbers on another CPU". PyTorch chooses its CPU kernels by the processor it runs on, and each
choice sums in its own order, so float32 results differ in the last bits between two CPUs and, through training,
in the accuracy (docs/reliability.md gives the default grid on an Intel Xeon and an AMD EPYC). The choices and how
``portable`` fixes each:

- ATen's vectorised loops (elementwise ops, reductions) by instruction set (AVX-512, AVX2 or none):
  ``ATEN_CPU_CAPABILITY=avx2``, the AVX2 loops on every CPU that has AVX2;
- MKL's matrix products (linear layers, and convolutions below) by vendor, instruction set and cache sizes:
  ``MKL_CBWR=COMPATIBLE``, MKL's conditional numerical reproducibility on its SSE2 branch, the one branch that
  MKL runs alike on Intel and AMD processors (its AVX2 branch falls back to the automatic choice on non-Intel
  CPUs), with fixed cache sizes and reductions;
- oneDNN's convolutions by instruction set and cache sizes: oneDNN off (``torch.backends.mkldnn``), so a
  convolution is ATen's (unfold + MKL matrix product);
- reductions split over the process's threads: :data:`PORTABLE_THREADS` threads on every machine.

The two variables are read once, when torch loads. ``python -m pipeline.train`` (``fl-train``) therefore starts
itself again with them set when the config asks for portable kernels; any other process (the Python API, a sweep,
a multirun job) must be started with them (:func:`missing_env` names them). ``native`` (the default) leaves every
choice to PyTorch: fastest, reproducible on the same machine.
"""

from __future__ import annotations

import os
from typing import Dict

import torch

from ..schema import ConfigError, check_cuda_kernels

PORTABLE_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "COMPATIBLE"}
PORTABLE_CAPABILITY = "AVX2"  # what torch.backends.cpu.get_cpu_capability() reports under ATEN_CPU_CAPABILITY=avx2
CUBLAS_DETERMINISTIC = ":4096:8"  # cuBLAS's fixed workspace: deterministic matrix products (CUDA >= 10.2)
PORTABLE_THREADS = 1  # one thread: no split reductions, and no threads spinning against other jobs on a small machine
DEFAULT_THREADS = torch.get_num_threads()  # PyTorch's choice when this module loads (engine.threads=0)


def missing_env() -> Dict[str, str]:
    """The variables of :data:`PORTABLE_ENV` that this process's environment does not hold as required."""
    return {k: v for k, v in PORTABLE_ENV.items() if os.environ.get(k) != v}


def env_prefix() -> str:
    """``ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=COMPATIBLE``: what to put before a command that needs portable kernels."""
    return " ".join(f"{k}={v}" for k, v in PORTABLE_ENV.items())


def apply(kernels: str, device: torch.device, threads: int = 1, float32_precision: str = "highest",
          deterministic: bool = True) -> None:
    """Set this process up for ``engine.kernels``, ``engine.threads``, ``engine.float32_precision`` and
    ``engine.deterministic`` before a run.

    ``deterministic`` (CUDA): cuDNN's deterministic convolution algorithms (``torch.backends.cudnn.deterministic``,
    no benchmark mode) and ``torch.use_deterministic_algorithms(True, warn_only=True)`` (an operator without a
    deterministic CUDA kernel warns instead of failing), with ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` put in the
    environment unless it is set (cuBLAS reads it when it first runs in the process). Without it, PyTorch's default
    kernels sum some gradients with atomic additions in whatever order the threads finish: the same seed then ends
    a few rounds later at another model (measured on an H200: docs/benchmarks.md, GPU). False restores PyTorch's
    defaults. Refused on the CPU, whose kernels repeat anyway.

    ``float32_precision``: ``torch.set_float32_matmul_precision``'s level for matrix products, and cuDNN's TF32
    convolutions (``torch.backends.cudnn.allow_tf32``) allowed unless it is ``highest``. ``highest``, the default,
    turns TF32 off in convolutions too, where PyTorch allows it by default: CUDA runs then compute in true float32.

    ``threads``: torch's intra-op threads for the rest of the process (``torch.set_num_threads``); 0 restores
    PyTorch's own choice (:data:`DEFAULT_THREADS`: one per core, or ``OMP_NUM_THREADS``). One thread is the
    default because a run on a busy machine otherwise slows to several times its idle time (docs/benchmarks.md,
    Threads). ``portable``: oneDNN off and :data:`PORTABLE_THREADS` torch threads. ``native``: nothing else changes.

    Raises:
        ConfigError: one line naming ``engine.float32_precision`` when it is not ``highest``, or
            ``engine.deterministic`` when it is false, on a CPU device (they change CUDA kernels only), or
            ``engine.kernels``: ``portable`` with a CUDA device (it fixes CPU kernels only), with ``engine.threads``
            other than :data:`PORTABLE_THREADS`, without the variables of :data:`PORTABLE_ENV` in the environment,
            with them set after torch loaded, or on a CPU without AVX2.
    """
    check_cuda_kernels(float32_precision, deterministic, device.type)
    if kernels == "portable":
        _check_portable(device, threads)
    # nothing changes in the process before every check has passed
    torch.set_float32_matmul_precision(float32_precision)
    torch.backends.cudnn.allow_tf32 = float32_precision != "highest"
    if device.type == "cuda":
        if deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_DETERMINISTIC)
        torch.backends.cudnn.deterministic = deterministic
        torch.backends.cudnn.benchmark = False
        torch.use_deterministic_algorithms(deterministic, warn_only=True)
    if kernels != "portable":
        torch.set_num_threads(int(threads) or DEFAULT_THREADS)
        return
    torch.backends.mkldnn.enabled = False
    torch.set_num_threads(PORTABLE_THREADS)


def _check_portable(device: torch.device, threads: int) -> None:
    """Raise the :func:`apply` error for ``engine.kernels=portable`` that cannot pin this run's kernels, if any."""
    if int(threads) != PORTABLE_THREADS:
        raise ConfigError(f"engine.kernels=portable runs on {PORTABLE_THREADS} thread (its sums are split the same "
                          f"way on every machine); engine.threads={threads} would change them "
                          f"(use engine.threads={PORTABLE_THREADS})")
    if device.type != "cpu":
        raise ConfigError(f"engine.kernels=portable fixes the CPU kernels; engine.device={device} trains elsewhere "
                          "(use engine.kernels=native)")
    missing = missing_env()
    if missing:
        raise ConfigError(f"engine.kernels=portable needs {env_prefix()} in the environment before torch loads "
                          f"(missing: {', '.join(sorted(missing))}); fl-train sets them itself, other commands: "
                          f"start them as `{env_prefix()} python ...`")
    capability = torch.backends.cpu.get_cpu_capability()
    if capability != PORTABLE_CAPABILITY:
        raise ConfigError(f"engine.kernels=portable: torch runs {capability} kernels here, not AVX2 (this CPU has no "
                          "AVX2, or ATEN_CPU_CAPABILITY was set after torch loaded)")
