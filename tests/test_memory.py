"""Memory you can plan on (issue 46), tiers 1 and 2: the live-storage counter against torch's CPU allocator, the
fake-tensor count of a stage against the same run on real tensors, what checkpointing keeps, and the timeline of
a rank (plain data). The end-to-end matrix against measured runs is tests/test_e2e_memory.py."""
import json

import pytest
import torch

from tracepp.codegen.memory import MemoryOptions, kept_by_segment, optimizer_figures, profile_stage
from tracepp.codegen.peak import pool_bytes, rank_peak
from tracepp.runtime.memory import LiveMemory
from util import model_path


# -- the counter ------------------------------------------------------------------------------------------------

def test_a_storage_is_counted_once_and_until_it_is_freed():
    tracker = LiveMemory()
    with tracker:
        a = torch.ones(1000)  # 4000 bytes
        view = a[10:20].view(2, 5)  # a view: no new storage
        b = a * 2
        assert tracker.now == 8000 and tracker.peak == 8000
        del a
        assert tracker.now == 8000  # the view keeps the storage alive
        del view, b
    assert tracker.now == 0 and tracker.peak == 8000


def test_resizing_a_storage_is_followed_as_fsdp_does_it():
    tracker = LiveMemory()
    with tracker:
        a = torch.empty(256)
        a.untyped_storage().resize_(0)
        assert tracker.now == 0
        a.untyped_storage().resize_(1024)
        assert tracker.now == 1024
    del a


