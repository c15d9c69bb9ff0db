"""The bottom layer: errors, the run folder and its locks, the config and its file formats, small shared utilities."""
