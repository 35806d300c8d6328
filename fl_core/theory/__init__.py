"""Reference answers from theory (closed forms in float64, numpy only), independent of the engine's code:
:mod:`.quadratic`, the fixed points of federated rules on quadratic problems."""
