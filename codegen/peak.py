"""The peak memory of each rank over its plan's timeline, split into its parts: plain data in, plain data out.

:func:`rank_peak` walks one rank's action list (``plan["actions"]``) with each of its stages' figures for one
microbatch (``tracepp.codegen.memory``, counted on fake tensors) and what the rank holds between steps, and
returns the worst moment of a training step after the first (the optimizer's state exists, the receive buffers
are pooled) and of the optimizer step, each split into:

* ``parameters``: the parameters and buffers a rank holds between steps (its tp pieces, its experts, FSDP's 1/dp
  shard, DDP's whole copy);
* ``gradients``: the parameters' gradients (allocated by a stage's first backward of the step, whole under FSDP
  until its last backward reduce-scatters them to 1/dp);
* ``optimizer``: the optimizer's state, and at the optimizer step its temporaries;
* ``fsdp_unsharded``: the parameters a stage computes with, from its first forward to its last backward: FSDP's
  gathered copy (this runtime wraps each stage with ``reshard_after_forward=False``), in the compute dtype under
  ``--mixed-precision params`` (so is DDP's cast copy, and without data parallelism the copy ``CastWeights``
  makes), and its all-gather and reduce-scatter buffers while they run;
* ``activations``: what the forwards of the microbatches in flight left for their backwards (saved tensors,
  outputs not yet sent, cast copies, the expert dispatch buffers among them);
* ``received``: the receive buffers (pooled by shape, as the executor reuses them) and the input gradients
  waiting to be sent;
* ``transient``: the running action's temporaries above what it keeps (the peak of a forward, a backward, a
  recomputation).

Two parts lie outside torch's tensors and are reported beside the peak, not in it: the shared-memory rings of CPU
ranks on one host (``rings_bytes``) and the batch the data loader holds.
"""
from __future__ import annotations

from tracepp.runtime.actions import Action

PARTS = ("parameters", "gradients", "optimizer", "fsdp_unsharded", "activations", "received", "transient")


def _parse(actions: list) -> list:
    return [a if isinstance(a, Action) else Action.parse(a) for a in actions]


def pool_bytes(actions: list, figures: dict) -> int:
    """Bytes of the receive buffers the executor keeps for reuse: per buffer size, the most in use at once (a
    microbatch's buffers are taken at its first receive and given back after its backward, W under zero-bubble
    schedules)."""
    in_use: dict = {}
    most: dict = {}
    held: dict = {}  # (stage, mb) -> [sizes]
    for action in _parse(actions):
        key = (action.stage, action.mb)
        fig = figures.get(action.stage) or {}
        sizes = None
        if action.kind == "RECV_F" and not held.get(key + ("F",)):
            sizes = fig.get("received_sizes") or []
            held[key + ("F",)] = sizes
        elif action.kind == "RECV_B" and not held.get(key + ("B",)):
            sizes = fig.get("grad_received_sizes") or []
            held[key + ("B",)] = sizes
        if sizes:
            for size in sizes:
                in_use[size] = in_use.get(size, 0) + 1
                most[size] = max(most.get(size, 0), in_use[size])
        ends = action.kind == "B" or action.kind == "W"
        if ends:
            for tag in ("F", "B"):
                for size in held.pop(key + (tag,), None) or []:
                    in_use[size] -= 1
    return sum(size * count for size, count in most.items())


class _Timeline:
    def __init__(self, static: dict):
        self.live = dict.fromkeys(PARTS, 0)
        self.live.update(static)
        self.peak = -1
        self.parts = dict(self.live)
        self.at = "start of the step"

    @property
    def total(self) -> int:
        return sum(self.live.values())

    def check(self, where, transient: int = 0, **extra) -> None:
        """A candidate worst moment: what is live, plus ``transient`` bytes of the running action's temporaries
        and ``extra`` bytes of other parts that live only during it. ``where``: its text, or the action."""
        total = self.total + transient + sum(extra.values())
        if total > self.peak:
            self.peak = total
            self.parts = dict(self.live)
            self.parts["transient"] += transient
            for part, value in extra.items():
                self.parts[part] += value
            self.at = where

    def add(self, part: str, value: int) -> None:
        self.live[part] += value


# FSDP2's reduce-scatter beyond its flat input and 1/dp output: gloo's own temporary (measured on CPU, dp 2: the
# whole reduce 1.63 - 1.81 x the gradients); NCCL reduces in place
REDUCE_SCATTER_EXTRA = {"cpu": 0.3, "cuda": 0.0}


