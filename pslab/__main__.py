"""`python -m pslab ...` is the `pslab` command."""

import sys

from pslab.experiments.cli import main

sys.exit(main())
