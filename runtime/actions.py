"""The plan's vocabulary: one pipeline action, in torch's compact notation.

An action is what one rank does next: compute (``F`` forward, ``B`` full backward, ``I`` input-grad
backward, ``W`` weight-grad backward) for one (stage, microbatch), or move data for it
(``SEND_F``/``RECV_F`` activations, ``SEND_B``/``RECV_B`` gradients) to or from one peer *stage*.

Text form (torch's, extended with an optional peer stage for skip connections):
``0F3`` = stage 0 forward of microbatch 3; ``1SEND_F3`` = stage 1 sends microbatch 3's activations to its
(unique) next stage; ``0SEND_F3>2`` = stage 0 sends microbatch 3's activations to stage 2;
``2RECV_F3<0`` = stage 2 receives them from stage 0; ``2SEND_B3>0`` / ``0RECV_B3<2`` carry gradients back.
Plain data only, standard library only: it lives in the runtime (copied into every output folder) because the
rank scripts' ``ACTIONS`` are parsed and, when a script was edited, validated at start-up with it; the planner
(``tracepp.codegen``) imports it from here (codegen may depend on the runtime, never the reverse).
"""
from __future__ import annotations

import re
from typing import NamedTuple, Optional

COMPUTE_KINDS = ("F", "B", "I", "W")
COMM_KINDS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
KINDS = COMPUTE_KINDS + COMM_KINDS

_ACTION_RE = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(\d+)(?:([<>])(\d+))?$")


class Action(NamedTuple):
    stage: int
    kind: str
    mb: int
    peer: Optional[int] = None  # peer *stage* of a comm action; None for compute

    @property
    def is_comm(self) -> bool:
        return self.kind in COMM_KINDS

    def __str__(self) -> str:
        text = f"{self.stage}{self.kind}{self.mb}"
        if self.peer is not None:
            text += (">" if self.kind.startswith("SEND") else "<") + str(self.peer)
        return text

    __repr__ = __str__

    @classmethod
    def parse(cls, text: str) -> "Action":
        match = _ACTION_RE.match(text.strip())
        if not match:
            raise ValueError(
                f"cannot parse action {text!r}: expected e.g. '0F1', '1B0', '1I2', '1W2', '0SEND_F1', "
                f"'0SEND_F1>2', '2RECV_F1<0'"
            )
        stage, kind, mb, arrow, peer = match.groups()
        if arrow is not None:
            if kind not in COMM_KINDS:
                raise ValueError(f"action {text!r}: only SEND/RECV actions take a peer stage")
            if (arrow == ">") != kind.startswith("SEND"):
                raise ValueError(f"action {text!r}: use '>' after SEND and '<' after RECV")
        return cls(int(stage), kind, int(mb), None if peer is None else int(peer))


class Topology(NamedTuple):
    """Which stages exchange data: the only thing about the model that scheduling needs.

    ``fwd_edges``: (producer stage, consumer stage) pairs that carry activations (skip connections
    included: stage 0 may feed stages 1 and 2). ``grad_edges``: the subset of those whose values carry a
    gradient back in training. Edges always point from a lower to a higher stage index.
    """

    num_stages: int
    fwd_edges: tuple  # tuple[tuple[int, int], ...]
    grad_edges: tuple  # tuple[tuple[int, int], ...]

    @classmethod
    def from_values(cls, num_stages: int, values) -> "Topology":
        """From boundary values given as (producer, consumer stages, carries a gradient) triples."""
        fwd, grad = set(), set()
        for producer, consumers, requires_grad in values:
            for consumer in consumers:
                fwd.add((producer, consumer))
                if requires_grad:
                    grad.add((producer, consumer))
        return cls(num_stages, tuple(sorted(fwd)), tuple(sorted(grad)))

    @classmethod
    def from_manifest(cls, manifest: dict) -> "Topology":
        """From ``manifest.json``'s boundary values (what the runtime and the tools know of the model)."""
        return cls.from_values(len(manifest["stages"]), ((v["producer"], v["consumers"], v["requires_grad"])
                                                         for v in manifest["values"].values()))

    @classmethod
    def chain(cls, num_stages: int) -> "Topology":
        edges = tuple((s, s + 1) for s in range(num_stages - 1))
        return cls(num_stages, edges, edges)
