"""The lightcc version string, without importing anything heavy."""
from __future__ import annotations

import importlib.metadata
import sys

FALLBACK_VERSION = "0.1.0"


def lightcc_version() -> str:
    """``lightcc.__version__`` if the package defines it, else the installed metadata, else 0.1.0.

    ``lightcc`` itself is already imported (it is this package's parent), so reading the
    attribute costs nothing.
    """
    version = getattr(sys.modules.get("lightcc"), "__version__", None)
    if isinstance(version, str) and version:
        return version
    try:
        return importlib.metadata.version("lightcc")
    except importlib.metadata.PackageNotFoundError:
        return FALLBACK_VERSION
