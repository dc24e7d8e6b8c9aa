"""Communicator implementations: ``mpi`` (mpi4py, host arrays) and ``nccl`` (CuPy, device arrays)."""
