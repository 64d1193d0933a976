"""Tier 2: split-vs-unsplit numerics in one process, no torchrun.

Each model file is traced and split, its stage graphs run in sequence (``util.run_stages_sequentially``:
per-stage copies of the weights, detached boundary values, backward stage by stage) and the outputs, loss
and every parameter's gradient must equal the unsplit model's.
"""
import pytest
import torch
import torch.utils._pytree as pytree

from util import model_path, run_stages_sequentially, trace_and_split

# model file -> number of stages its split_points / pipe_split() markers make
MODELS = {"residual_mlp_lm": 2, "marker_mlp": 2, "tied_lm": 2, "skip3": 3, "mask_kwargs": 2,
          "hf_llama": 2, "hf_gpt2": 2, "no_grad_region": 2, "buffer_cache": 2}
HF_MODELS = {"hf_llama", "hf_gpt2"}


def _batch(module, step):
    if hasattr(module, "batch"):
        return module.batch(step)
    return module.example_inputs(), {}, module.example_target()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_split_matches_unsplit(name):
    if name in HF_MODELS:
        pytest.importorskip("transformers")
    model_file, traced, graph = trace_and_split(model_path(name))
    assert graph.num_stages == MODELS[name]
    _assert_matches_eager(model_file, traced, graph)


