"""Check a training batch against the traced signature and cut it into microbatches.

Every rank runs this on its own copy of the batch, so a bad batch fails on every rank at once, before any
communication. Root symbols (dynamic dims) are bound here from the batch's own sizes, per microbatch.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree

from .failure import PipelineError
from .shapes import compile_shape

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z_0-9]*$")


def _pieces(tensor: torch.Tensor, count: int, dim: int) -> list:
    """``tensor.tensor_split(count, dim)``, each piece contiguous: a batch laid out ``[seq, batch]`` (``batch_dim =
    1``) cut along dim 1 gives strided pieces, where the whole batch a model is written for (and trained on in eager)
    is contiguous, and its ``x.view(...)``, or its loss's ``target.view(-1)``, would fail on them (labml's models,
    PyTorch's word_language_model). A piece already contiguous (along dim 0) is not copied."""
    return [piece.contiguous() for piece in tensor.tensor_split(count, dim=dim)]


def token_counts(token_mean: dict, leaves: list, target, pieces) -> list:
    """The tokens a token-mean loss counts (``split.token_mean``) in each piece of a batch: its source leaf (of the
    flattened inputs ``leaves``, or of ``target``) sliced as the loss slices it, cut by ``pieces`` (a tensor -> its
    pieces), the elements not equal to ``ignore_index`` counted."""
    source = leaves if token_mean["source"] == "input" else pytree.tree_flatten(target)[0]
    value = source[token_mean["leaf"]]
    for dim, start, end, step in token_mean["slices"]:
        value = value[(slice(None),) * dim + (slice(start, end, step),)]
    return [int((piece != token_mean["ignore_index"]).sum()) for piece in pieces(value)]


@dataclass
class Microbatches:
    leaves: list  # per microbatch: the flattened (args, kwargs) leaves, on the device
    targets: list  # per microbatch: the target pytree
    scales: list  # per microbatch: its share of the full batch (sums to 1; of its counted tokens: split.token_mean)
    symbols: list  # per microbatch: root symbol -> int
    batch_size: int


