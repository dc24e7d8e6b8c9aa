"""Run one of the suite's worker scripts in a process started the torchrun way and check that
nothing imported mpi4py (``python no_mpi.py [--no-torch] WORKER [ARGS...]``).

The torch workers' harness (``workers_torch/common.py``) asks ``mpi4py`` for the rank and aborts
through it; here a stand-in module answers from ``RANK`` / ``SLURM_PROCID`` and exits instead,
and raises on any other use, so lightcc touching MPI fails the run. ``--no-torch`` hides torch
(``import torch`` fails), as in an installation of the NumPy core alone.
"""
import importlib.machinery
import os
import runpy
import sys
import types


class _World:
    def Get_rank(self):  # noqa: N802 - mpi4py's name
        return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))

    def Abort(self, code=1):  # noqa: N802
        sys.stdout.flush()
        os._exit(code)


class _StandIn(types.ModuleType):
    COMM_WORLD = _World()

    def __getattr__(self, name):
        if name.startswith("__"):            # module introspection (torch's, inspect's)
            raise AttributeError(name)
        raise AssertionError(f"mpi4py.MPI.{name} used in the MPI-free launch")


args = sys.argv[1:]
if args[0] == "--no-torch":
    sys.modules["torch"] = None           # import torch raises ImportError
    args = args[1:]
stand_in = _StandIn("mpi4py.MPI")
package = types.ModuleType("mpi4py")
package.MPI = stand_in
for module in (package, stand_in):        # importlib.util.find_spec (mpi_built()) reads it
    module.__spec__ = importlib.machinery.ModuleSpec(module.__name__, None)
sys.modules["mpi4py"], sys.modules["mpi4py.MPI"] = package, stand_in
script = os.path.abspath(args[0])
sys.path.insert(0, os.path.dirname(script))
sys.argv = args
code = 0
try:
    runpy.run_path(script, run_name="__main__")
except SystemExit as exc:          # a worker that ends with sys.exit(0)
    code = exc.code or 0
    if code:
        raise
assert sys.modules.get("mpi4py.MPI") is stand_in, "something imported the real mpi4py"
if sys.modules.get("torch", None) is None:
    assert "torch" not in sys.modules or sys.modules["torch"] is None
print(f"no-mpi ok rank {_World().Get_rank()}", flush=True)
sys.exit(code)
