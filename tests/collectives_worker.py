"""One rank of ``test_verify_cp.test_the_runtime_collectives_compute_what_verification_simulates``: each cp
collective of ``runtime/context_parallel.py`` and each tp one of ``runtime/tensor_parallel.py`` run for real over
gloo on seeded inputs, forward and backward with a seeded upstream gradient; the outputs and the inputs' gradients
saved for the test to set against ``split.local_ranks``' simulation. ``python collectives_worker.py OUT``, started on 2
ranks (``util.start_ranks``)."""
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from tracepp.runtime import context_parallel as cp_runtime
from tracepp.runtime import tensor_parallel as tp_runtime

# (op name, its arguments after the tensor, the input's shape on one rank)
CASES = [("cp_all_gather", [1], [2, 4, 3]), ("cp_all_gather", [1, 1, 2, 2], [2, 4, 3]),
         ("cp_reduce_scatter", [1], [2, 8, 3]), ("cp_all_reduce", [], [2, 3]),
         ("cp_amax", [[1], True], [2, 4, 3]), ("cp_amax", [[1, 2], False], [2, 4, 3]),
         ("tp_copy", [], [2, 3]), ("tp_all_reduce", [], [2, 3]), ("tp_all_gather", [1], [2, 3, 4]),
         ("tp_all_gather", [1, 2], [2, 4, 3]), ("tp_scatter", [2], [2, 3, 8]), ("tp_scatter", [1, 2], [2, 8, 3]),
         ("tp_piece", [1], [2, 8, 3]), ("sp_all_gather", [1], [2, 3, 4]), ("sp_reduce_scatter", [1], [2, 8, 3]),
         ("tp_head_group", [1, 2], [2, 8, 3]), ("tp_parts", [1, [4, 2, 2]], [2, 8, 3]),
         ("cp_halo", [2, 2], [2, 3, 8]), ("cp_halo", [1, 5], [2, 8, 3]),  # a reach inside a chunk of 4, past it
         ("cp_cumsum", [1], [2, 8, 3]), ("cp_logcumsumexp", [2], [2, 3, 8]), ("cp_cumprod", [1], [2, 8, 3]),
         ("tp_amax", [[2], True], [2, 3, 4]), ("tp_amax", [[1, 2], False], [2, 4, 3])]


def inputs(case: int, rank: int, shape: list) -> tuple:
    """(the input, the upstream gradient's seed) of ``rank`` for case ``case``."""
    g = torch.Generator().manual_seed(100 * case + rank)
    return torch.randn(shape, generator=g, dtype=torch.float64), torch.Generator().manual_seed(7 + 100 * case + rank)


def main(out: str) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))  # a peer that never comes: fail, not hang
    rank, size = dist.get_rank(), dist.get_world_size()
    cp_runtime.set_group(dist.group.WORLD, size, rank)
    tp_runtime.set_group(dist.group.WORLD, size, rank)
    saved = []
    for case, (name, args, shape) in enumerate(CASES):
        x, seed = inputs(case, rank, shape)
        x.requires_grad_(True)
        y = getattr(torch.ops.tracepp, name).default(x, *args)
        seed_grad = torch.randn(y.shape, generator=seed, dtype=y.dtype)
        y.backward(seed_grad)
        saved.append((y.detach(), x.grad))
    torch.save(saved, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