class MicrobatchSplitter:
    """Checks each step's batch against the traced signature, binds the dynamic dims, and cuts it into the
    planned microbatches (see the module docstring)."""

    def __init__(self, manifest: dict, in_spec=None):
        self.num_microbatches = manifest["plan"]["num_microbatches"]
        self.traced_batch_size = manifest["batch_size"]
        self.roots = manifest["root_inputs"]
        self.in_spec = in_spec  # the traced (args, kwargs) pytree spec; None skips the structure check
        self.symbols = manifest.get("symbols", {})
        self.batched = manifest["batched_leaves"]
        self.batch_dim = manifest.get("batch_dim", 0)  # the dim holding the samples (1: a [seq, batch] layout)
        self.batch_symbol = manifest.get("batch_symbol")
        self.checks = [(root, [compile_shape([d]) if not isinstance(d, int) and not _IDENTIFIER.match(d) else None
                               for d in root["shape"]]) for root in self.roots if root.get("shape") is not None]
        sequence = ((manifest.get("tp") or {}).get("sequence_parallel") or {}).get("sequence")
        self.sequence = None  # with --sequence-parallel and a dynamic sequence: (its expression, its check, tp)
        if sequence is not None and not sequence.lstrip("-").isdigit():
            self.sequence = (sequence, compile_shape([sequence]), manifest["tp"]["size"])
        cp = manifest.get("cp") or {}
        self.context = None  # with --cp and a dynamic sequence: (its expression, its check, cp)
        if cp and not str(cp["sequence"]).lstrip("-").isdigit():
            self.context = (cp["sequence"], compile_shape([cp["sequence"]]), cp["size"])
        self.token_mean = manifest.get("token_mean")  # the loss: a mean over the tokens not ignored (split.token_mean)

    def split(self, step: int, args: tuple, kwargs: dict, target, device, tokens=None) -> Microbatches:
        """Check one step's batch against the trace (structure, constants, dtypes, ranks, static and symbolic
        dims), bind each microbatch's symbols, and cut the batch into microbatches on ``device``. ``tokens``:
        (the global batch's counted tokens, the replicas) where the loss is a token mean and the batch is a
        data-parallel replica's slice."""
        leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs or {})))
        self._check_structure(step, leaves, spec)
        batch_size, sizes = self._sizes(step, leaves)
        symbols = self._bind_symbols(step, leaves, sizes)
        self._check_ranges(step, symbols)
        self._check_derived(step, leaves, sizes, symbols)
        self._check_sequence_shards(step, symbols)
        mb_leaves, targets = self._cut(leaves, target, batch_size, device)
        scales = [size / batch_size for size in sizes]
        if self.token_mean is not None and target is not None:  # (no target: no loss, the outputs returned)
            scales = self._token_scales(step, leaves, target, tokens)
        return Microbatches(mb_leaves, targets, scales, symbols, batch_size)

    def token_total(self, args: tuple, kwargs: dict, target) -> int:
        """The counted tokens of a whole batch (a data-parallel step's global batch, before its replicas' slices)."""
        leaves = pytree.tree_flatten((tuple(args), dict(kwargs or {})))[0]
        return sum(token_counts(self.token_mean, leaves, target, lambda value: [value]))

    def _token_scales(self, step: int, leaves: list, target, tokens) -> list:
        """Each microbatch's weight where the loss is a mean over the tokens its target does not ignore: its
        counted tokens over the global batch's (times the replicas, whose gradients are averaged), so that the
        weighted means make eager's mean over the whole batch however the ignored tokens fall."""
        counts = token_counts(self.token_mean, leaves, target,
                              lambda value: value.tensor_split(self.num_microbatches, dim=self.batch_dim))
        total, replicas = tokens if tokens is not None else (sum(counts), 1)
        if total == 0:
            raise PipelineError(
                f"batch for step {step}: every token of the loss's target is ignore_index "
                f"({self.token_mean['ignore_index']}): the loss, a mean over the tokens not ignored "
                f"({self.token_mean['op']}), is a mean over none (eager's would be NaN); give each batch a "
                f"token to learn from")
        return [replicas * count / total for count in counts]

    def _check_structure(self, step: int, leaves: list, spec) -> None:
        """The same args/kwargs structure as traced, and Python scalars equal to the traced ones."""
        if self.in_spec is not None and spec != self.in_spec:
            raise PipelineError(
                f"batch for step {step}: its inputs have structure {spec} but the model was traced with "
                f"{self.in_spec}; batch(step) must return the same args/kwargs as example_inputs()/example_kwargs()"
            )
        for root in self.roots:  # Python scalars were baked into the trace: a new value would be ignored silently
            if "constant" in root:
                leaf, traced = leaves[root["leaf_index"]], root["constant"]
                if type(leaf) is not type(traced) or leaf != traced:
                    raise PipelineError(
                        f"batch for step {step}: input {root['path']} is {leaf!r} but the pipeline was traced with "
                        f"{traced!r}; torch.export fixes Python scalars at trace time: keep it {traced!r} in "
                        f"batch(step), or pass it as a tensor to vary it")

    def _sizes(self, step: int, leaves: list) -> tuple:
        """(batch size, samples per microbatch) of this batch."""
        dim = self.batch_dim
        batch_size = next((leaf.shape[dim] for leaf, b in zip(leaves, self.batched)
                           if b and isinstance(leaf, torch.Tensor) and leaf.dim() > dim), None)
        if batch_size is None:
            raise PipelineError(f"batch for step {step}: no input has a batch dimension (dim {dim})")
        count = self.num_microbatches
        if batch_size < count:
            raise PipelineError(f"batch for step {step} has {batch_size} samples, fewer than the "
                                f"{count} microbatches of this pipeline")
        # what tensor_split(count) gives: the first batch_size % count chunks one sample larger
        sizes = [batch_size // count + (1 if index < batch_size % count else 0) for index in range(count)]
        if self.batch_symbol is None and batch_size != self.traced_batch_size:
            raise PipelineError(
                f"batch for step {step} has {batch_size} samples but the pipeline was traced with "
                f"{self.traced_batch_size}; use the traced batch size or declare the batch dim dynamic "
                f"(tracepp split --dynamic)")
        return batch_size, sizes

    def _bind_symbols(self, step: int, leaves: list, sizes: list) -> list:
        """Per microbatch ``{symbol: value}`` from the dims the trace left symbolic; static dims, dtypes and ranks
        checked on the way."""
        count = self.num_microbatches
        symbols = [dict() for _ in range(count)]
        for root, checks in self.checks:
            leaf = leaves[root["leaf_index"]]
            name = root["path"]
            if not isinstance(leaf, torch.Tensor):
                raise PipelineError(f"batch for step {step}: input {name} is {type(leaf).__name__}, expected a tensor")
            if str(leaf.dtype).replace("torch.", "") != root["dtype"]:
                raise PipelineError(f"batch for step {step}: input {name} has dtype {leaf.dtype} but the pipeline "
                                    f"was traced with torch.{root['dtype']}")
            traced = root["shape"]
            if leaf.dim() != len(traced):
                raise PipelineError(f"batch for step {step}: input {name} has {leaf.dim()} dims (shape "
                                    f"{tuple(leaf.shape)}) but the pipeline was traced with {len(traced)} "
                                    f"(shape {tuple(traced)})")
            for dim, (expected, check) in enumerate(zip(traced, checks)):
                per_microbatch = root["batched"] and dim == self.batch_dim
                actuals = sizes if per_microbatch else [leaf.shape[dim]] * count
                if isinstance(expected, int):
                    if not per_microbatch and actuals[0] != expected:
                        raise PipelineError(self._mismatch(step, name, leaf, traced))
                elif check is None:  # a root symbol: bind it, or check it against an earlier binding
                    for index in range(count):
                        bound = symbols[index].setdefault(expected, actuals[index])
                        if bound != actuals[index]:
                            raise PipelineError(
                                f"batch for step {step}: input {name} dim {dim} is {actuals[index]} but "
                                f"{expected} is {bound} from another input; the traced model requires them equal")
        return symbols

    def _check_ranges(self, step: int, symbols: list) -> None:
        """Every bound symbol inside its declared range."""
        count = self.num_microbatches
        for index in range(count):
            for symbol, value in symbols[index].items():
                info = self.symbols.get(symbol, {})
                low, high = info.get("min", 0), info.get("max")
                if value < low or (high is not None and value > high):
                    where = info.get("source", symbol)
                    raise PipelineError(
                        f"batch for step {step}: {where} = {value} is outside the declared range "
                        f"[{low}, {high if high is not None else 'inf'}] of dynamic dim '{symbol}'")

    def _check_sequence_shards(self, step: int, symbols: list) -> None:
        """With --sequence-parallel, every tp rank holds an equal share of each sequence: a dynamic sequence
        length must be a multiple of tp (a static one was checked at split time); with --cp, of 2 x cp (the
        chunks of context parallelism), and with both of the least multiple of 2 x cp and cp x tp."""
        if self.context is not None:
            text, length_of, cp = self.context
            tp = self.sequence[2] if self.sequence is not None else 1
            multiple = math.lcm(2 * cp, cp * tp)  # 2 x cp chunks, and the 1/cp of a rank split over tp
            for bound in symbols:
                length = length_of(bound)[0]
                if length % multiple:
                    raise PipelineError(
                        f"batch for step {step}: sequence length {length} ({text}) is not a multiple of {multiple}: "
                        f"with --cp {cp} each sequence is cut into 2 x cp = {2 * cp} equal chunks (cp rank r holds "
                        f"chunks r and {2 * cp - 1}-r)"
                        + (f", each split again over --tp {self.sequence[2]} by --sequence-parallel"
                           if self.sequence is not None else "")
                        + f". Pad the batch to a multiple of {multiple} tokens, or split without --cp")
            return
        if self.sequence is None:
            return
        text, length_of, tp = self.sequence
        for bound in symbols:
            length = length_of(bound)[0]
            if length % tp:
                raise PipelineError(
                    f"batch for step {step}: sequence length {length} ({text}) is not a multiple of --tp {tp}: "
                    f"with --sequence-parallel each of the {tp} tensor-parallel ranks holds an equal share of the "
                    f"sequence. Pad the batch to a multiple of {tp} tokens, or split without --sequence-parallel")

    def _check_derived(self, step: int, leaves: list, sizes: list, symbols: list) -> None:
        """Derived dims (e.g. ``s_seq*2``) agree with the bound symbols."""
        count = self.num_microbatches
        for root, checks in self.checks:  # derived dims (e.g. s_seq*2) must agree with the bound symbols
            for dim, check in enumerate(checks):
                if check is None:
                    continue
                leaf = leaves[root["leaf_index"]]
                for index in range(count):
                    expected = check(symbols[index])[0]
                    actual = sizes[index] if (root["batched"] and dim == self.batch_dim) else leaf.shape[dim]
                    if actual != expected:
                        raise PipelineError(
                            f"batch for step {step}: input {root['path']} dim {dim} is {actual} but the traced "
                            f"model requires {root['shape'][dim]} = {expected}")

    def _cut(self, leaves: list, target, batch_size: int, device) -> tuple:
        """(per microbatch input leaves, per microbatch targets) on ``device``: batched tensors split along the
        batch dim as ``tensor_split`` does, each piece contiguous (:func:`_pieces`), everything else repeated."""
        count, dim = self.num_microbatches, self.batch_dim
        chunks = []
        for leaf, batched in zip(leaves, self.batched):
            if isinstance(leaf, torch.Tensor):
                leaf = leaf.to(device, non_blocking=True)
                chunks.append(_pieces(leaf, count, dim) if batched else [leaf] * count)
            else:
                chunks.append([leaf] * count)
        mb_leaves = [[chunk[i] for chunk in chunks] for i in range(count)]
        targets = [None] * count
        if isinstance(target, torch.Tensor) and target.dim() > dim and target.shape[dim] == batch_size:
            targets = _pieces(target.to(device), count, dim)  # the common case, without pytree
        elif target is not None:
            t_leaves, t_spec = pytree.tree_flatten(target)
            t_chunks = [_pieces(leaf.to(device), count, dim) if isinstance(leaf, torch.Tensor)
                        and leaf.dim() > dim and leaf.shape[dim] == batch_size else [leaf] * count
                        for leaf in t_leaves]
            targets = [pytree.tree_unflatten([c[i] for c in t_chunks], t_spec) for i in range(count)]
        return mb_leaves, targets

    def _mismatch(self, step, name, leaf, traced) -> str:
        full = list(traced)
        return (f"batch for step {step}: input {name} has shape {tuple(leaf.shape)} but the pipeline was traced "
                f"with {tuple(full)} per microbatch ({self.num_microbatches} microbatches of a "
                f"{self.traced_batch_size}-sample batch); use that shape, or re-split with the changing dims "
                f"declared dynamic (dynamic_shapes in the model file, or tracepp split --dynamic)")
