"""Benchmarks (run as scripts, e.g. ``python benchmarks/round_speed.py --help``)."""
