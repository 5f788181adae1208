"""The ring's one communication pattern: every rank sends tensors to rank + 1 and receives the same
shapes from rank - 1.

A ring hosts one or more ranks (``hosted_ranks``): a process of an NCCL job hosts its own, the
single-process simulation hosts all of them.  The ring code keeps one state per hosted rank and
calls ``shift`` with one list of tensors per hosted rank; ``shift`` starts the transfer and
returns a handle whose ``wait()`` gives the lists received, in the same order.
"""
from __future__ import annotations

import typing

import torch

TensorLists = typing.List[typing.List[torch.Tensor]]


class PendingShift(typing.Protocol):
    def wait(self) -> TensorLists: ...


class Ring(typing.Protocol):
    world_size: int
    hosted_ranks: typing.Sequence[int]

    def shift(self, tensors: TensorLists) -> PendingShift: ...


class _Done:
    def __init__(self, received: TensorLists) -> None:
        self._received = received

    def wait(self) -> TensorLists:
        return self._received


class SimulatedRing:
    """All ranks in this process: a shift rotates the per-rank lists by one.  The tensors are
    cloned so that a rank never shares storage with the copy another rank received, as over NCCL."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.hosted_ranks = tuple(range(world_size))

    def shift(self, tensors: TensorLists) -> PendingShift:
        received = [[t.clone() for t in tensors[(rank - 1) % self.world_size]] for rank in self.hosted_ranks]
        return _Done(received)


class _PendingP2P:
    def __init__(self, requests, outgoing: list[torch.Tensor], received: list[torch.Tensor]) -> None:
        self._requests = requests
        self._outgoing = outgoing  # alive until the sends complete
        self._received = received

    def wait(self) -> TensorLists:
        for request in self._requests:
            request.wait()
        return [self._received]


class ProcessGroupRing:
    """This process's rank of a torch.distributed process group (NCCL for flashgen's kernels),
    shifting by batched isend/irecv so that the transfer overlaps the local attention."""

    def __init__(self, group=None) -> None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("group: torch.distributed is not initialized (call init_process_group first)")
        self._dist = dist
        self._group = group
        self.world_size = dist.get_world_size(group)
        rank = dist.get_rank(group)
        self.hosted_ranks = (rank,)
        # P2P ops take global ranks.
        self._next = dist.get_global_rank(group, (rank + 1) % self.world_size) if group is not None else (
            (rank + 1) % self.world_size)
        self._prev = dist.get_global_rank(group, (rank - 1) % self.world_size) if group is not None else (
            (rank - 1) % self.world_size)

    def shift(self, tensors: TensorLists) -> PendingShift:
        (outgoing,) = tensors
        dist = self._dist
        outgoing = [t.contiguous() for t in outgoing]
        received = [torch.empty_like(t) for t in outgoing]
        ops = [dist.P2POp(dist.isend, t, self._next, self._group) for t in outgoing]
        ops += [dist.P2POp(dist.irecv, t, self._prev, self._group) for t in received]
        return _PendingP2P(dist.batch_isend_irecv(ops), outgoing, received)
