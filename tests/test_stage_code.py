"""Generated stage code in one process: readable names, and repeated blocks printed once and called per block.

A stage function printed with its blocks extracted must compute exactly what the inline one computes: the same
ops in the same order per block, so outputs and gradients are bit-identical.
"""
from __future__ import annotations

import os

import pytest
import torch

from tracepp.codegen.stage_code import find_blocks, globals_prelude, group_blocks, prepare, stage_source
from tracepp.driver import split_model
from tracepp.runtime.mesh import Layout
from tracepp.modelfile import load_model_file
from tracepp.split import naming
from tracepp.split.partition import split
from tracepp.trace import trace
from util import model_path


def _split(name: str, num_stages=None, split_points=None):
    model_file = load_model_file(model_path(name))
    traced = trace(model_file, 1)
    return traced, split(traced, split_points, num_stages)


def _block_functions(stage) -> list:
    return group_blocks(find_blocks(prepare(stage)), naming.Namespace())


def _compiled(graph, stage, extract_blocks: bool):
    source, names = stage_source(stage, "stage_fn", "", graph.symbol_aliases, extract_blocks=extract_blocks)
    scope = {"torch": torch}
    exec(compile(globals_prelude(names) + "\n" + source, "<stage>", "exec"), scope)
    return scope["stage_fn"], source


def _run(traced, graph, stage, fn):
    """Outputs and the gradients of every input of ``fn`` for a fixed random cotangent."""
    tensors = dict(traced.model.named_parameters(remove_duplicate=False))
    tensors.update(traced.model.named_buffers(remove_duplicate=False))
    state = []
    for name in stage.state:
        ref = graph.state[name]
        value = traced.program.constants[ref.fqn] if ref.kind == "constant" else tensors[ref.fqn]
        state.append(value.detach().clone().requires_grad_(ref.kind == "parameter"))
    roots = [traced.example_leaves[graph.root_inputs[name].leaf_index] for name in stage.root_inputs]
    generator = torch.Generator().manual_seed(0)
    received = []
    for _producer, name in stage.received:
        meta = graph.values[name].meta
        received.append(torch.randn(meta.shape, generator=generator).requires_grad_(meta.requires_grad))
    outputs = fn(*state, *roots, *received)
    total = sum((out * torch.randn(out.shape, generator=generator)).sum() for out in outputs
                if isinstance(out, torch.Tensor) and out.requires_grad)
    total.backward()
    return list(outputs), [t.grad for t in state + received if t.requires_grad]


def _assert_bit_identical(traced, graph, stage):
    inline, _ = _compiled(graph, stage, extract_blocks=False)
    blocks, _ = _compiled(graph, stage, extract_blocks=True)
    expected_out, expected_grads = _run(traced, graph, stage, inline)
    out, grads = _run(traced, graph, stage, blocks)
    assert len(out) == len(expected_out) and len(grads) == len(expected_grads)
    for a, b in zip(out + grads, expected_out + expected_grads):
        assert torch.equal(a, b), "the block functions changed a value"


def test_llama_stage_runs_its_decoder_layers_through_one_function():
    traced, graph = _split("hf_llama_deep", num_stages=2)
    for stage in graph.stages:
        (function,) = _block_functions(stage)
        layers = [m for m in stage.module_fqns if m.startswith("model.layers.")]
        assert [block.path for block in function.blocks] == layers and len(layers) >= 10
        assert function.name == "llama_decoder_layer"
    source = _compiled(graph, graph.stages[1], extract_blocks=True)[1]
    inline = _compiled(graph, graph.stages[1], extract_blocks=False)[1]
    assert source.count("\n") * 3 < inline.count("\n")  # 11 layers: one printed once, then 11 calls
    assert source.count("def llama_decoder_layer(") == 1
    assert "    hidden: " in source and "self_attn_q_proj_weight: " in source  # parameters named per block
    assert "# File: transformers/models/llama/modeling_llama.py:" in source  # provenance, relative path
    _assert_bit_identical(traced, graph, graph.stages[1])


def test_gpt2_blocks_are_one_function_and_bit_identical():
    traced, graph = _split("hf_gpt2", num_stages=1)
    (function,) = _block_functions(graph.stages[0])
    assert [block.path for block in function.blocks] == ["transformer.h.0", "transformer.h.1"]
    assert function.name == "gpt2_block"
    _assert_bit_identical(traced, graph, graph.stages[0])


def test_blocks_that_differ_get_a_function_per_graph_and_a_block_met_once_its_own():
    traced, graph = _split("mixed_blocks_lm", num_stages=1)
    functions = _block_functions(graph.stages[0])
    assert sorted([block.path for block in f.blocks] for f in functions) == [["layers.0", "layers.2"],
                                                                          ["layers.1", "layers.3"], ["layers.4"]]
    _fn, source = _compiled(graph, graph.stages[0], extract_blocks=True)
    assert "def block(" in source and "def block_1(" in source and "def block_2(" in source
    assert "aten.relu.default" in source and "aten.gelu.default" in source
    stage_part = source[source.index("def stage_fn("):]
    # layers.4 is met once: a function called once (activation checkpointing recomputes block calls one by one)
    assert "aten.linear.default(layer_norm_4, p_layers_4_up_weight" not in stage_part
    assert stage_part.count("= block(") == 2 and stage_part.count("= block_1(") == 2
    assert stage_part.count("= block_2(") == 1
    _assert_bit_identical(traced, graph, graph.stages[0])


