"""fl_core: the federated-learning engine (data, models, algorithms, executors, tracking)."""

__version__ = "0.1.0"
