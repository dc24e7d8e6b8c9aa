"""The package version (one place; ``lightcc.__version__`` and the autotune cache read it)."""
__version__ = "0.1.0"