def test_the_counter_agrees_with_torchs_cpu_allocator():
    """An independent reference: the profiler's allocator events (every block torch's CPU allocator hands out
    and takes back), summed over a forward and backward, give the same peak above the start."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.LayerNorm(256),
                                torch.nn.Linear(256, 64))
    x = torch.randn(32, 64)

    def step():
        out = model(x).square().mean()
        out.backward()
        return out

    step()  # the gradients exist: the measured step accumulates into them
    tracker = LiveMemory()
    tracker.register(list(model.parameters()) + [p.grad for p in model.parameters()] + [x], "parameters")
    with tracker:
        start = tracker.open_window()
        step()
        counted = tracker.window_peak - start
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    running, allocator = 0, 0
    for _time, nbytes in events:
        running += nbytes
        allocator = max(allocator, running)
    assert counted == allocator


# -- a stage counted on fake tensors, against the same on real tensors ------------------------------------------

def _llama_split(param_dtype=None):
    from tracepp.modelfile import load_model_file
    from tracepp.split.partition import split
    from tracepp.trace import trace

    model_file = load_model_file(model_path("hf_llama"))
    traced = trace(model_file, 2, param_dtype=param_dtype)
    graph = split(traced, ["model.layers.1"], schedule="1f1b", num_microbatches=2)
    target = model_file.example_target()[:2]
    return model_file, traced, graph, target


@pytest.fixture(scope="module")
def llama_split():
    return _llama_split()


@pytest.fixture(scope="module")
def llama_split_bf16():  # traced as --mixed-precision params trains: parameters and inputs in bf16
    return _llama_split(torch.bfloat16)


FIGURES = ("kept", "forward_peak", "freed_at_send", "backward_peak", "backward_peak_first", "after_backward",
           "after_backward_first", "grads", "input_grads")


@pytest.mark.parametrize("precision,mixed,mode,split_backward", [
    ("fp32", "params", "none", False), ("bf16", "autocast", "selective", False), ("fp32", "params", "full", True),
    ("bf16", "params", "none", False), ("bf16", "params", "selective", True)])
def test_fake_count_equals_the_same_run_on_real_tensors(request, precision, mixed, mode, split_backward):
    traced_in_bf16 = precision == "bf16" and mixed == "params"
    model_file, traced, graph, target = request.getfixturevalue("llama_split_bf16" if traced_in_bf16
                                                                else "llama_split")
    trainable = {fqn for fqn, _p in traced.model.named_parameters()}
    options = MemoryOptions(precision=precision, mixed_precision=mixed, recompute=[mode, mode],
                            split_backward=split_backward)
    for stage in graph.stages:
        last = stage.index == graph.num_stages - 1
        args = (stage, graph, trainable, options, model_file.module.loss_fn, target if last else None, last)
        fake, real = profile_stage(*args, fake=True), profile_stage(*args, fake=False)
        assert "error" not in fake, fake
        assert {k: fake[k] for k in STAGE_KEYS(fake)} == {k: real[k] for k in STAGE_KEYS(fake)}
        assert fake["kept"] > 0 and fake["grads"] == sum(
            p.numel() * 4 for fqn, p in traced.model.named_parameters()
            if any(graph.state[name].fqn == fqn for name in stage.state))


@pytest.mark.parametrize("mode,split_backward", [("none", False), ("selective", True), ("full", False)])
def test_meta_count_equals_the_fake_count(llama_split, mode, split_backward):
    """Planning for CUDA counts a stage on meta tensors where every op allocates the same on any device (issue 56:
    a 671B model's memory step 22 -> 12 s): the same figures as on CPU fake tensors, stage by stage, the last
    stage's loss included when forced; and the split's own choice takes meta there."""
    from tracepp.codegen import memory

    model_file, traced, graph, target = llama_split
    trainable = {fqn for fqn, _p in traced.model.named_parameters()}
    options = MemoryOptions(precision="bf16", recompute=[mode, mode], split_backward=split_backward, device="cuda")
    for stage in graph.stages:
        last = stage.index == graph.num_stages - 1
        args = (stage, graph, trainable, options, model_file.module.loss_fn, target if last else None, last)
        on_meta, on_fake = profile_stage(*args, meta=True), profile_stage(*args, meta=False)
        assert {k: on_meta[k] for k in STAGE_KEYS(on_fake)} == {k: on_fake[k] for k in STAGE_KEYS(on_fake)}
        assert on_fake["kept"] > 0
    why = memory._on_meta_why_not(graph.stages[0].graph, options, None)
    assert why is None, why
    last = graph.stages[-1]
    loss = memory._loss_graph(model_file.module.loss_fn, last, graph, target, torch.bfloat16)
    assert any("cross_entropy" in str(node.target) for node in loss.nodes)  # traced before dispatch
    assert memory._on_meta_why_not(last.graph, options, loss) is None  # cross entropy decomposes alike everywhere

    def reads_a_value(output, target):
        return output.logits.float().mean() * float(target.sum().item() > 0)
    why = memory._on_meta_why_not(last.graph, options, memory._loss_graph(reads_a_value, last, graph, target, None))
    assert why.startswith("the model file's loss does not trace on meta tensors"), why
    assert memory._on_meta_why_not(graph.stages[0].graph, MemoryOptions(recompute=[mode, mode]), None) == \
        "attention on CPU"  # on meta tensors torch runs its math kernel, on CPU ones its flash kernel
    assert memory._on_meta_why_not(graph.stages[0].graph, MemoryOptions(
        precision="bf16", mixed_precision="autocast", recompute=[mode, mode], device="cuda"), None) == "autocast"


def test_a_stage_with_an_op_that_chooses_by_device_is_counted_on_fake_tensors():
    """``dropout`` decomposes to ``native_dropout`` on CUDA and to a mask product on CPU (and so on meta): a stage
    holding it (or any composite op not known to decompose the same everywhere) is counted on fake tensors."""
    from tracepp.codegen import memory

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(8, 8)

        def forward(self, x):
            return torch.nn.functional.dropout(self.linear(x), 0.1, training=True)

    program = torch.export.export(Block(), (torch.randn(2, 8),))
    why = memory._on_meta_why_not(program.graph, MemoryOptions(device="cuda"), None)
    assert why == "aten::dropout may choose its kernel by device", why


def STAGE_KEYS(figures: dict) -> list:
    return [key for key in figures if key != "kept_by_position"]


def test_checkpointing_keeps_less_and_the_segments_add_up(llama_split):
    model_file, traced, graph, target = llama_split
    trainable = {fqn for fqn, _p in traced.model.named_parameters()}
    kept = {}
    for mode in ("none", "selective", "full"):
        figures = profile_stage(graph.stages[0], graph, trainable, MemoryOptions(recompute=[mode, mode]))
        kept[mode] = figures["kept"]
        by_segment = kept_by_segment(graph.stages[0], figures)
        # what each segment's nodes keep, plus the stage's outputs and input casts, is what the stage keeps
        assert sum(by_segment.values()) <= figures["kept"]
        if mode == "none":
            assert sum(by_segment.values()) >= 0.9 * figures["kept"]
    assert kept["full"] < kept["selective"] < kept["none"]


def test_the_optimizer_state_is_counted_from_one_fake_step():
    trainable = [("a", 1000, torch.float32), ("b", 24, torch.float32)]
    adamw = optimizer_figures(trainable, lambda named: torch.optim.AdamW([p for _n, p in named], lr=1e-3))
    assert adamw["name"] == "AdamW" and adamw["state_bytes"] >= 2 * 4 * 1024  # exp_avg and exp_avg_sq, fp32
    sgd = optimizer_figures(trainable, lambda named: torch.optim.SGD([p for _n, p in named], lr=0.1))
    assert sgd["state_bytes"] == 0
    momentum = optimizer_figures(trainable, lambda named: torch.optim.SGD([p for _n, p in named], lr=0.1,
                                                                          momentum=0.9))
    assert momentum["state_bytes"] == 4 * 1024
    # one step per distinct group structure: other names, the same shapes and groups -> the same figures; another
    # shape or another grouping is stepped again
    def decayed(named):
        return torch.optim.AdamW([{"params": [p for n, p in named if n.endswith("a")], "weight_decay": 0.1},
                                  {"params": [p for n, p in named if not n.endswith("a")], "weight_decay": 0.0}])
    renamed = optimizer_figures([("x.a", 1000, torch.float32), ("x.b", 24, torch.float32)], decayed)
    assert renamed == optimizer_figures([("y.a", 1000, torch.float32), ("y.b", 24, torch.float32)], decayed)
    assert renamed["state_bytes"] == adamw["state_bytes"]
    bigger = optimizer_figures([("z.a", 2000, torch.float32), ("z.b", 24, torch.float32)], decayed)
    assert bigger["state_bytes"] == adamw["state_bytes"] + 2 * 4 * 1000


# -- a rank's timeline (plain data) -------------------------------------------------------------------------------

def _stage(**figures) -> dict:
    base = dict(received=0, forward_peak=0, kept=0, outputs=0, freed_at_send=0, grad_received=0, backward_peak=0,
                backward_peak_first=0, after_backward=0, after_backward_first=0, input_grads=0, grads=0,
                param_bytes=0, unsharded_bytes=0, grad_bytes_at_rest=0)
    base.update(figures)
    return base


def test_receive_buffers_are_pooled_by_size_as_the_executor_reuses_them():
    figures = {1: _stage(received_sizes=[100], grad_received_sizes=[])}
    # two microbatches in flight at once, then one at a time
    actions = ["1RECV_F0<0", "1F0", "1RECV_F1<0", "1B0", "1F1", "1B1", "1RECV_F2<0", "1F2", "1B2"]
    assert pool_bytes(actions, figures) == 200
    # gradient buffers of the same size share the pool with activation buffers
    figures = {0: _stage(received_sizes=[64], grad_received_sizes=[64])}
    assert pool_bytes(["0RECV_F0<1", "0RECV_B0<2", "0B0", "0RECV_F1<1", "0RECV_B1<2", "0B1"], figures) == 128


def test_the_peak_follows_the_microbatches_in_flight():
    stage = _stage(forward_peak=20, kept=100, backward_peak_first=30, backward_peak=20, after_backward_first=-100 + 40,
                   after_backward=-100, grads=40, grad_bytes_at_rest=40, param_bytes=40)
    one_f_one_b = ["0F0", "0F1", "0F2", "0B0", "0F3", "0B1", "0B2", "0B3"]
    result = rank_peak(one_f_one_b, {0: stage}, {"state_bytes": 80, "step_peak": 10})
    # three forwards in flight at 0B0 (the first backward allocates the gradients), and again at 0B1 with them
    assert result["peak_bytes"] == 40 + 80 + 40 + 300 + 20 and result["at"] == "0B1"
    assert result["parts"]["activations"] == 300 and result["parts"]["transient"] == 20
    gpipe = ["0F0", "0F1", "0F2", "0F3", "0B0", "0B1", "0B2", "0B3"]
    assert rank_peak(gpipe, {0: stage}, {"state_bytes": 80, "step_peak": 10})["peak_bytes"] == 40 + 80 + 400 + 30
    # the optimizer step: parameters, gradients, state and the step's temporaries
    assert rank_peak(one_f_one_b, {0: stage}, {"state_bytes": 80, "step_peak": 10})["optimizer_peak_bytes"] == \
        40 + 40 + 80 + 10


def test_sends_hold_their_data_until_the_plan_releases_them():
    stage = _stage(forward_peak=10, kept=100, freed_at_send=60, after_backward=-40, after_backward_first=-40)
    actions = ["0F0", "0SEND_F0>1", "0F1", "0SEND_F1>1", "0RECV_B0<1", "0B0"]
    held = rank_peak(actions, {0: stage}, {})  # no release points: the sends hold the outputs to the step's end
    released = rank_peak(actions, {0: stage}, {}, releases={"2": [1]})  # 0SEND_F0 released after 0F1
    assert held["peak_bytes"] - released["peak_bytes"] == 60


def test_fsdp_gathers_a_stage_for_the_step_and_reduces_its_gradients_to_a_shard():
    stage = _stage(forward_peak=10, kept=100, after_backward_first=-100 + 400, after_backward=-100, grads=400,
                   param_bytes=200, unsharded_bytes=400, grad_bytes_at_rest=200)
    actions = ["0F0", "0F1", "0B0", "0B1"]
    result = rank_peak(actions, {0: stage}, {"state_bytes": 400}, dp_mode="fsdp", dp=2, device="cuda")
    # the first forward: the flat all-gather output beside the unsharded parameters (params 200, state 400)
    first_forward = 200 + 400 + 400 + 400 + 10
    # the last backward: activations gone, parameters resharded, the gradients' flat copy and the 1/dp output
    reduce_scatter = 200 + 400 + 400 + 400 + 200
    assert result["step_peak_bytes"] == max(first_forward, reduce_scatter)
    on_gloo = rank_peak(actions, {0: stage}, {"state_bytes": 400}, dp_mode="fsdp", dp=2, device="cpu")
    assert on_gloo["step_peak_bytes"] > result["step_peak_bytes"]
    ddp = rank_peak(actions, {0: dict(stage, param_bytes=400, grad_bytes_at_rest=400)}, {"state_bytes": 800},
                    dp_mode="ddp", dp=2)
    assert ddp["parts"]["fsdp_unsharded"] == 400


def test_fsdp_shards_are_counted_with_fsdp2s_padding():
    # FSDP2 shards dim 0 in torch.chunk's pieces, every shard padded to the first one's rows: a [5, 4] weight over
    # dp 2 holds 3 rows on each rank (48 bytes, not 40), and the flat all-gather buffer is 2 x 3 rows
    from types import SimpleNamespace

    import torch.fx as fx

    from tracepp.codegen.memory import stage_state
    from tracepp.runtime.mesh import Layout

    graph = fx.Graph()
    shapes = {"weight": (5, 4), "bias": (5,), "scale": ()}
    for name, shape in shapes.items():
        graph.placeholder(name).meta["val"] = torch.empty(shape)
    refs = {name: SimpleNamespace(kind="parameter", fqn=f"linear.{name}", persistent=True) for name in shapes}
    stage = SimpleNamespace(graph=graph, state=list(shapes))
    state = stage_state(stage, SimpleNamespace(state=refs, expert_parallel=None), Layout(pp=1, dp=2))
    rows = 3 * 4 + 3 * 1 + 1  # each shard padded: weight 3 of 5 rows, bias 3 of 5, the scalar as one row
    assert state["param_bytes"] == state["grad_bytes_at_rest"] == rows * 4
    assert state["gathered_bytes"] == 2 * rows * 4 and state["unsharded_bytes"] == (20 + 5 + 1) * 4
    assert sorted(numel for _fqn, numel, _dtype in state["trainable"]) == [1, 3, 12]
    # the timeline gathers and reduce-scatters the padded buffer
    figures = _stage(forward_peak=0, grads=state["unsharded_bytes"], after_backward_first=state["unsharded_bytes"],
                     **{k: state[k] for k in ("param_bytes", "unsharded_bytes", "gathered_bytes",
                                              "grad_bytes_at_rest")})
    padded = rank_peak(["0F0", "0B0"], {0: figures}, {}, dp_mode="fsdp", dp=2, device="cuda")
    unpadded = rank_peak(["0F0", "0B0"], {0: dict(figures, gathered_bytes=0)}, {}, dp_mode="fsdp", dp=2,
                         device="cuda")
    assert padded["step_peak_bytes"] > unpadded["step_peak_bytes"]


@pytest.mark.parametrize("mask", [None, "bool"])
def test_a_cuda_plan_counts_attention_as_the_efficient_kernel_keeps_it(mask):
    # MLA's value heads are narrower than its query heads: CPU's flash kernel refuses them and torch runs the math
    # kernel, which keeps the S x S scores for backward; CUDA's memory-efficient kernel keeps the output and a
    # log-sum-exp. A plan for --device cuda (the planning run on CPU fake tensors) must count the latter
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tracepp.codegen.memory import cuda_attention

    heads, seq, scores = 4, 256, 4 * 256 * 256 * 4  # fp32 scores of one sample
    kept = {}
    for name, attention in (("cpu", torch.nn.functional.scaled_dot_product_attention), ("cuda", cuda_attention)):
        with FakeTensorMode():
            q, k = (torch.randn(1, heads, seq, 24, requires_grad=True) for _ in range(2))
            v = torch.randn(1, heads, seq, 16, requires_grad=True)
            bias = torch.ones(seq, seq, dtype=torch.bool).tril() if mask else None
            tracker = LiveMemory(track_inputs=False)  # what the op makes, not the q, k, v it reads
            with tracker:
                out = attention(q, k, v, attn_mask=bias, is_causal=mask is None)
                kept[name] = tracker.now
            assert out.shape == (1, heads, seq, 16)
            out.sum().backward()
            assert q.grad.shape == q.shape and v.grad.shape == v.shape
    assert kept["cpu"] >= scores
    out_and_lse = heads * seq * 16 * 4 + heads * seq * 4
    assert kept["cuda"] <= out_and_lse + (seq * seq * 4 if mask else 0) + 64  # (the bias made from a bool mask)


def test_memory_limit_refuses_with_what_would_fit_and_auto_chooses_under_it(tmp_path):
    from tracepp.driver import split_model
    from tracepp.runtime.mesh import Layout
    from tracepp.runtime.run_options import RunOptions

    path, options = model_path("hf_llama"), dict(schedule="1f1b", num_microbatches=4, layout=Layout(pp=2))
    free = split_model(path, str(tmp_path / "free"), run=RunOptions(optimizer="adamw"), **options)
    # a split counts its own checkpointing only (the other modes are counted when a limit needs them)
    assert free["memory"]["alternatives"] == {} and free["memory"]["modes_counted"] == ["none"]
    none = max(rank["peak_bytes"] for rank in free["memory"]["ranks"])  # the split's own mode: none
    checkpointed = split_model(path, str(tmp_path / "full"), run=RunOptions(optimizer="adamw",
                                                                            activation_checkpointing="full"), **options)
    full = max(rank["peak_bytes"] for rank in checkpointed["memory"]["ranks"])
    assert full < none
    between = (full + none) // 2
    with pytest.raises(ValueError) as refused:  # no checkpointing asked: the modes that fit are named
        split_model(path, str(tmp_path / "a"), run=RunOptions(optimizer="adamw", memory_limit=between), **options)
    assert "pipeline ranks do not fit" in str(refused.value) and "full fits" in str(refused.value)
    chosen = split_model(path, str(tmp_path / "b"), run=RunOptions(optimizer="adamw", memory_limit=between,
                                                                    activation_checkpointing="auto"), **options)
    modes = chosen["run_options"]["activation_checkpointing"].split(",")
    assert set(modes) <= {"none", "selective", "full"} and modes != ["none"]
    assert max(rank["peak_bytes"] for rank in chosen["memory"]["ranks"]) <= between
    state = min(sum(rank["parts"].get(k, 0) for k in ("parameters", "gradients", "optimizer"))
                for rank in free["memory"]["ranks"])
    with pytest.raises(ValueError) as refused:  # under the state alone: no checkpointing helps, and it says so
        split_model(path, str(tmp_path / "c"), run=RunOptions(optimizer="adamw", memory_limit=state // 2,
                                                               activation_checkpointing="auto"), **options)
    assert "not even full on every stage" in str(refused.value)
    assert "parameters, gradients and optimizer state alone are" in str(refused.value)


def test_a_data_dependent_size_counts_at_its_upper_bound():
    # JetMoE routes tokens with nonzero: its experts' row counts are unbacked symbols with no example value. The
    # cost model and the memory counter used to call int(hint) on them (a TypeError, and a memory count that
    # stopped subtracting freed storages); they count the bound export gives them instead
    import torch
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from tracepp.runtime.memory import concrete_int
    from tracepp.split.cost import as_int

    env = ShapeEnv()
    routed = env.create_unbacked_symint()
    torch._check(routed >= 0)
    torch._check(routed <= 32)
    assert concrete_int(routed) == as_int(routed) == 32
    assert concrete_int(routed * 4 + 8) == 136
    assert concrete_int(env.create_unbacked_symint()) == 0  # unbounded above: its lower bound
    assert concrete_int(7) == 7


def test_auto_goes_straight_to_full_where_selective_saves_nothing():
    # selective keeps every matmul's output; bf16 stage code without autocast's casts may keep less without it (the
    # logits beside the loss's fp32 copy), so none -> selective can save nothing where full saves most: auto must
    # not stop there (Llama 3 405B at tp 8 did, under --mixed-precision params)
    from types import SimpleNamespace

    from tracepp.codegen.memory import choose_checkpointing
    from tracepp.runtime.mesh import Layout

    def stage(kept):
        return dict(kept=kept, forward_peak=0, backward_peak=0, backward_peak_first=0, after_backward=-kept,
                    after_backward_first=-kept, grads=0, param_bytes=0, unsharded_bytes=0, grad_bytes_at_rest=0,
                    received_sizes=[], grad_received_sizes=[], freed_at_send=0, input_grads=0)

    by_mode = {"none": [stage(1000)], "selective": [stage(1200)], "full": [stage(100)]}
    graph = SimpleNamespace(num_stages=1, stages=[SimpleNamespace(estimate={"forward_flops": 10})])
    plan = {"stage_to_rank": [0], "num_ranks": 1, "actions": {"0": ["0F0", "0F1", "0B0", "0B1"]}}
    chosen = choose_checkpointing(graph, plan, by_mode, [[]], Layout(pp=1), None, {}, "cuda", 1500)
    assert chosen["modes"] == ["full"] and chosen["fits"] and chosen["peaks"] == [200]


# -- counted wherever the real run runs (issue 59) ------------------------------------------------------------------

@pytest.mark.parametrize("name", ["autocast_off_region", "custom_matmul"])
def test_the_fake_run_counts_what_the_rank_script_runs(tmp_path, name):
    # the stage code enters autocast with the rank's device type (RUN_DEVICE.type) around a region the model ran
    # with autocast off; a custom op runs its fake implementation. Both used to leave the stage uncounted
    from tracepp.driver import split_model
    from tracepp.runtime.mesh import Layout
    from tracepp.runtime.run_options import RunOptions

    manifest = split_model(model_path(name), str(tmp_path / "out"), schedule="1f1b", num_microbatches=2,
                           layout=Layout(pp=2), run=RunOptions(precision="bf16"))
    assert manifest["memory"]["notes"] == []
    assert not any(rank.get("bound") for rank in manifest["memory"]["ranks"])
    assert all(stage["kept"] > 0 for stage in manifest["memory"]["stages"])


def test_a_stage_that_cannot_be_counted_makes_its_ranks_figure_a_bound(tmp_path, monkeypatch, capsys):
    import tracepp.codegen.memory as memory
    from tracepp.cli import main
    from tracepp.driver import split_model
    from tracepp.report.stages import inspect_json, memory_table
    from tracepp.runtime.mesh import Layout
    from tracepp.runtime.run_options import RunOptions

    counted = memory.profile_stage

    def fails_on_stage_1(stage, *args, **kwargs):
        if stage.index == 1:
            raise RuntimeError("this op cannot run on fake tensors")
        return counted(stage, *args, **kwargs)

    monkeypatch.setattr(memory, "profile_stage", fails_on_stage_1)
    monkeypatch.setenv("TRACEPP_TEST_SPLIT_CACHE", "0")  # a split of tied_lm made earlier in the session was counted
    options = dict(schedule="1f1b", num_microbatches=2, layout=Layout(pp=2))
    manifest = split_model(model_path("tied_lm"), str(tmp_path / "out"), **options)
    ranks = manifest["memory"]["ranks"]
    assert not ranks[0].get("bound") and ranks[1]["bound"] and ranks[1]["bound_stages"] == [1]
    assert [r["bound"] for r in inspect_json(manifest)["ranks"]] == [False, True]
    table = memory_table(manifest)
    assert "(bound)" in table.splitlines()[4] and "(bound)" not in table.splitlines()[3]
    assert "the peak of rank 1 (stages 1) is an upper bound, not a count" in table
    limit = 2 * ranks[1]["peak_bytes"]
    manifest = split_model(model_path("tied_lm"), str(tmp_path / "limited"), run=RunOptions(memory_limit=limit),
                           **options)
    assert any("decided on a bound for pipeline rank 1" in note for note in manifest["memory"]["notes"])
    with pytest.raises(ValueError, match=r"rank 1 peaks at .*a bound: stage 1 could not be counted on fake tensors"):
        split_model(model_path("tied_lm"), str(tmp_path / "over"),
                    run=RunOptions(memory_limit=ranks[0]["peak_bytes"] + 1), **options)
    assert main(["inspect", str(tmp_path / "out")]) == 0
    assert "(bound)" in capsys.readouterr().out


def test_the_runs_meter_agrees_with_the_counter_and_keeps_nothing_alive(tmp_path):
    # run.py --measure-memory's meter (torch's MemTracker, device totals) against the count's own counter on the same
    # real steps, input and weight backwards split (autograd.grad with inputs=, which MemTracker's module hooks broke).
    # Its module tracker also kept every microbatch's input gradients alive: the second step's peak grew
    import gc

    from tracepp.driver import split_model
    from tracepp.runtime import Pipeline
    from tracepp.runtime.memory import MeasuredPeak
    from tracepp.runtime.mesh import Layout

    out = str(tmp_path / "out")
    split_model(model_path("tied_lm"), out, schedule="1f1b", num_microbatches=2, layout=Layout(pp=2))
    actions = [a for mb in range(2) for a in (f"0F{mb}", f"1F{mb}", f"1I{mb}", f"1W{mb}", f"0I{mb}", f"0W{mb}")]
    pipe = Pipeline(out, all_stages=True, actions=actions)
    meter, counter = MeasuredPeak(pipe), LiveMemory()
    counter.register(list(pipe.parameters()) + [b for s in pipe.stages.values() for b in s.buffers()], "parameters")
    meter.start()
    peaks = []
    with counter:
        for step in range(3):
            args, kwargs, target = pipe.user.batch(step)
            pipe.step(args, kwargs, target)
            pipe.zero_grad()
            gc.collect()
            peaks.append(counter.peak)
    measured = meter.stop()
    assert measured["peak_bytes"] == counter.peak > 0 and "MemTracker" in measured["method"]
    assert peaks[1] == peaks[2]  # nothing kept from one step to the next


def test_forked_workers_count_and_print_what_one_process_does(tmp_path, monkeypatch, capsys):
    """Large splits count their stages' memory and print their rank scripts in forked workers
    (``codegen.workers``; ``TRACEPP_PLAN_WORKERS`` forces it here): the same manifest figures and the same scripts
    as one process makes."""
    from tracepp.cli import main

    folders = {}
    for workers in ("1", "2"):
        monkeypatch.setenv("TRACEPP_PLAN_WORKERS", workers)
        out = tmp_path / f"workers{workers}"
        assert main(["split", model_path("hf_llama"), "-o", str(out), "--ranks", "2", "--optimizer", "adamw",
                     "--activation-checkpointing", "auto", "--memory-limit", "1GB"]) == 0
        capsys.readouterr()
        manifest = json.loads((out / "manifest.json").read_text())
        folders[workers] = (manifest["memory"], [(out / f"rank{r}.py").read_text() for r in range(2)])
    assert folders["1"] == folders["2"]


@pytest.mark.parametrize("layout", [dict(pp=2, tp=2, sequence_parallel=True), dict(pp=2, cp=2)])
def test_meta_count_keeps_the_shards_that_a_fake_count_keeps(layout, monkeypatch):
    """Under sequence parallelism backward keeps each gathered input's sequence shard, under cp each gathered key
    and value's shard (runtime/tensor_parallel.py, context_parallel.py), gathering again in backward. Meta tensors
    were not remembered as gathered, so a count on them kept the whole values: a 7B Llama's stages counted 256 MiB
    over the fake count (issue 56). Every stage of a tp + SP and a cp split, counted both ways, the same; and such
    stages are counted on meta."""
    from tracepp.codegen import memory
    from tracepp.driver import _plan
    from tracepp.runtime.mesh import Layout
    from tracepp.runtime.run_options import RunOptions

    compared, chosen = [], []
    original = memory._profile_stage

    def both(*args):
        chosen.append(args[-1])
        on_meta, on_fake = original(*args[:-1], "meta"), original(*args[:-1], "fake")
        compared.append(({k: on_meta[k] for k in STAGE_KEYS(on_fake)}, {k: on_fake[k] for k in STAGE_KEYS(on_fake)}))
        return on_fake
    monkeypatch.setattr(memory, "_profile_stage", both)
    run = RunOptions(precision="bf16", device="cuda", optimizer="adamw")
    _plan(model_path("hf_llama"), Layout(**layout), None, "1f1b", 2, None, None, run, verify="off")
    assert len(compared) == 2 and set(chosen) == {"meta"}
    for on_meta, on_fake in compared:
        assert on_meta == on_fake
