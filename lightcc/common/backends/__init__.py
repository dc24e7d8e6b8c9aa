"""Communicator implementations: ``mpi`` (mpi4py, host arrays), ``nccl`` (CuPy, device arrays)."""
