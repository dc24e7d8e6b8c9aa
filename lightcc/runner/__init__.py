"""``lccrun``: launch a lightcc job by building and running the Open MPI ``mpirun`` command.

Console script ``lccrun = lightcc.runner:main``; also ``python -m lightcc.runner``.
See docs/launcher.md. This module stays import-light: the rank wrapper
(:mod:`lightcc.runner._rankwrap`) is imported by every rank.
"""
from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``lccrun``; returns the process exit code."""
    from .cli import main as _main

    return _main(argv)


__all__ = ["main"]
