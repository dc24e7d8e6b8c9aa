"""Framework-agnostic core of lightcc (NumPy/CuPy arrays); see docs/architecture.md."""
