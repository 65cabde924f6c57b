"""``python -m fxoverlap.bench [SUBCOMMAND]`` / ``torchrun -m fxoverlap.bench``: see :mod:`fxoverlap.bench.commands`."""

import sys

from fxoverlap.bench.commands import main

rc = main()
sys.exit(rc if isinstance(rc, int) else 0)
