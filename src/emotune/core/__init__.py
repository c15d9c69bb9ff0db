"""The bottom layer: errors, the run folder, locks, config."""