def test_a_block_cut_in_two_gets_functions_of_its_own():
    """A split point inside ``layers.2`` (at its ``up`` projection): stage 0 ends with layers.2's norm, stage 1
    starts with the rest of it. Those halves match no whole block, so each is a function of its own; layers.0 and
    layers.1 still share one."""
    traced, graph = _split("residual_mlp_lm", split_points=["layers.2.up"])
    functions = _block_functions(graph.stages[0])
    assert [[block.path for block in f.blocks] for f in functions] == [["layers.0", "layers.1"], ["layers.2"]]
    assert [[block.path for block in f.blocks] for f in _block_functions(graph.stages[1])] == [["layers.2"],
                                                                                              ["layers.3"]]
    for stage in graph.stages:
        _assert_bit_identical(traced, graph, stage) if stage.index == 0 else None
    assert len(graph.stages[1].received) == 2  # the residual stream and the norm's output


def test_boundary_values_are_named_after_what_made_them():
    traced, graph = _split("hf_llama", split_points=["model.layers.1"])
    assert list(graph.values) == ["layers_0_out"]
    assert {"causal_mask", "rotary_emb_cos", "rotary_emb_sin"} <= set(graph.recomputed)
    stage0, stage1 = graph.stages
    placeholders = [[n.name for n in stage.graph.nodes if n.op == "placeholder"] for stage in graph.stages]
    # the tied weight is read by the embedding on stage 0 and by the head on stage 1
    assert "p_model_embed_tokens_weight" in placeholders[0] and "p_lm_head_weight" not in placeholders[0]
    assert "p_lm_head_weight" in placeholders[1] and "p_model_embed_tokens_weight" not in placeholders[1]
    assert "layers_0_out_from_stage0" in placeholders[1]
    assert stage1.outputs == ["lm_head_out"]


def test_sizes_are_named_after_root_symbols_and_blocks_take_them(tmp_path):
    out = str(tmp_path / "out")
    manifest = split_model(model_path("dynamic_seq_lm"), out, schedule="1f1b", num_microbatches=2, layout=Layout(pp=2))
    assert [item["name"] for item in manifest["stages"][1]["sym_inputs"]] == ["s_seq", "s_seq_plus_1"]
    source = open(os.path.join(out, "rank0.py")).read()
    assert 's_seq: "Sym(s_seq)"' in source and "s95" not in source
    # layers.0 traces `seq_len + 1` and layers.1 reuses it: the size runs before the first call instead
    assert source.count("= block(") == 2


def test_no_absolute_path_in_the_generated_files(tmp_path):
    out = str(tmp_path / "out")
    split_model(model_path("residual_mlp_lm"), out, schedule="1f1b", num_microbatches=2, layout=Layout(pp=2))
    for name in ("rank0.py", "rank1.py", "run.py"):
        text = open(os.path.join(out, name)).read()
        assert str(tmp_path) not in text and os.path.dirname(model_path("x")) not in text, name
        assert "torchrun --nproc-per-node 2 run.py" in text and "from this folder" in text, name


@pytest.mark.parametrize("candidate, expected", [
    ("model.layers.5", "layers_5"), ("model.layers.5.mlp", "layers_5_mlp"), ("transformer.h.3", "h_3"),
    ("model.embed_tokens", "embed_tokens"), ("lm_head", "lm_head"), ("blocks.0", "blocks_0"),
])
def test_short_module_names(candidate, expected):
    assert naming.short_module_name(candidate) == expected


def test_namespace_is_unique_and_legal():
    namespace = naming.Namespace(["add_4", "x"])
    assert namespace.create("x") == "x_1"
    assert namespace.create("layers_5_out") == "layers_5_out"
    assert namespace.create("layers_5_out") == "layers_5_out_1"
    assert namespace.create("0_attn").isidentifier()
    assert namespace.create("list") != "list"  # never shadows a builtin


def test_a_v_rank_shares_one_block_function_between_its_stages():
    """On a V rank (stages 0 and 3), the first stage makes the rotary tables and the mask, the last recomputes
    them: different nodes under one name, so the shared function takes them by that name, once each."""
    from tracepp.codegen.stage_code import rank_code

    traced, graph = _split("hf_llama_deep", num_stages=4)
    code = rank_code([(graph.stages[0], "stage0_forward"), (graph.stages[3], "stage3_forward")])
    (function, source), = code.blocks
    assert {block.path.rsplit(".", 1)[0] for block in function.blocks} == {"model.layers"}
    assert len({id(block.nodes[0].graph) for block in function.blocks}) == 2  # blocks of both stages
    compile(source, "<block>", "exec")  # parameter names unique
    signature = source[:source.index("):")]
    assert "    hidden: " in signature and "    rotary_emb_cos: " in signature and "    causal_mask: " in signature
