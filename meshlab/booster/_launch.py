"""Colossal-AI's launchers: ``launch`` (rank, world size and rendezvous given), and
``launch_from_slurm`` / ``launch_from_openmpi`` (read from the launcher's environment).
Each joins the process group and seeds as ``launch_from_torch`` does.

>>> from meshlab.booster import launch
>>> launch(rank=0, world_size=1, host="localhost", port=29511, verbose=False)  # doctest: +SKIP
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ..core.errors import ConfigError, check_int


def _backend(backend: str | None, who: str) -> str:
    cuda = torch.cuda.is_available()
    if backend is None:
        return "nccl" if cuda else "gloo"
    if backend == "nccl" and not cuda:
        raise ConfigError(f"{who}(backend='nccl'): this machine has no CUDA device; pass "
                          f"backend='gloo' (or leave it None: NCCL with GPUs, gloo without)")
    return backend


def launch(rank: int, world_size: int, host: str, port: int, backend: str | None = None,
           local_rank: int | None = None, seed: int = 1024, verbose: bool = True) -> None:
    """Join the process group of ``world_size`` ranks as ``rank``, meeting at
    ``host:port`` (TCP rendezvous), pick GPU ``local_rank`` (default: ``rank`` modulo the
    GPUs), then seed as ``launch_from_torch``. ``backend`` defaults to NCCL with GPUs,
    gloo without; Colossal-AI's default ``'nccl'`` on a machine without CUDA is refused."""
    from ._booster import launch_from_torch

    check_int(world_size, "launch", "world_size", low=1, example=2)
    check_int(rank, "launch", "rank", low=0, example=0)
    check_int(port, "launch", "port", low=1, example=29500)
    if rank >= world_size:
        raise ConfigError(f"launch(rank={rank}, world_size={world_size}): rank must be below "
                          f"world_size")
    name = _backend(backend, "launch")
    if not dist.is_initialized():
        if torch.cuda.is_available():
            n = torch.cuda.device_count()
            torch.cuda.set_device(local_rank if local_rank is not None else rank % n)
        dist.init_process_group(name, init_method=f"tcp://{_host(host)}:{port}", rank=rank,
                                world_size=world_size)
    os.environ.setdefault("LOCAL_RANK", str(local_rank if local_rank is not None else rank))
    launch_from_torch(backend=name, seed=seed, verbose=verbose)


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _env_int(names: tuple[str, ...], who: str, launcher: str) -> int:
    for n in names:
        v = os.environ.get(n)
        if v is not None:
            try:
                return int(v)
            except ValueError:
                raise ConfigError(f"{who}: {n}={v!r} is not an integer") from None
    raise ConfigError(f"{who}: {' or '.join(names)} not set; start the script with "
                      f"{launcher} (or call meshlab.booster.launch(rank=, world_size=, ...))")


def launch_from_slurm(host: str, port: int, backend: str | None = None, seed: int = 1024,
                      verbose: bool = True) -> None:
    """``launch`` with the rank, world size and local rank of SLURM's ``srun``
    (``SLURM_PROCID``, ``SLURM_NPROCS`` or ``SLURM_NTASKS``, ``SLURM_LOCALID``)."""
    who = "launch_from_slurm"
    rank = _env_int(("SLURM_PROCID",), who, "srun")
    world = _env_int(("SLURM_NPROCS", "SLURM_NTASKS"), who, "srun")
    local = _env_int(("SLURM_LOCALID",), who, "srun") if "SLURM_LOCALID" in os.environ else None
    launch(rank, world, host, port, backend, local_rank=local, seed=seed, verbose=verbose)


def launch_from_openmpi(host: str, port: int, backend: str | None = None, seed: int = 1024,
                        verbose: bool = True) -> None:
    """``launch`` with the rank, world size and local rank of Open MPI's ``mpirun``
    (``OMPI_COMM_WORLD_RANK``, ``OMPI_COMM_WORLD_SIZE``, ``OMPI_COMM_WORLD_LOCAL_RANK``)."""
    who = "launch_from_openmpi"
    rank = _env_int(("OMPI_COMM_WORLD_RANK",), who, "mpirun")
    world = _env_int(("OMPI_COMM_WORLD_SIZE",), who, "mpirun")
    local = _env_int(("OMPI_COMM_WORLD_LOCAL_RANK",), who, "mpirun")
    launch(rank, world, host, port, backend, local_rank=local, seed=seed, verbose=verbose)
