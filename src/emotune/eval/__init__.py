"""Measurement: label scoring, generation, metrics, statistics, the forgetting probe, merged-model checks."""
