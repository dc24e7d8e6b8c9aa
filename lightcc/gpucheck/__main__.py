"""``python -m lightcc.gpucheck [--out DIR]``: see :mod:`lightcc.gpucheck.run`."""
import sys

from .run import main

sys.exit(main())
