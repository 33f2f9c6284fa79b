"""Scale-out through torchrun (no launcher of our own): DDP by default, FSDP2 on request.

``torchrun --nproc_per_node N -m slipstream train CONFIG`` sets WORLD_SIZE / RANK; each rank
takes its share of every step's packed micro-batches. Every rank knows every bin's label
count (Python ints), so the global token count that weights the loss needs no
communication; the loss is scaled by the world size because DDP and FSDP2 average
gradients across ranks. Only rank 0 writes.
"""

from __future__ import annotations

import gc
import logging
import os
from dataclasses import dataclass
from typing import Literal, get_args

import torch
import torch.distributed as dist

from ..offload import checkpointing_layers

logger = logging.getLogger("slipstream")


@dataclass(frozen=True)
class Distributed:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    strategy: str = "none"  # "ddp", "fsdp2", or "none" for one process

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    def device(self) -> torch.device:
        if torch.cuda.is_available():
            return torch.device("cuda", self.local_rank)
        return torch.device("cpu")

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def sum(self, value: float) -> float:
        """Sum a float over ranks (the per-rank shares of the step's loss)."""
        if not self.enabled:
            return value
        tensor = torch.tensor(
            [value], dtype=torch.float64, device=self.device() if dist.get_backend() == "nccl" else "cpu"
        )
        dist.all_reduce(tensor)
        return float(tensor.item())

    def sum_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum a tensor over ranks where it lies (no host read): the step's loss before it is read."""
        if not self.enabled:
            return tensor
        tensor = tensor.detach().clone()
        dist.all_reduce(tensor)
        return tensor


# The multi-process strategies, defined once (the training config's field reads this).
Strategy = Literal["ddp", "fsdp2"]
STRATEGIES = get_args(Strategy)


def setup(strategy: Strategy) -> Distributed:
    """Join the process group torchrun describes (gloo on CPU, nccl on CUDA); one process otherwise."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return Distributed()
    if strategy not in STRATEGIES:
        raise ValueError(f"training.distributed must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(local_rank)
        dist.init_process_group(backend=backend)
    return Distributed(rank=rank, world_size=world_size, local_rank=local_rank, strategy=strategy)


def wrap(model: torch.nn.Module, info: Distributed) -> torch.nn.Module:
    """DDP, or FSDP2 ``fully_shard`` per decoder layer and then the root."""
    if not info.enabled:
        return model
    if info.strategy == "ddp":
        device_ids = [info.local_rank] if torch.cuda.is_available() else None
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
    from torch.distributed.fsdp import fully_shard

    for layer in checkpointing_layers(model):
        fully_shard(layer)
    fully_shard(model)
    return model


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def full_trainable_state(model: torch.nn.Module, info: Distributed) -> dict[str, torch.Tensor]:
    """Every trainable parameter as a full CPU tensor (a collective under FSDP2: all ranks call it)."""
    out = {}
    for name, param in unwrap(model).named_parameters():
        if not param.requires_grad:
            continue
        tensor = param.detach()
        if hasattr(tensor, "full_tensor"):  # a DTensor shard under FSDP2
            tensor = tensor.full_tensor()
        out[name] = tensor.cpu().contiguous()
    return out


def shutdown(info: Distributed) -> None:
    """End the process group once every DDP wrapper is gone (the caller drops its own first).

    DDP's C++ Reducer holds the group and is freed with the GIL held: were it the group's last
    holder, gloo's destructor would join its worker thread while that thread waits for the GIL to
    free a finished collective's tensors, a hang at exit now and then (pytorch/pytorch#56297).
    ``destroy_process_group`` frees the group without the GIL, so it must hold the last reference."""
    if not (info.enabled and dist.is_initialized()):
        return
    gc.collect()  # a wrapper in a reference cycle goes now, while the group is still registered
    if any(isinstance(o, torch.nn.parallel.DistributedDataParallel) for o in gc.get_objects()):
        logger.warning("a DDP wrapper outlived the run: its process group ends with it (may hang at exit)")
    dist.destroy_process_group()