def _assert_matches_eager(model_file, traced, graph):
    """The stage graphs run in sequence give the unsplit model's output, loss and every parameter's gradient."""
    module = model_file.module
    args, kwargs, target = _batch(module, 0)
    args = args if isinstance(args, tuple) else (args,)

    eager = model_file.model()
    expected_out = eager(*args, **kwargs)
    expected_loss = module.loss_fn(expected_out, target)
    expected_loss.backward()

    split_model = model_file.model()
    out, loss, grads = run_stages_sequentially(traced, graph, split_model, args, kwargs, target, module.loss_fn)

    # the same structure as eager forward (tuple/dict/ModelOutput), leaf by leaf equal
    assert type(out) is type(expected_out)
    out_leaves, out_spec = pytree.tree_flatten(out)
    expected_leaves, expected_spec = pytree.tree_flatten(expected_out)
    assert out_spec == expected_spec
    for got, want in zip(out_leaves, expected_leaves):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-6)

    # export may name a tied weight by either alias: compare per tensor, named by its first FQN
    params = dict(eager.named_parameters(remove_duplicate=False))
    canonical = {id(p): fqn for fqn, p in eager.named_parameters()}
    got = {canonical[id(params[fqn])]: grad for fqn, grad in grads.items()}
    trainable = {fqn for fqn, p in eager.named_parameters() if p.requires_grad}
    assert set(got) == trainable, f"gradients missing for {sorted(trainable - set(got))}"
    for fqn, grad in got.items():
        torch.testing.assert_close(grad, params[fqn].grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{fqn}: {m}")


def test_a_buffer_written_on_one_stage_is_sent_to_the_stages_reading_it_after():
    # rotary-embedding-torch's frequency cache (nGPT at pp 2): stage 1 read its own copy of the buffer, never
    # written (its frequencies all zeros); it now receives the buffer as stage 0 left it and holds no copy
    _model_file, _traced, graph = trace_and_split(model_path("buffer_cache"))
    cache = next(ref for ref in graph.state.values() if ref.fqn == "rotary.cached_freqs")
    assert cache.stages == [0]
    assert any(value.producer == 0 and value.consumers == [1] and list(value.meta.shape) == [32, 16]
               for value in graph.values.values())


def test_a_buffer_read_on_a_stage_before_another_writes_it_is_refused_by_name(monkeypatch):
    from tracepp.split.partition import SplitError

    monkeypatch.setenv("READ_BEFORE", "1")
    with pytest.raises(SplitError, match=r"'b_rotary_cached_freqs' is written in place at buffer_cache.py:\d+ "
                                         r"\(stage 1\) and read at buffer_cache.py:\d+ \(stage 0\) before that write"):
        trace_and_split(model_path("buffer_cache"))


@pytest.mark.parametrize("how", ["1", "cast"])
def test_a_buffer_written_with_a_value_that_carries_a_gradient_is_refused_by_name(monkeypatch, how):
    # Meta's reference Llama keeps each call's keys in self.cache_k in training: the split was written, and its
    # second microbatch failed ("Trying to backward through the graph a second time", as eager's second step). It
    # writes through self.cache_k.to(xq), a cast that changes nothing ("cast"): the write reaches the buffer all the same
    from tracepp.split.partition import SplitError

    monkeypatch.setenv("KEEP_ACTIVATIONS", how)
    with pytest.raises(SplitError, match=r"writes a value that carries a gradient .* into 'b_rotary_cached_freqs'"):
        trace_and_split(model_path("buffer_cache"))


def test_tied_weight_is_shared_across_stages():
    _model_file, _traced, graph = trace_and_split(model_path("tied_lm"))
    shared = graph.shared_state()
    assert len(shared) == 1 and shared[0].stages == [0, 1]
    assert shared[0].aliases == ["embed.weight", "head.weight"] and shared[0].fqn in shared[0].aliases


def test_skip_value_goes_straight_to_stage_two():
    _model_file, _traced, graph = trace_and_split(model_path("skip3"))
    from_stage0 = {name: value.consumers for name, value in graph.values.items() if value.producer == 0}
    assert [1, 2] in from_stage0.values(), f"stage 0 sends {from_stage0}; expected one value read by stages 1 and 2"
    assert graph.edges()[0][:2] == (0, 1) and any(p == 0 and c == 2 for p, c, _ in graph.edges())
    buffers = {ref.fqn: (ref.stages, ref.persistent) for ref in graph.state.values() if ref.kind == "buffer"}
    assert buffers == {"in_shift": ([0], False), "out_scale": ([2], True)}


def test_mask_and_position_ids_read_on_every_stage():
    _model_file, _traced, graph = trace_and_split(model_path("mask_kwargs"))
    by_path = {ref.path: ref for ref in graph.root_inputs.values()}
    assert by_path["kwargs['mask']"].stages == [0, 1] and by_path["kwargs['mask']"].meta.dtype == "bool"
    assert by_path["kwargs['position_ids']"].stages == [0, 1]
    assert by_path["kwargs['position_ids']"].meta.dtype == "int64"
    assert not by_path["kwargs['position_ids']"].batched and by_path["kwargs['mask']"].batched
    # no bool/int value crosses a boundary carrying a gradient
    for value in graph.values.values():
        assert not value.meta.requires_grad or value.meta.dtype.startswith(("float", "bfloat"))


@pytest.mark.parametrize("name,layer", [("hf_llama", "model.layers.1"), ("hf_gpt2", "transformer.h.1")])
def test_hf_module_split_points_and_buffers(name, layer):
    pytest.importorskip("transformers")
    _model_file, _traced, graph = trace_and_split(model_path(name), split_points=[layer])
    fqns = [{graph.state[name].fqn for name in stage.state} for stage in graph.stages]
    assert any(f.startswith(layer + ".") for f in fqns[1]) and not any(f.startswith(layer + ".") for f in fqns[0])
    first = layer[:-1] + "0"  # the layer before the split point
    assert any(f.startswith(first + ".") for f in fqns[0]) and not any(f.startswith(first + ".") for f in fqns[1])
    assert graph.shared_state(), f"{name}: the tied embedding/LM head must be shared across stages"
    for ref in graph.state.values():
        assert ref.stages, f"{ref.fqn} is placed on no stage"
    if name == "hf_llama":
        inv_freq = next(ref for ref in graph.state.values() if ref.fqn == "model.rotary_emb.inv_freq")
        assert inv_freq.kind == "buffer" and not inv_freq.persistent
        # each stage that reads the buffer holds it (stage 1 makes the rotary table again from it)
        for index in inv_freq.stages:
            assert inv_freq.placeholder in graph.stages[index].state


def test_no_grad_region_is_inlined_and_detached():
    _model_file, traced, graph = trace_and_split(model_path("no_grad_region"))
    targets = [str(n.target) for stage in graph.stages for n in stage.graph.nodes]
    assert not any("wrap_with_set_grad_enabled" in t for t in targets)
    assert all(n.op != "get_attr" for stage in graph.stages for n in stage.graph.nodes)
    assert "aten.detach.default" in targets
    # the detached statistic crosses to stage 1 without a gradient
    crossing = [v for v in graph.values.values() if v.meta.shape == []]
    assert crossing and not any(v.meta.requires_grad for v in crossing)


@pytest.mark.parametrize("name,layer", [("olmo_core_autocast", "blocks.1"), ("autocast_bf16_region", "layers.1")])
def test_autocast_regions_nested_and_enabled_are_flat_and_match_eager(name, layer):
    # OLMo-core's autocast(enabled=False) regions nested in one another (refused before: one level was inlined),
    # and an enabled bf16 region, traced again so the casts autocast inserts are ops of the graph
    model_file, traced, graph = trace_and_split(model_path(name), split_points=[layer])
    nodes = [n for stage in graph.stages for n in stage.graph.nodes]
    assert not any("wrap_with_autocast" in str(n.target) or n.op == "get_attr" for n in nodes)
    if name == "autocast_bf16_region":
        casts = [n for n in nodes if n.target is torch.ops.aten._to_copy.default
                 and n.kwargs.get("dtype") == torch.bfloat16]
        assert casts, "the casts autocast inserts are not in the stage graphs"
    _assert_matches_eager(model_file, traced, graph)


@pytest.mark.parametrize("raw,fqn", [
    ("model.layers.1", "model.layers.1"),  # what torch 2.13's export records
    ("L['self'].model.layers[1]", "model.layers.1"),
    ("L['self']._modules['model']._modules['layers']['1']", "model.layers.1"),
    ("L['self'].transformer._modules['h'][0].attn", "transformer.h.0.attn"),
    ("L['self']", ""),
    # a sliced module list where a module is shared (PEFT's VeRA under Llama's self.layers[:n]): pp found one segment
    ("base_model.model.model.layers.slice(None, 2, None).0.self_attn", "base_model.model.model.layers.0.self_attn"),
    ("model.layers.slice(1, None, 2).1", "model.layers.3"),
])
def test_module_path_normalises_export_spellings(raw, fqn):
    from tracepp.split.partition import module_path

    assert module_path(raw) == fqn


@pytest.mark.parametrize("name", ["hf_llama", "hf_gpt2"])
def test_hf_module_stack_paths_are_module_fqns(name):
    """Every nn_module_stack path export records for an HF model names a module of model.named_modules()."""
    pytest.importorskip("transformers")
    from tracepp.split.partition import node_modules

    _model_file, traced, _graph = trace_and_split(model_path(name))
    known = {fqn for fqn, _ in traced.model.named_modules()}
    seen = {path for node in traced.program.graph.nodes for path in node_modules(node)}
    assert seen - {""} and seen <= known, f"not module FQNs: {sorted(seen - known)[:5]}"


@pytest.fixture(scope="module")
def deep_llama():
    """A 22-layer tiny HF Llama with no split points, traced once for the automatic-split tests."""
    pytest.importorskip("transformers")
    from tracepp.modelfile import load_model_file
    from tracepp.trace import trace

    model_file = load_model_file(model_path("hf_llama_deep"))
    return model_file, trace(model_file, 1)


@pytest.mark.parametrize("num_stages", [2, 4, 8])
def test_automatic_split_cuts_between_layers_and_sends_only_the_hidden_state(deep_llama, num_stages):
    """With no split points, ``--stages N`` alone cuts the Llama between ``model.layers.N`` (embedding on the
    first stage, norm and head on the last), every layer whole on one stage; only the hidden state crosses a
    boundary (the rotary tables and the causal mask are made again by each stage from the root inputs and the
    inv_freq buffer), and the stages together equal the unsplit model."""
    from tracepp.split.partition import split

    model_file, traced = deep_llama
    graph = split(traced, None, num_stages, schedule="1f1b", num_microbatches=4)
    assert graph.num_stages == num_stages
    layers = [[int(fqn.split(".")[2]) for fqn in stage.module_fqns if fqn.startswith("model.layers.")]
              for stage in graph.stages]
    assert [layer for stage_layers in layers for layer in stage_layers] == list(range(22))
    assert all(stage_layers for stage_layers in layers)
    assert "model.embed_tokens" in graph.stages[0].module_fqns and "lm_head" in graph.stages[-1].module_fqns
    hidden = [4, 8, 16]  # batch, sequence, hidden size of hf_llama_deep
    assert [(v.producer, v.consumers, v.meta.shape) for v in graph.values.values()] == [
        (index, [index + 1], hidden) for index in range(num_stages - 1)]
    assert graph.recomputed and all(where["stages"] == list(range(1, num_stages))
                                    for where in graph.recomputed.values())
    inv_freq = next(ref for ref in graph.state.values() if ref.fqn == "model.rotary_emb.inv_freq")
    assert inv_freq.stages == list(range(num_stages))
    _assert_matches_eager(model_file, traced, graph)


@pytest.mark.parametrize("name", ["reversible_layers", "reentrant_checkpoint", "straight_through_quant"])
def test_a_function_with_a_backward_of_its_own_splits_to_eagers_gradients(name):
    # reversible layers (reformer-pytorch, h-transformer-1d, HF Reformer) and torch's reentrant checkpoint: an
    # autograd.Function whose forward runs layers under no_grad and whose own backward recomputes them. Refused
    # before (split, those layers would never train); traced again with the forward recorded, where one eager step
    # with the Function's backward and one with autograd's agree. HF BitNet's straight-through estimators: their
    # rounds' zero derivative stopped every gradient before them (with a note only); traced as x + (f(x) - x).detach().
    # The stages compute what eager's own backwards do
    model_file, traced, graph = trace_and_split(model_path(name), num_stages=2)
    assert graph.num_stages == 2
    said = "straight-through estimators" if name == "straight_through_quant" else "traced again with those layers"
    assert any(said in note for note in traced.notes), traced.notes
    _assert_matches_eager(model_file, traced, graph)
