"""Synthetic world, producers and benchmarks."""
