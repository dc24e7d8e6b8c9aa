"""``python -m lightcc.runner`` is ``lccrun``."""
import sys

from .cli import main

sys.exit(main())