class RankActions:
    """One rank's actions parsed, with what :func:`rank_peak` reads of their order (each stage's first forward and
    last backward, the sends per microbatch, the release points) and the receive pool per set of buffer sizes:
    made once where many walks share the actions (the tuner's checkpointing trials)."""

    __slots__ = ("parsed", "first_f", "last_backward", "sends_f", "sends_b", "release_at", "_pools")

    def __init__(self, actions: list, releases=None):
        self.parsed = _parse(actions)
        self.first_f, self.last_backward = {}, {}
        for position, action in enumerate(self.parsed):
            if action.kind in ("B", "W"):
                self.last_backward[action.stage] = position
            if action.kind == "F":
                self.first_f.setdefault(action.stage, position)
        self.sends_f = _sends_per_mb(self.parsed, "SEND_F")
        self.sends_b = _sends_per_mb(self.parsed, "SEND_B")
        self.release_at = {int(k): list(v) for k, v in (releases or {}).items()}
        self._pools: dict = {}

    def pool(self, stages: dict) -> int:
        key = tuple((s, tuple(fig.get("received_sizes") or ()), tuple(fig.get("grad_received_sizes") or ()))
                    for s, fig in sorted(stages.items()))
        if key not in self._pools:
            self._pools[key] = pool_bytes(self.parsed, stages)
        return self._pools[key]


