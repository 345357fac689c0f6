"""The state of ``state_job.py``, without peerckpt: its shapes and bit patterns, shared by the
job and by the processes that save, load or send the same state another way (DCP, torchft).

Tensor ``i`` is a float32 matrix of ``rows_per_tensor(...)`` × ``COLS``, sharded by rows over
the world; its bit patterns are its global element indices, so any copy of any shard can be
checked exactly without gathering.
"""

import argparse

import torch

COLS = 1024


def rows_per_tensor(args: argparse.Namespace) -> int:
    total = args.mib_per_rank * args.world << 20
    rows = total // (args.tensors * COLS * 4)
    return rows - rows % 12  # divisible by 4, 3 and 2: even shards on any world up to 4


def pattern(tensor_index: int, row0: int, rows: int, total_rows: int) -> torch.Tensor:
    start = (tensor_index * total_rows + row0) * COLS
    return torch.arange(start, start + rows * COLS, dtype=torch.int32).view(torch.float32)


def local_shards(args: argparse.Namespace, rank: int, fill: bool) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s rows of every tensor: the pattern (``fill``) or uninitialised."""
    total_rows = rows_per_tensor(args)
    rows = total_rows // args.world
    shards = {}
    for i in range(args.tensors):
        if fill:
            local = pattern(i, rank * rows, rows, total_rows)
        else:
            local = torch.empty(rows * COLS, dtype=torch.float32)
        shards[f"w{i}"] = local.view(rows, COLS)
    return shards


def exact(args: argparse.Namespace, rank: int, shards: dict[str, torch.Tensor]) -> bool:
    """Whether ``shards`` hold rank ``rank``'s rows, bit for bit."""
    expected = local_shards(args, rank, fill=True)
    return all(
        torch.equal(shards[k].reshape(-1).view(torch.int32), v.reshape(-1).view(torch.int32))
        for k, v in expected.items()
    )
