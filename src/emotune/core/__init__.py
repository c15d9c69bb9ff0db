"""The bottom layer: errors, the run folder, the config and its file formats, small shared utilities."""
