"""engine.kernels (fl_core/engine/kernels.py): portable kernels refuse what they cannot pin, pin what they can, and
give one model under every machine stand-in (docs/reliability.md, Numbers on another CPU); engine.float32_precision
and engine.deterministic, the CUDA kernel keys, are refused on the CPU (docs/scaling.md, On a GPU)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fl_core.config import ConfigError, compose
from fl_core.engine import kernels
from fl_core.experiment import fingerprint

ROOT = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")


def test_native_sets_only_the_threads():
    mkldnn = torch.backends.mkldnn.enabled
    kernels.apply("native", CPU, threads=3)  # conftest restores the threads after the test
    assert (torch.backends.mkldnn.enabled, torch.get_num_threads()) == (mkldnn, 3)
    kernels.apply("native", CPU)  # engine.threads' default
    assert torch.get_num_threads() == 1
    kernels.apply("native", CPU, threads=0)  # PyTorch's own choice, as when the module loaded
    assert torch.get_num_threads() == kernels.DEFAULT_THREADS


def test_portable_refuses_other_thread_counts_in_one_line():
    from fl_core.config import compose

    with pytest.raises(ConfigError, match=r"^engine.threads=2: engine.kernels=portable runs on 1 thread .*"
                                          r"use engine.threads=1$"):
        compose(["engine.kernels=portable", "engine.threads=2"])
    with pytest.raises(ConfigError, match=r"^engine.kernels=portable runs on 1 thread .*use engine.threads=1\)$"):
        kernels.apply("portable", CPU, threads=0)
    assert compose(["engine.threads=0"]).engine.threads == 0
    with pytest.raises(ConfigError, match="engine.threads"):
        compose(["engine.threads=-1"])


def test_portable_refuses_what_it_cannot_pin(monkeypatch):
    for k in kernels.PORTABLE_ENV:
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(ConfigError, match=r"^engine.kernels=portable needs ATEN_CPU_CAPABILITY=avx2 "
                                          r"MKL_CBWR=COMPATIBLE in the environment before torch loads \(missing: "
                                          r"ATEN_CPU_CAPABILITY, MKL_CBWR\)"):
        kernels.apply("portable", CPU)
    for k, v in kernels.PORTABLE_ENV.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")  # set after torch loaded
    with pytest.raises(ConfigError, match="torch runs AVX512 kernels here, not AVX2"):
        kernels.apply("portable", CPU)
    with pytest.raises(ConfigError, match="engine.kernels=portable fixes the CPU kernels; engine.device=cuda"):
        kernels.apply("portable", torch.device("cuda"))


def test_portable_turns_onednn_off_and_fixes_the_threads(monkeypatch):
    for k, v in kernels.PORTABLE_ENV.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    kernels.apply("portable", CPU)  # conftest restores oneDNN and the threads after the test
    assert not torch.backends.mkldnn.enabled and torch.get_num_threads() == kernels.PORTABLE_THREADS


def _train(tmp: Path, tag: str, env_changes: dict) -> str:
    env = {k: v for k, v in os.environ.items() if k not in kernels.PORTABLE_ENV}
    env.update(env_changes, PYTHONPATH=str(ROOT))
    out = tmp / tag
    subprocess.run([sys.executable, "-m", "pipeline.train", "engine.kernels=portable", "algorithm=scaffold",
                    "train.rounds=2", "seed=1", "tracking.enabled=false", "engine.progress=false",
                    "engine.checkpoint_every=0", f"results_dir={out}", f"data_dir={tmp / 'data'}", "name=run"],
                   cwd=ROOT, env=env, check=True, capture_output=True)
    model = torch.load(out / "run" / "models" / "seed_1.pt", map_location="cpu", weights_only=True)
    return hashlib.sha256(b"".join(t.numpy().tobytes() for _, t in sorted(model.items()))).hexdigest()


@pytest.mark.slow
def test_portable_runs_are_one_model_under_every_machine_stand_in(tmp_path):
    """fl-train restarts itself with the variables set; a machine with another core count, oneDNN limited to AVX2
    or MKL limited to AVX2 (stand-ins for other CPUs, benchmarks/portable_kernels.py) trains the same model."""
    base = _train(tmp_path, "base", {})
    for tag, changes in {"one_core": {"OMP_NUM_THREADS": "1"}, "onednn_avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2"},
                         "mkl_avx2": {"MKL_ENABLE_INSTRUCTIONS": "AVX2"}}.items():
        assert _train(tmp_path, tag, changes) == base, tag


def test_portable_kernels_are_another_run_identity_and_native_keeps_its_fingerprint():
    from fl_core.config import compose
    from fl_core.experiment import fingerprint as experiment_fingerprint
    from fl_core.experiment import result_sections

    native, portable = compose(["engine.kernels=native"]), compose(["engine.kernels=portable"])
    assert "kernels" not in result_sections(native) and result_sections(portable)["kernels"] == "portable"
    assert experiment_fingerprint(native) == experiment_fingerprint(compose([]))
    assert experiment_fingerprint(portable) != experiment_fingerprint(native)


def test_float32_precision_sets_tf32_and_is_refused_on_the_cpu():
    """engine.float32_precision: highest turns TF32 off in convolutions too (PyTorch allows it there by default);
    another level changes CUDA kernels only, so a CPU run refuses it; it changes the fingerprint."""
    torch.backends.cudnn.allow_tf32 = True
    kernels.apply("native", CPU, 1, "highest")
    assert torch.get_float32_matmul_precision() == "highest" and not torch.backends.cudnn.allow_tf32
    with pytest.raises(ConfigError, match=r"^engine.float32_precision=high allows TF32/bfloat16 in CUDA kernels; "
                                          r"engine.device=cpu .*use engine.float32_precision=highest\)$"):
        kernels.apply("native", CPU, 1, "high")
    with pytest.raises(ConfigError, match=r"^engine.float32_precision=medium allows TF32/bfloat16 .*engine.device="
                                          r"cpu trains on the CPU"):
        compose(["engine.float32_precision=medium"])
    with pytest.raises(ConfigError, match="engine.float32_precision"):
        compose(["engine.float32_precision=tf32", "engine.device=cuda"])
    on_gpu = compose(["engine.device=cuda"])
    assert fingerprint(compose(["engine.device=cuda", "engine.float32_precision=high"])) != fingerprint(on_gpu)
    assert fingerprint(on_gpu) == fingerprint(compose([]))  # the default keeps every existing fingerprint


def test_deterministic_is_a_cuda_key_refused_on_the_cpu():
    """engine.deterministic=false asks for CUDA's default kernels; a CPU run refuses it (its kernels repeat anyway) and
    a CPU run leaves PyTorch's deterministic-algorithms switch alone. It does not change the fingerprint: both kernel
    choices compute the same numbers up to summation order, as the two executors do. Every check runs before the
    process changes: a refused call leaves the switch as it was."""
    before = torch.are_deterministic_algorithms_enabled()
    try:
        for state in (False, True):
            torch.use_deterministic_algorithms(state)
            kernels.apply("native", CPU, 1)
            assert torch.are_deterministic_algorithms_enabled() is state
        torch.use_deterministic_algorithms(False)
        with pytest.raises(ConfigError, match=r"^engine.kernels=portable fixes the CPU kernels"):
            kernels.apply("portable", torch.device("cuda"))
        assert not torch.are_deterministic_algorithms_enabled()  # a refused call changes nothing in the process
    finally:
        torch.use_deterministic_algorithms(before)
    with pytest.raises(ConfigError, match=r"^engine.deterministic=false lets CUDA pick kernels that differ from run to "
                                          r"run; engine.device=cpu .*\(use engine.deterministic=true\)$"):
        kernels.apply("native", CPU, 1, "highest", False)
    with pytest.raises(ConfigError, match=r"^engine.deterministic=false .*engine.device=cpu trains on the CPU"):
        compose(["engine.deterministic=false"])
    assert fingerprint(compose(["engine.device=cuda", "engine.deterministic=false"])) == \
        fingerprint(compose(["engine.device=cuda"]))
