"""`python -m swarmloco.cli`: the `swarmloco` command."""

import sys

from swarmloco.cli import main

sys.exit(main())
