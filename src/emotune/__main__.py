"""`python -m emotune`: the same as the `emotune` command."""

import sys

from emotune.cli import main

sys.exit(main())
