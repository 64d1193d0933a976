"""Tier 1/2: the runtime's split backward (I then W) equals one full backward, in one process."""
from types import SimpleNamespace

import pytest

import torch

from tracepp.runtime.executor import WeightSplit, _weight_entries


def split_backward(out, x, params, grad_out, split=None):
    """The runtime's I then W on ``out``: returns dx; the weight gradients land in ``param.grad``."""
    split = split or WeightSplit(params)
    (dx,), pending, keep = split.input_backward([out], [grad_out], [x])
    assert all(p.grad is None for p in params if p.dim() > 1), "I must not touch matrix weights' gradients"
    WeightSplit.weight_backward(pending, [out] if keep else None, [grad_out] if keep else None)
    return dx


def _graph(x, w1, w2, b):
    h = torch.tanh(x @ w1 + b)
    # w2 reaches the output only through a weight-only branch (w2.sum()), which dI never runs
    return h * w2.sum() + x


def test_input_then_weight_equals_full_backward():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4, 4)), torch.nn.Parameter(torch.randn(4, 4)),
              torch.nn.Parameter(torch.randn(4))]
    x = torch.randn(3, 4, requires_grad=True)
    grad_out = torch.randn(3, 4)

    out = _graph(x, *params)
    out.backward(grad_out)
    expected_x, expected_p = x.grad.clone(), [p.grad.clone() for p in params]
    x.grad = None
    for p in params:
        p.grad = None

    dx = split_backward(_graph(x, *params), x, params, grad_out)
    torch.testing.assert_close(dx, expected_x)
    for p, expected in zip(params, expected_p):
        torch.testing.assert_close(p.grad, expected)


def test_tied_weight_used_twice_in_one_stage():
    torch.manual_seed(1)
    w = torch.nn.Parameter(torch.randn(4, 4))
    x = torch.randn(2, 4, requires_grad=True)
    grad_out = torch.randn(2, 4)
    (torch.relu(x @ w) @ w.t()).backward(grad_out)
    expected = w.grad.clone()
    w.grad = None
    split_backward(torch.relu(x @ w) @ w.t(), x, [w], grad_out)
    torch.testing.assert_close(w.grad, expected)


def test_weight_read_twice_on_one_path():
    """(x * w) * w: the second product's backward reaches w through the first one too."""
    w = torch.nn.Parameter(torch.randn(4))
    x = torch.randn(3, 4, requires_grad=True)
    grad_out = torch.randn(3, 4)
    ((x * w) * w).backward(grad_out)
    expected = w.grad.clone()
    w.grad = None
    split_backward((x * w) * w, x, [w], grad_out)
    torch.testing.assert_close(w.grad, expected)


def test_linear_weights_split_off_at_their_matmul():
    """A linear layer's weight reaches its matmul through a transpose that dI never runs: the matmul is the
    entry, so W reruns only its weight side instead of a whole backward."""
    lin, norm = torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)
    params = [lin.weight, lin.bias, norm.weight, norm.bias]
    x = torch.randn(2, 3, 4, requires_grad=True)
    out = torch.ops.aten.linear.default(torch.ops.aten.layer_norm.default(x, [4], norm.weight, norm.bias, 1e-5,
                                                                          False), lin.weight, lin.bias)
    grad_out = torch.randn_like(out)
    entries, full = _weight_entries([out], [x], params)
    assert full == [] and sorted(type(node).__name__ for node, _ in entries) == [
        "AddmmBackward0", "NativeLayerNormBackward0"]
    split = WeightSplit(params)
    (dx,), pending, keep = split.input_backward([out], [grad_out], [x])
    assert not keep  # W needs the entries only, not the outputs
    assert lin.weight.grad is None and norm.weight.grad is not None  # the norm's vectors are done during I
    WeightSplit.weight_backward(pending)
    got = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    torch.ops.aten.linear.default(torch.ops.aten.layer_norm.default(x, [4], norm.weight, norm.bias, 1e-5, False),
                                  lin.weight, lin.bias).backward(grad_out)
    for p, g in zip(params, got):
        assert torch.equal(g, p.grad)  # bit for bit: the same kernels on the same gradients


def _mlp_grads(x, lin1, lin2, mm_weight, grad_out, split=None):
    """dx and every weight gradient of tanh(lin2(tanh(lin1(x)))) @ mm_weight: one full backward, or I then W."""
    params = [lin1.weight, lin1.bias, lin2.weight, lin2.bias, mm_weight]
    for p in params:
        p.grad = None
    x.grad = None
    out = torch.tanh(lin2(torch.tanh(lin1(x)))) @ mm_weight
    if split is None:
        out.backward(grad_out)
        dx = x.grad
    else:
        dx = split_backward(out, x, params, grad_out, split)
    return [dx] + [p.grad.clone() for p in params]


