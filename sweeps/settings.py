"""What every process of a sweep shares: its :class:`Settings` (picklable, sent to spawned workers) and the names of
its objectives, samplers and exit statuses."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from fl_core.store import procs


OBJECTIVES = {"acc": "maximize", "uplink": "minimize"}  # uplink: cumulative floats per client, in units of d
METRIC_NAMES = {"acc": "val_acc", "uplink": "uplink"}  # the objectives' names in Optuna (dashboard, plots)
SAMPLERS = ("tpe", "cmaes", "gp", "random", "nsga2")
EXIT_INTERRUPTED = 130
HOST = procs.HOST


@dataclass
class Settings:
    """Everything a worker process needs to run trials (picklable: sent to spawned workers)."""

    space: str  # the space file
    overrides: List[str]  # command-line Hydra overrides
    seeds: List[int]
    objectives: List[str]
    study_name: str
    storage: str  # URL or journal file path
    rounds: int = 1  # train.rounds of the base configuration (pruner resources)
    final_window: int = 1  # train.final_window of the base configuration (the objective's last evaluations)
    sampler: str = "tpe"
    sampler_seed: Optional[int] = None
    pruner: str = "median"
    experiment: Optional[str] = None  # MLflow experiment; None: no MLflow
    parent_run_id: Optional[str] = None
    threads: int = 1
    timeout: Optional[float] = None
    quiet: bool = False
    batch: int = 1  # trials a worker trains at once as one population (tune.py --batch, resolved); 1: one by one

    @property
    def multi(self) -> bool:
        return len(self.objectives) > 1

    def directions(self) -> List[str]:
        return [OBJECTIVES[o] for o in self.objectives]


