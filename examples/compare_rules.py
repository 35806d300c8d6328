"""Compare FedAvg and SCAFFOLD on strongly non-IID digits with the Python API and plot both.

    .venv/bin/python examples/compare_rules.py [--rounds R] [--out FILE.png]

Nothing is written but the figure; nothing is tracked (``pipeline.api.run`` with ``write=False``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the project importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.api import run  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--out", type=Path, default=Path("compare_rules.png"))
    args = p.parse_args(argv)
    setting = ["partition=dirichlet", "partition.alpha=0.1", f"train.rounds={args.rounds}", "engine.progress=false"]
    results = {name: run(setting + [f"algorithm={name}"], seeds=(1, 2)) for name in ("fedavg", "scaffold")}

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2))
    for (name, res), style in zip(results.items(), ("-", "--")):
        acc = 100 * res.history.groupby("round")["test_acc"].mean()
        ax.plot(acc.index, acc.values, style, label=f"{name}: {100 * res.summary['final_acc_mean']:.1f}%")
    ax.set_xlabel("round")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title("digits, Dirichlet alpha = 0.1, mean of 2 seeds")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    for name, res in results.items():
        print(f"{name}: final accuracy {100 * res.summary['final_acc_mean']:.2f} +- "
              f"{100 * res.summary['final_acc_std']:.2f} %")
    print(f"figure: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
