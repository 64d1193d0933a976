"""Live tensor memory of a process, counted per storage: what a plan's memory figure is held against.

:class:`LiveMemory` is a ``TorchDispatchMode`` that counts every tensor storage an op returns (or reads for the
first time) until the storage is freed, each storage once however many views share it, as torch's own
``torch.distributed._tools.mem_tracker`` does: a weak reference per storage, its bytes subtracted when the
storage goes. ``UntypedStorage.resize_`` (how FSDP2 frees and re-allocates its unsharded parameters) is followed
while the mode is on. It counts fake tensors (the split's count of what a stage keeps for backward,
``tracepp.codegen.memory``) and real ones alike (the tests hold the two equal). What a run measures is another
meter's (:class:`MeasuredPeak`: torch's own ``MemTracker`` on CPU, the caching allocator's statistics on CUDA), so
that the count is never checked against itself.

Storages carry a *category* (``parameters``, ``gradients``, ``optimizer``, or the default, ``activations``:
everything a step makes) and an optional *label* (the graph node that made it). :meth:`LiveMemory.register`
counts tensors made before the mode started (parameters, optimizer state) under a category, or moves known ones
to another (a gradient, once autograd has accumulated it). At every new peak the per-category totals are
copied, so the peak can be reported split into its parts.

Standard library and torch only: the runtime is copied into every output folder.
"""
from __future__ import annotations

import contextlib
import weakref

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils.weak import WeakIdKeyDictionary

CATEGORIES = ("parameters", "gradients", "optimizer", "activations")


def concrete_int(value) -> int:
    """A size that may be symbolic as a plain int: its traced hint; a data-dependent size has none (the tokens
    routed to one expert, from ``nonzero``): its upper bound from the shape environment's value ranges (export
    bounds it: every routed token to that expert), so a memory figure errs on the safe side; unbounded, its lower
    bound (0 at least)."""
    if not isinstance(value, torch.SymInt):
        return int(value)
    node = value.node
    if node.hint is not None:
        return int(node.hint)
    import sympy

    bounds = node.shape_env.bound_sympy(node.expr)
    if isinstance(bounds.upper, sympy.Integer):
        return int(bounds.upper)
    return max(int(bounds.lower), 0) if isinstance(bounds.lower, sympy.Integer) else 0


def storages_of(tensor: torch.Tensor) -> list:
    """The untyped storages behind a tensor: its own, or those of the plain tensors inside a wrapper subclass
    (a DTensor's local shard)."""
    found, todo = [], [tensor]
    while todo:
        item = todo.pop()
        if is_traceable_wrapper_subclass(item):
            names, _ctx = item.__tensor_flatten__()
            todo.extend(getattr(item, name) for name in names if isinstance(getattr(item, name), torch.Tensor))
        else:
            found.append(item.untyped_storage())
    return found


