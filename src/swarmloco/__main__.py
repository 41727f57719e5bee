import sys

from swarmloco.cli import main

sys.exit(main())
