import sys

from emotune.cli import main

sys.exit(main())
