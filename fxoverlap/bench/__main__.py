"""``python -m fxoverlap.bench`` / ``torchrun -m fxoverlap.bench``: see :mod:`fxoverlap.bench`."""

from fxoverlap.bench.run import main

main()
