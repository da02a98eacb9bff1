"""``python -m fedmosaic``: the command line (``fedmosaic.cli``)."""

import sys

from fedmosaic.cli import main

sys.exit(main())
