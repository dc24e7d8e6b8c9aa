"""One-command verification of lightcc's GPU path: ``python -m lightcc.gpucheck``.

See :mod:`lightcc.gpucheck.run` for the steps and the report, and docs/gpu.md.
"""
