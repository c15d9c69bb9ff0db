"""Typed configuration for every emotune stage, one module per section.

One precedence order, printed at start: defaults in these classes < a YAML file < dotted ``key=value``
overrides on the command line (``emotune run configs/cpu.yaml train.max_steps=2``). Every field carries a
docstring; ``emotune config --fields`` prints them. Unknown keys are rejected with the closest valid name, and
every problem is reported at once before any weights load (emotune.core.config.load)."""