def _current_fake_mode():
    """The FakeTensorMode on the dispatch mode stack, if any (the counting runs inside it when planning)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return next((mode for mode in reversed(_get_current_dispatch_mode_stack())
                 if isinstance(mode, FakeTensorMode)), None)


def _is_fake(tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(tensor, FakeTensor)


class _Entry:
    __slots__ = ("nbytes", "category", "label", "__weakref__")

    def __init__(self, nbytes: int, category: str, label):
        self.nbytes, self.category, self.label = nbytes, category, label


class LiveMemory(TorchDispatchMode):
    """Count live tensor storages while the mode is on (see the module doc). ``now``/``peak``: bytes;
    ``by_category``: bytes per category now; ``peak_parts``: per category at the peak; ``label``: attributed
    to storages made from now on (:meth:`labelled`)."""

    def __init__(self, track_inputs: bool = True):
        super().__init__()
        # inputs too: a tensor made before the mode started is counted when an op first reads it (planning, where
        # every input was made under the mode or registered, counts outputs only: it is faster)
        self.track_inputs = track_inputs
        self._entries = WeakIdKeyDictionary()  # storage -> _Entry
        self.now = 0
        self.peak = 0
        self.window_peak = 0  # the most live bytes since :meth:`open_window`
        self.by_category = dict.fromkeys(CATEGORIES, 0)
        self.peak_parts = dict(self.by_category)
        self.peak_label = None  # the label current at the peak (what ran then)
        self.default_category = "activations"
        self.label = None
        self._resize = None
        self._fake_mode = None

    # -- counting ---------------------------------------------------------------------------------------
    def _add(self, storage, category: str) -> None:
        entry = self._entries.get(storage)
        if entry is not None:
            if category != entry.category and category != self.default_category:
                self.by_category[entry.category] -= entry.nbytes
                entry.category = category
                self.by_category[category] += entry.nbytes
            return
        nbytes = concrete_int(storage.nbytes())
        entry = _Entry(nbytes, category, self.label)
        self._entries[storage] = entry
        weakref.finalize(storage, self._free, entry)
        self._change(entry, nbytes)

    def _change(self, entry: _Entry, delta: int) -> None:
        self.now += delta
        self.by_category[entry.category] = self.by_category.get(entry.category, 0) + delta
        if self.now > self.window_peak:
            self.window_peak = self.now
        if self.now > self.peak:
            self.peak = self.now
            self.peak_parts = dict(self.by_category)
            self.peak_label = self.label

    def _free(self, entry: _Entry) -> None:
        self._change(entry, -entry.nbytes)
        entry.nbytes = 0

    def track(self, tensor, category=None) -> None:
        """Count ``tensor``'s storages (if not yet counted) under ``category`` (default: the current one)."""
        if isinstance(tensor, torch.Tensor):
            for storage in storages_of(tensor):
                self._add(storage, category or self.default_category)

    def register(self, tensors, category: str) -> None:
        """Count (or move to ``category``) every tensor in ``tensors`` (any nesting of lists, tuples, dicts)."""
        for leaf in pytree.tree_leaves(tensors):
            self.track(leaf, category)

    def open_window(self) -> int:
        """Start watching the most live bytes from now (``window_peak``) without touching the overall peak;
        returns the live bytes now."""
        self.window_peak = self.now
        return self.now

    def reset_peak(self) -> None:
        """Start a new peak window at the current live bytes."""
        self.peak = self.now
        self.peak_parts = dict(self.by_category)

    @contextlib.contextmanager
    def labelled(self, label):
        """Attribute storages made inside to ``label`` (e.g. the graph node being run)."""
        before, self.label = self.label, label
        try:
            yield
        finally:
            self.label = before

    @contextlib.contextmanager
    def as_category(self, category: str):
        """Count storages made inside under ``category`` (e.g. ``optimizer`` around ``optimizer.step()``)."""
        before, self.default_category = self.default_category, category
        try:
            yield
        finally:
            self.default_category = before

    def live_by_label(self) -> dict:
        """label -> bytes of the live storages made under it."""
        totals: dict = {}
        for entry in list(self._entries.values()):
            if entry.nbytes:
                totals[entry.label] = totals.get(entry.label, 0) + entry.nbytes
        return totals

    # -- the mode ---------------------------------------------------------------------------------------
    def __enter__(self):
        self._resize = torch.UntypedStorage.resize_
        original, entries = self._resize, self._entries

        def resize_(storage, size):  # FSDP2 frees and re-allocates unsharded parameters this way
            result = original(storage, size)
            entry = entries.get(storage)
            if entry is not None and storage.nbytes() != entry.nbytes:
                delta = storage.nbytes() - entry.nbytes
                entry.nbytes = storage.nbytes()
                self._change(entry, delta)
            return result

        torch.UntypedStorage.resize_ = resize_
        self._fake_mode = _current_fake_mode()  # None in a real run: every fake tensor met is another mode's
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(t is DTensor for t in types):  # let DTensor run its local ops first: those are what is allocated
            return NotImplemented
        if func is torch.ops._c10d_functional.wait_tensor.default and (_is_fake(args[0]) or args[0].is_meta):
            out = args[0]  # a fake (or meta) wait_tensor returns a new tensor; a real one returns its input
        else:
            out = func(*args, **(kwargs or {}))
        for leaf in pytree.tree_leaves((args, kwargs, out) if self.track_inputs else out):
            if isinstance(leaf, torch.Tensor) and self._counts(leaf):
                self.track(leaf)
        return out

    def _counts(self, tensor) -> bool:
        """Fake tensors count only under the fake mode the counting started in: a real run's DTensor computes
        its sharding on fake tensors of its own, the first time it meets an op, which allocate nothing."""
        from torch._subclasses.fake_tensor import FakeTensor

        return not isinstance(tensor, FakeTensor) or tensor.fake_mode is self._fake_mode


# -- run.py --measure-memory ----------------------------------------------------------------------------------
#
# The measurement shares no code with the count above: on CPU it is torch's own tracker
# (``torch.distributed._tools.mem_tracker.MemTracker``, device totals), on CUDA the caching allocator's statistics.
# Whatever the count is blind to, the measurement is not blind to through the same code.