def test_matmul_entries_take_their_checked_recipe_bit_for_bit(monkeypatch):
    """W runs a linear layer's weight kernels directly (no engine walk below the entry) once the recipe has
    matched the engine bit for bit on the first microbatch; later microbatches use it, and stay exact."""
    import tracepp.runtime.executor as executor

    torch.manual_seed(2)
    lin1, lin2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)
    mm_weight = torch.nn.Parameter(torch.randn(8, 5))  # x @ W: the weight as mat2 itself, no transpose
    params = [lin1.weight, lin1.bias, lin2.weight, lin2.bias, mm_weight]
    split = WeightSplit(params)
    engine_calls = []
    real_engine = executor._ENGINE

    class CountingEngine:
        def run_backward(self, *args):
            engine_calls.append(len(args[0]))
            return real_engine.run_backward(*args)

    monkeypatch.setattr(executor, "_ENGINE", CountingEngine())
    for mb in range(3):
        x = torch.randn(6, 8, requires_grad=True)
        grad_out = torch.randn(6, 5)
        expected = _mlp_grads(x, lin1, lin2, mm_weight, grad_out)
        engine_calls.clear()
        got = _mlp_grads(x, lin1, lin2, mm_weight, grad_out, split)
        assert all(torch.equal(a, b) for a, b in zip(got, expected))
        assert split._verdicts == [True, True, True]  # lin2 and lin1 (addmm through a transpose), mm_weight (mm)
        # the first microbatch checks each recipe against one engine call; later ones need only I's call
        assert len(engine_calls) == (1 + 3 if mb == 0 else 1)


