"""Plans as CSV: one row per rank (row index = rank), one action per cell, in torch's notation.

Cells hold action strings such as ``0F3``, ``1I2``, ``1W2`` or comm actions with our peer extension
(``0SEND_F1>2``, ``2RECV_F1<0``). Torch-style comm actions without a peer (``0SEND_F1``, ``1RECV_F1``,
``1SEND_B1``, ``0RECV_B1``) are accepted and their peer is resolved from the topology when it is unique
(:func:`resolve_peers`). Blank cells are ignored.
"""
from __future__ import annotations

import csv
from pathlib import Path

from tracepp.runtime.actions import Action, Topology


def dump_csv(actions: dict, path) -> None:
    """Write ``{rank: [Action, ...]}`` as one row per rank 0..max rank (missing ranks give empty rows)."""
    num_rows = max(actions, default=-1) + 1
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        for rank in range(num_rows):
            writer.writerow([str(a) for a in actions.get(rank, [])])


def load_csv(path) -> dict:
    """Read a CSV written by :func:`dump_csv` (or by hand): ``{rank: [Action, ...]}``.

    Raises ValueError naming the file, row, column and text of a cell that does not parse.
    """
    out: dict[int, list] = {}
    with open(path, newline="") as f:
        for row_idx, row in enumerate(csv.reader(f)):
            acts = []
            for col_idx, cell in enumerate(row):
                text = cell.strip()
                if not text:
                    continue
                try:
                    acts.append(Action.parse(text))
                except ValueError as err:
                    raise ValueError(
                        f"{Path(path).name}: row {row_idx} (rank {row_idx}), column {col_idx}: "
                        f"cannot parse {text!r}: {err}") from None
            out[row_idx] = acts
    return out


def resolve_peers(actions: dict, topology: Topology) -> dict:
    """Fill in the peer stage of comm actions that lack one, from the topology.

    ``SEND_F`` of stage i goes to i's unique activation consumer, ``RECV_F`` of j from j's unique
    producer, ``SEND_B`` of j to j's unique gradient target, ``RECV_B`` of i from its unique gradient
    source. Raises ValueError naming the rank, position and action when there is no such stage or more
    than one (write the peer explicitly, e.g. ``0SEND_F1>2``).
    """
    fwd = [tuple(e) for e in topology.fwd_edges]
    grad = [tuple(e) for e in topology.grad_edges]
    out = {}
    for rank, acts in actions.items():
        new = []
        for pos, a in enumerate(acts):
            if a.is_comm and a.peer is None:
                if a.kind == "SEND_F":
                    peers = sorted({j for i, j in fwd if i == a.stage})
                elif a.kind == "RECV_F":
                    peers = sorted({i for i, j in fwd if j == a.stage})
                elif a.kind == "SEND_B":
                    peers = sorted({i for i, j in grad if j == a.stage})
                else:  # RECV_B
                    peers = sorted({j for i, j in grad if i == a.stage})
                if len(peers) != 1:
                    arrow = ">" if a.kind.startswith("SEND") else "<"
                    example = f"{a}{arrow}{peers[0]}" if peers else None
                    why = (f"stage {a.stage} has {len(peers)} possible peers {peers}; write it explicitly, "
                           f"e.g. '{example}'") if peers else f"stage {a.stage} has no such peer in the topology"
                    raise ValueError(f"rank {rank}, action {pos} '{a}': cannot resolve the peer: {why}")
                a = a._replace(peer=peers[0])
            new.append(a)
        out[rank] = new
    return out