CPU_METHOD = ("cpu: torch.distributed._tools.mem_tracker.MemTracker's device total (every tensor storage an op "
              "returns, once, until freed; the stages' parameters and buffers registered with track_external), its "
              "peak from the first step to the last; optimizer state included")
CUDA_METHOD = "cuda: torch.cuda.max_memory_allocated over the run's steps (peak statistics reset before the first)"


def device_totals():
    """torch's ``MemTracker`` counting device totals only: what its ``__torch_dispatch__`` counts (every storage an
    op returns, once, until freed; ``resize_`` followed) is untouched; its module tracker is left out. That tracker
    hooks every module's forward and the gradients of its inputs and outputs: a pipeline stage runs once per
    microbatch, which its statistics refuse as a second iteration, and its gradient hooks kept each microbatch's
    input gradients alive (measured: +16 KiB per microbatch and step on a small Llama's last stage, a meter that
    changed what it measured). Whether an op runs in backward (its Temp category) is read from autograd instead."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class NoModules:
        parents: set = set()

        @property
        def is_bw(self) -> bool:
            return torch._C._current_graph_task_id() != -1

        def register_user_hooks(self, *hooks) -> None:
            pass

        def clear_user_hooks(self) -> None:
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            pass

    tracker = MemTracker()
    tracker._mod_tracker = NoModules()
    return tracker


class MeasuredPeak:
    """This rank's peak tensor memory over a run's steps (``run.py --measure-memory``, or a loop of your own
    around :meth:`start` and :meth:`stop`), to hold the plan's figure against with a meter that shares no code
    with the plan's count. CPU: torch's ``MemTracker`` around the steps, the stages' modules registered first
    (its device total at its peak; the live total after each action of the last step, for what each forward
    left). CUDA: the allocator's own peak statistics (no dispatch mode: nothing is slowed)."""

    def __init__(self, pipe):
        self.pipe = pipe
        self.cuda = pipe.device.type == "cuda"
        self.tracker = None
        self.actions = []  # the last step's [action, None, live bytes after minus before, made and alive]
        self.peak_at = None

    def start(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.pipe.device)
            torch.cuda.reset_peak_memory_stats(self.pipe.device)
            return
        self.tracker = device_totals()
        self.tracker.track_external(*self.pipe.stages.values())
        self.tracker.__enter__()
        self.pipe.register_step_hook(self._step_starts)
        self.pipe.set_action_hook(self._action)

    def _total(self, kind: str) -> int:
        snapshot = self.tracker.get_tracker_snapshot(kind)
        return sum(int(parts.get("Total", 0)) for parts in snapshot.values())

    def _step_starts(self, _pipe, step: int) -> None:
        self.actions.clear()

    def _live(self) -> set:
        """The tracker's records of the storages alive now (MemTracker's own table)."""
        return {id(info) for info, _ref in list(self.tracker._WINFO.values()) if info.mem_consumed}

    def _made(self, before: set) -> int:
        return sum(info.mem_consumed for info, _ref in list(self.tracker._WINFO.values())
                   if info.mem_consumed and id(info) not in before)

    def _action(self, label: str, run) -> None:
        before, peak, live = self._total("current"), self._total("peak"), self._live()
        run()
        if self._total("peak") > peak:
            self.peak_at = label
        # live after minus before, and what the action made that is still alive (a send's buffer that completes
        # during a later action is freed there: the first moves with such timing, the second does not)
        self.actions.append([label, None, self._total("current") - before, self._made(live)])

    @contextlib.contextmanager
    def optimizer(self):
        """Around ``optimizer.step()`` (MemTracker sorts optimizer state by its own optimizer hooks)."""
        if self.tracker is None:
            yield
            return
        peak = self._total("peak")
        yield
        if self._total("peak") > peak:
            self.peak_at = "the optimizer step"

    def stop(self) -> dict:
        if self.cuda:
            torch.cuda.synchronize(self.pipe.device)
            return {"peak_bytes": int(torch.cuda.max_memory_allocated(self.pipe.device)), "parts": None,
                    "method": CUDA_METHOD}
        peak = self.tracker.get_tracker_snapshot("peak")
        self.tracker.__exit__(None, None, None)
        self.pipe.set_action_hook(None)
        device = max(peak, key=lambda dev: peak[dev].get("Total", 0)) if peak else None
        parts = {getattr(kind, "value", str(kind)): int(value)
                 for kind, value in (peak.get(device) or {}).items() if kind != "Total"}
        return {"peak_bytes": int((peak.get(device) or {}).get("Total", 0)), "parts": parts, "method": CPU_METHOD,
                "at": self.peak_at or "between actions (gradient sync, norm, clipping)", "actions": self.actions}
