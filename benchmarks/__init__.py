"""Benchmarks: kvserve against peers (run as scripts, e.g. `python benchmarks/offline.py`)."""
