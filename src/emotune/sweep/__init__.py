"""Sweeps: the search space, trials, backends and the results table."""