def rank_peak(actions, stages: dict, optimizer: dict, dp_mode=None, dp: int = 1, releases=None,
              device: str = "cpu") -> dict:
    """The worst moment of one rank (see the module doc). ``stages``: stage index -> its figures (the memory
    profile's fields, plus ``param_bytes``: what the rank holds of it between steps, ``unsharded_bytes``: FSDP's
    gathered copy of those it shards (0 without FSDP), ``gathered_bytes``: its flat all-gather buffer, the shards
    padded on dim 0 as FSDP2 pads them (default: ``unsharded_bytes``), ``grad_bytes_at_rest``: its gradients after
    the step's reduction). ``optimizer``: ``state_bytes`` and ``step_peak`` (the step's temporaries above them).
    ``releases``: the rank's send-release points (``{action position: [send positions]}``, the plan's), where a
    send's data may go; without them every send is held to the end of the step. ``device``: where the job runs
    (cpu: gloo, cuda: NCCL), for what the collectives allocate.
    ``actions``: a list, or a :class:`RankActions` (made with the releases: ``releases`` is then not read).
    Returns ``{"peak_bytes", "parts": {part: bytes}, "at": what runs then, "step_peak_bytes",
    "optimizer_peak_bytes"}``."""
    ranked = actions if isinstance(actions, RankActions) else RankActions(actions, releases)
    parsed, first_f, last_backward = ranked.parsed, ranked.first_f, ranked.last_backward
    sends_f, sends_b, release_at = ranked.sends_f, ranked.sends_b, ranked.release_at
    fsdp = dp_mode in ("fsdp", "hsdp") and dp > 1
    static = {"parameters": sum(fig.get("param_bytes", 0) for fig in stages.values()),
              "optimizer": optimizer.get("state_bytes", 0),
              "received": ranked.pool(stages)}
    line = _Timeline(static)
    line.check("start of the step")
    sent_f, sent_b = {}, {}
    held = {}  # send position -> (part, bytes) its data holds until released
    grads_made = set()
    for position, action in enumerate(parsed):
        for sent in release_at.get(position - 1, ()):  # released after the action before this one
            part, nbytes = held.pop(sent, (None, 0))
            if part is not None:
                line.add(part, -nbytes)
        fig = stages.get(action.stage) or {}
        s, kind, label = action.stage, action.kind, action  # made text only where it is the worst moment
        if kind == "F":
            gathering = 0
            if first_f.get(s) == position and fig.get("unsharded_bytes"):
                # the stage's first forward of the step gathers its parameters: FSDP2's flat all-gather output
                # lives through that forward beside the unsharded parameters copied out of it; DDP (replicate, on
                # the same machinery) copies its parameters without the flat buffer (both measured on gloo); without
                # data parallelism, --mixed-precision params casts its compute copy (precision.CastWeights)
                line.add("fsdp_unsharded", fig["unsharded_bytes"])
                gathering = (fig.get("gathered_bytes") or fig["unsharded_bytes"]) if fsdp else 0  # padded to dp
            line.check(label, fig.get("forward_peak", 0), fsdp_unsharded=gathering)
            line.add("activations", fig.get("kept", 0))
        elif kind == "SEND_F":
            # the executor drops its reference to an output at its last send; the send itself holds the data
            # until the release point the plan gives it (gloo, NCCL; a shared-memory ring copies at once)
            key = (s, action.mb)
            sent_f[key] = sent_f.get(key, 0) + 1
            if sent_f[key] == sends_f.get(s, 1):
                held[position] = ("activations", fig.get("freed_at_send", 0))
        elif kind == "SEND_B":
            key = (s, action.mb)
            sent_b[key] = sent_b.get(key, 0) + 1
            if sent_b[key] == sends_b.get(s, 1):
                held[position] = ("received", fig.get("input_grads", 0))
        elif kind in ("B", "I", "W"):
            first = s not in grads_made and kind != "I"
            suffix = "_first" if first else ""
            sent = bool(sends_f.get(s))
            if kind == "B":
                peak, after = fig.get("backward_peak" + suffix, 0), fig.get("after_backward" + suffix, 0)
            elif kind == "I":
                peak, after = fig.get("input_backward_peak", 0), fig.get("after_input_backward", 0)
            else:
                peak = fig.get("weight_backward_peak" + suffix, 0)
                after = fig.get("after_weight_backward" + suffix, 0)
            line.check(label, peak)
            grads = fig.get("grads", 0) if first else 0
            if first:
                grads_made.add(s)
                line.add("gradients", grads)
            waiting = fig.get("input_grads", 0) if kind in ("B", "I") and sends_b.get(s) else 0
            line.add("received", waiting)
            # the profile ran the stage's outputs freed at their send; a stage whose outputs stay on this rank
            # (read by a local stage) frees them only here
            unsent = 0 if sent or kind == "I" else fig.get("freed_at_send", 0)
            line.add("activations", after - grads - waiting - unsent)
            if fsdp and last_backward.get(s) == position and fig.get("unsharded_bytes"):
                # its last backward reshards (the gathered parameters go), then reduce-scatters the gradients to
                # this rank's 1/dp: a flat copy of them, the 1/dp output, and on gloo a temporary of its own
                # (measured 1.63 - 1.81 x the gradients at dp 2 on gloo: REDUCE_SCATTER_EXTRA)
                line.add("fsdp_unsharded", -fig["unsharded_bytes"])
                grads_whole = fig.get("grads", 0)
                extra = REDUCE_SCATTER_EXTRA.get(device, 0.0)
                padded = grads_whole * (fig.get("gathered_bytes") or fig["unsharded_bytes"]) / fig["unsharded_bytes"]
                line.check(f"{label} (FSDP reduce-scatter)", 0,
                           fsdp_unsharded=int(padded * (1 + 1 / dp + extra)))
                line.add("gradients", fig.get("grad_bytes_at_rest", grads_whole) - grads_whole)
            if not fsdp and last_backward.get(s) == position and fig.get("unsharded_bytes"):
                # DDP frees its copy after the all-reduce; the params policy's compute copy goes after the last
                # backward too (RankExecutor: the stage's last use of its weights)
                line.add("fsdp_unsharded", -fig["unsharded_bytes"])
    for part, nbytes in held.values():  # the sends waited on at the end of the step
        line.add(part, -nbytes)
    step = dict(peak_bytes=line.peak, parts=line.parts, at=str(line.at))
    # the optimizer step: parameters, their gradients as reduced, the state and its temporaries
    at_rest = {"parameters": static["parameters"], "optimizer": static["optimizer"], "received": static["received"],
               "gradients": sum(fig.get("grad_bytes_at_rest", fig.get("grads", 0)) for fig in stages.values())}
    optimizer_total = sum(at_rest.values()) + optimizer.get("step_peak", 0)
    result = {"step_peak_bytes": step["peak_bytes"], "optimizer_peak_bytes": optimizer_total}
    if optimizer_total > step["peak_bytes"]:
        parts = dict.fromkeys(PARTS, 0)
        parts.update(at_rest)
        parts["transient"] = optimizer.get("step_peak", 0)
        result.update(peak_bytes=optimizer_total, parts=parts, at="the optimizer step")
    else:
        result.update(peak_bytes=step["peak_bytes"], parts=step["parts"], at=step["at"])
    return result


def _sends_per_mb(actions: list, kind: str) -> dict:
    """stage -> how many ``kind`` actions it issues per microbatch (one per consumer or producer rank)."""
    count: dict = {}
    for action in actions:
        if action.kind == kind and action.mb == 0:
            count[action.stage] = count.get(action.stage, 0) + 1
    return count