def test_checked_recipes_add_into_held_gradients_inside_the_matmul(monkeypatch):
    """Once a weight holds a gradient (the second microbatch of a step on), W adds its product with one addmm_
    (no temporary, no second pass over the weight's gradient). Accumulated over microbatches, the sums equal
    the full backward's to rounding; with the fused add turned off they are the same bits."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    torch.manual_seed(4)
    lin1, lin2 = torch.nn.Linear(32, 64), torch.nn.Linear(64, 32)
    mm_weight = torch.nn.Parameter(torch.randn(32, 8))
    params = [lin1.weight, lin1.bias, lin2.weight, lin2.bias, mm_weight]
    batches = [(torch.randn(48, 32), torch.randn(48, 8)) for _ in range(4)]

    def accumulated(split):
        for p in params:
            p.grad = None
        ops = []
        for x, grad_out in batches:
            x = x.clone().requires_grad_(True)
            out = torch.tanh(lin2(torch.tanh(lin1(x)))) @ mm_weight
            if split is None:
                out.backward(grad_out)
                continue
            (_dx,), pending, keep = split.input_backward([out], [grad_out], [x])
            with Ops() as recorder:
                WeightSplit.weight_backward(pending, [out] if keep else None, [grad_out] if keep else None)
            ops.append(recorder.seen)
        return [p.grad.clone() for p in params], ops

    expected, _ = accumulated(None)
    fused, ops = accumulated(WeightSplit(params))
    assert not any("addmm_" in op for op in ops[0]), "the first microbatch: .grad is empty, nothing to add into"
    assert all(sum("aten.addmm_" in op for op in later) == 3 for later in ops[1:]), ops[1]
    for got, want in zip(fused, expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # the same sums, rounded in another order
    monkeypatch.setattr(WeightSplit, "fused_accumulate", False)
    separate, ops = accumulated(WeightSplit(params))
    assert not any("addmm_" in op for later in ops for op in later)
    assert all(torch.equal(got, want) for got, want in zip(separate, expected))


def test_a_recipe_that_differs_from_the_engine_is_dropped(monkeypatch):
    """Should a recipe not reproduce the engine's gradient exactly (another torch's kernels), the engine's
    gradient is the one accumulated and the entry goes back to the engine for good."""
    import tracepp.runtime.executor as executor

    torch.manual_seed(3)
    lin1, lin2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)
    mm_weight = torch.nn.Parameter(torch.randn(8, 5))
    split = WeightSplit([lin1.weight, lin1.bias, lin2.weight, lin2.bias, mm_weight])
    real = executor._recipe_grads
    monkeypatch.setattr(executor, "_recipe_grads", lambda node, recipe, grad: [g * (1 + 1e-3) for g in real(node, recipe, grad)])
    for _ in range(2):
        x = torch.randn(6, 8, requires_grad=True)
        grad_out = torch.randn(6, 5)
        expected = _mlp_grads(x, lin1, lin2, mm_weight, grad_out)
        got = _mlp_grads(x, lin1, lin2, mm_weight, grad_out, split)
        assert all(torch.equal(a, b) for a, b in zip(got, expected))
        assert split._verdicts == [False, False, False]


def test_parameters_with_hooks_keep_the_engine():
    """A tensor hook on a weight must run: its entry has no recipe, and the hook sees the gradient in W."""
    from tracepp.runtime.executor import _matmul_recipe, _preorder

    lin = torch.nn.Linear(4, 3)
    seen = []
    lin.weight.register_hook(lambda grad: seen.append(grad.shape))
    x = torch.randn(2, 4, requires_grad=True)
    out = lin(x)
    node = _preorder([out])[0]
    assert node.name() == "AddmmBackward0" and _matmul_recipe(node, [lin.weight, lin.bias]) is None
    split_backward(lin(x), x, [lin.weight, lin.bias], torch.randn(2, 3))
    assert seen == [torch.Size([3, 4])]


def test_rank_lines_are_one_write_each(monkeypatch):
    """Ranks share stderr; under ``python -u`` a print writes text and newline separately, so two ranks' errors
    could merge into one line (the flaky test_bad_checkpoint_stops_every_rank): ``say`` writes each line whole."""
    import io

    from tracepp.runtime.failure import say

    writes = []

    class Recorder(io.StringIO):
        def write(self, text):
            writes.append(text)
            return len(text)

    monkeypatch.setattr("sys.stderr", Recorder())
    say(1, "error: --load x: no such file")
    assert writes == ["[tracepp rank 1] error: --load x: no such file\n"]


def test_cpu_binding_gives_each_local_rank_an_equal_share_of_the_allowed_cores():
    from tracepp.runtime.cpu_binding import cores_for

    assert [cores_for(r, 2, {0, 1}) for r in range(2)] == [[0], [1]]
    assert [cores_for(r, 2, {3, 9, 5, 7, 1}) for r in range(2)] == [[1, 3], [5, 7]]  # sorted; the odd core is left
    assert [cores_for(r, 3, range(8)) for r in range(3)] == [[0, 1], [2, 3], [4, 5]]
    assert cores_for(0, 4, {0, 1}) is None  # more local ranks than cores: nothing is bound
    assert cores_for(2, 2, {0, 1}) is None


def test_cpu_binding_none_and_a_single_rank_leave_the_affinity_alone(monkeypatch):
    from tracepp.runtime import cpu_binding

    monkeypatch.setattr("os.sched_setaffinity", lambda *args: pytest.fail("bound"), raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert cpu_binding.bind("none") is None
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert cpu_binding.bind("auto") is None
    with pytest.raises(ValueError, match="expected one of auto, none"):
        cpu_binding.bind("spread")


def test_cpu_binding_refused_by_the_platform_runs_unbound(monkeypatch):
    """A sandbox whose sched_setaffinity fails: the rank runs unbound instead of crashing."""
    from tracepp.runtime import cpu_binding

    def refuse(*args):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr("os.sched_setaffinity", refuse, raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert cpu_binding.bind("auto") is None


def test_fast_ops_calls_the_same_ops_one_frame_shorter(monkeypatch):
    # a rank script's functions share its module's globals: bind gives them a torch whose ops are the OpOverloads'
    # C++ callables; autograd, dispatch modes and tracepp's own ops run as through OpOverload.__call__
    from torch.utils._python_dispatch import TorchDispatchMode

    from tracepp.runtime import fast_ops

    scope = {"torch": torch}
    exec("def stage(x, w):\n"
         "    y = torch.ops.aten.linear.default(torch.ops.tracepp.tp_copy.default(x), w)\n"
         "    return torch.ops.aten.add.Tensor(y, torch.ops.aten.sum.default(y)), torch.float32\n", scope)
    stage = scope["stage"]
    x, w = torch.randn(3, 4, requires_grad=True), torch.randn(5, 4, requires_grad=True)
    expected, _dtype = stage(x, w)
    expected.sum().backward()
    grads = (x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    assert fast_ops.bind(stage) and isinstance(scope["torch"], fast_ops.FastTorch)
    assert scope["torch"].ops.aten.linear.default is torch.ops.aten.linear.default._op
    assert scope["torch"].ops.aten.linear is scope["torch"].ops.aten.linear  # looked up once

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    with Seen() as seen:
        out, dtype = stage(x, w)
    assert dtype is torch.float32 and torch.equal(out, expected)
    assert "aten.linear.default" in seen.ops or "aten.mm.default" in seen.ops or "aten.addmm.default" in seen.ops
    out.sum().backward()
    assert torch.equal(x.grad, grads[0]) and torch.equal(w.grad, grads[1])
    fast_ops.unbind(stage)
    assert scope["torch"] is torch
    monkeypatch.setenv("TRACEPP_FAST_OPS", "off")
    assert not fast_ops.bind(stage) and scope["torch"] is torch


def test_tp_gather_joins_segment_pieces_smaller_than_the_group(monkeypatch):
    # x-transformers at --tp 2: a key of 2 heads in 2 segments, read at each rank's piece (one head of each segment);
    # the gradient's all-gather refused its 2-wide pieces as if each had to split into 2 segments of 2 ranks
    from tracepp.runtime import tensor_parallel as rt

    whole = torch.arange(8.0).reshape(2, 4)  # dim 1: segments [0, 1] and [2, 3]; rank r holds element r of each
    local = [whole[:, [0, 2]], whole[:, [1, 3]]]

    def all_gather(parts, tensor, group=None):
        for part, piece in zip(parts, local):
            part.copy_(piece)

    monkeypatch.setitem(rt._STATE, "size", 2)
    monkeypatch.setattr(rt.dist, "all_gather", all_gather)
    assert torch.equal(rt._gather(local[0].contiguous(), 1, 2), whole)
