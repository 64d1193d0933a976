"""Tensor parallelism (issue 33), tiers 1-2: the plan read from the traced graph, as plain data.

Which parameters shard (column-wise, row-wise, vocabulary) and which stay whole, and why: grouped-query
attention with fewer key/value heads than --tp, a fused qkv projection split on its sharded features, a
dim --tp does not divide, the model file's ``tp_plan``; the collectives each stage adds; the mesh's ranks.
"""
import os
import shutil

import pytest

from tracepp.driver import check_model
from tracepp.runtime.mesh import Layout, coordinates, global_rank, mesh_layout, tp_index, world_size
from util import REPO, model_path

ZOO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "zoo")


def _params(path, tp=2, **kw):
    manifest = check_model(path, num_microbatches=2, **kw, layout=Layout(pp=2, tp=tp))
    return manifest, manifest["tp"]["params"]


def test_llama_plan_is_megatrons():
    manifest, params = _params(model_path("tp_llama"))
    for layer in range(4):
        prefix = f"layers.{layer}."
        for name in ("attn.q_proj.weight", "attn.k_proj.weight", "attn.v_proj.weight", "mlp.gate_proj.weight",
                     "mlp.up_proj.weight", "mlp.up_proj.bias"):
            assert params[prefix + name] == {"dim": 0, "role": "colwise"}, name
        for name in ("attn.o_proj.weight", "mlp.down_proj.weight"):
            assert params[prefix + name] == {"dim": 1, "role": "rowwise"}, name
        for name in ("attn.o_proj.bias", "attn_norm.weight", "mlp_norm.weight"):  # added after the all-reduce
            assert params[prefix + name]["dim"] is None, name
    assert params["head.weight"] == {"dim": 0, "role": "colwise"}  # tied: one placement for embedding and head
    stages = manifest["tp"]["stages"]
    ops = [[c["op"] for c in stage["collectives"]] for stage in stages]
    # stage 0: the vocabulary-parallel embedding's sum + 2 row-wise outputs per layer; stage 1: 2 per layer and
    # the head's logits gathered
    assert ops[0].count("all_reduce") == 1 + 2 * 2 and ops[1].count("all_reduce") == 2 * 2
    assert ops[1].count("all_gather") == 1 and ops[0].count("all_gather") == 0
    assert not stages[0]["replicated"] and not stages[1]["replicated"]
    assert manifest["plan"]["mesh"]["tp"] == 2 and manifest["launch_command"].startswith("torchrun --nproc-per-node 4")


def test_a_mamba2_mixer_of_one_group_shards_its_heads_and_makes_its_scores_on_them(tmp_path):
    # Mamba-2 with one group (Mamba2, Bamba, Falcon-H1, Granite-4 hybrid, Zamba2; the mixer used to stay whole on
    # every rank): in_proj's gate, x, B, C and dt as segments (a cut of a range of its parts asks for the points
    # inside it), the depthwise convolution over x, B and C held in their pieces, B and C gathered (one group's
    # state, read by every head: a head of one), the gated norm over one group of every head's features on partial
    # sums, Falcon-H1's muP multipliers read at each part's piece, and the scores of each head made on this rank's
    # heads: B and C repeated to its heads only (they were repeated to every head, and every head's scores
    # computed on every rank)
    from tracepp.driver import split_model

    out = str(tmp_path / "out")
    manifest = split_model(model_path("tp_mamba2_one_group"), out, num_microbatches=2, layout=Layout(pp=1, tp=2))
    params = manifest["tp"]["params"]
    for block in (0, 1):
        prefix = f"blocks.{block}.mixer."
        assert params[prefix + "in_proj.weight"] == {"dim": 0, "role": "colwise", "segments": [64, 64, 8, 8, 4]}
        assert params[prefix + "conv1d.weight"]["segments"] == params[prefix + "conv1d.bias"]["segments"] == [64, 8, 8]
        assert params[prefix + "out_proj.weight"]["role"] == "rowwise"
        for name in ("A_log", "D", "dt_bias", "norm.weight"):
            assert params[prefix + name]["dim"] == 0, name
    stage = manifest["tp"]["stages"][0]
    assert manifest["tp"]["verified"]["status"] == "verified", manifest["tp"]["verified"]
    assert stage["share"] == {"params": 0.9942, "flops": 1.0}, stage["share"]
    assert sum("makes one head of 8 features" in why for why in stage["replicated"]) == 4  # B and C, two layers
    script = open(os.path.join(out, "rank0.py")).read()  # each rank repeats B and C to its 2 heads of 4
    repeats = [line for line in script.splitlines() if "repeat_interleave.self_int(" in line]
    assert len(repeats) == 4 and all(line.endswith("2, 2, output_size = 2)") or "output_size = 2)" in line
                                     for line in repeats), repeats


def test_a_layer_whose_mamba2_mixer_has_fewer_groups_than_tp_has_no_megatron_figure(monkeypatch):
    # Falcon-H1's layer: attention beside a Mamba-2 mixer of one group, whose B and C every rank gathers.
    # Megatron-Core's MambaMixer asserts ngroups % tp_size == 0: its plan does not apply (the layer was compared with
    # Megatron's two regions, 1.09x at Falcon-H1's default size), as in a layer with fewer key/value groups than tp
    pytest.importorskip("transformers")
    monkeypatch.setenv("HF_FAMILY", "falcon_h1")
    manifest = check_model(os.path.join(ZOO, "hf_family.py"), num_microbatches=2, layout=Layout(pp=2, tp=2))
    layers = {name: figures for stage in manifest["tp"]["stages"] for name, figures in stage["layers"].items()}
    assert layers and all(megatron is None and moved > 0 for moved, megatron in layers.values()), layers
    assert any("Mamba-2's B and C" in why for why in manifest["tp"]["stages"][0]["replicated"])
    monkeypatch.setenv("HF_FAMILY", "llama")  # beside it, a layer Megatron's plan applies to is compared
    manifest = check_model(os.path.join(ZOO, "hf_family.py"), num_microbatches=2, layout=Layout(pp=2, tp=2))
    assert all(megatron is not None for stage in manifest["tp"]["stages"] for _moved, megatron in stage["layers"].values())


def test_a_projection_added_into_the_stream_keeps_the_stream_whole():
    # Zamba2's hybrid layer: a block's output projected by a square linear (column-wise: its input is whole) and
    # added to the stream, which a norm written out in elementwise ops leads to the next mixer's linear, and which
    # the residual add reads again. The stream used to be read at each rank's piece there (as a gated product on
    # its way to a linear is): sharded from that layer on, the mixer's input projection row-wise (Zamba2 at its
    # default size: every later Mamba layer all-reduced its 10,376-wide in_proj output, 2.3x each stage's bytes)
    manifest, params = _params(model_path("tp_projected_into_stream"))
    for block in (0, 1):
        assert params[f"blocks.{block}.linear.weight"]["why"].startswith("its output is needed whole by aten.add")
        assert params[f"blocks.{block}.mixer.up.weight"]["role"] == "colwise"
        assert params[f"blocks.{block}.mixer.down.weight"]["role"] == "rowwise"
        assert params[f"blocks.{block}.norm.weight"]["dim"] is None
    assert [s["bytes"] for s in manifest["tp"]["stages"]] == [10240, 12288]  # 22,528 at pp 1; 40,704 before


def test_fewer_kv_heads_than_tp_shard_the_query_heads_and_replicate_the_kv_heads():
    # the zoo's Qwen3 has 2 query heads and 1 key/value head: tp 2 cannot give each rank a kv head of its own, so
    # (as Megatron-Core does) each rank computes its query head and the kv head whole; attention and o_proj shard
    manifest, params = _params(os.path.join(ZOO, "qwen3.py"))
    assert params["model.layers.0.self_attn.q_proj.weight"]["role"] == "colwise"
    assert params["model.layers.0.self_attn.o_proj.weight"]["role"] == "rowwise"
    for name in ("k_proj", "v_proj"):
        entry = params[f"model.layers.0.self_attn.{name}.weight"]
        assert entry["dim"] is None and entry["why"].startswith("its output is needed whole by"), entry
    assert params["model.layers.0.mlp.down_proj.weight"]["role"] == "rowwise"  # the MLP still shards
    reasons = " ".join(manifest["tp"]["stages"][0]["replicated"])
    assert "fewer heads than --tp" in reasons and "grouped-query" in reasons
    # the whole key/value head is read beside each rank's query head: its gradient is summed over tp
    assert "all_reduce (backward)" in [c["op"] for c in manifest["tp"]["stages"][0]["collectives"]]


def test_fused_qkv_shards_each_part_by_heads():
    # examples/gpt.py: qkv = Linear(d, 3d) then .split(d, dim=2): each rank holds its heads' rows of q, k and v
    manifest, params = _params(os.path.join(REPO, "examples", "gpt.py"))
    d = 64
    assert params["blocks.0.attn.qkv.weight"] == {"dim": 0, "role": "colwise", "segments": [d, d, d]}
    assert params["blocks.0.attn.qkv.bias"]["segments"] == [d, d, d]
    assert params["blocks.0.attn.proj.weight"]["role"] == "rowwise"
    assert params["blocks.0.mlp.0.weight"]["role"] == "colwise" and params["blocks.0.mlp.2.weight"]["role"] == "rowwise"
    assert manifest["tp"]["stages"][0]["share"]["params"] > 0.9


def test_fused_qkv_viewed_into_its_parts_and_a_per_head_bias_table_shard_by_heads():
    # qkv(x).view(b, s, 3, heads, d).permute(2, 0, 3, 1, 4), as timm and many decoders write it: 3 parts are not
    # divided by --tp 2, so the projection is asked for them as segments and each rank holds its heads of each
    # part (it was replicated: "pieces would not be whole heads"). A relative position bias table [buckets, heads]
    # (T5's, CPM-Ant's), picked at the buckets the model computes and added to each head's scores, is held by its
    # columns: no collective for it (it was vocabulary-parallel: an all-reduce of [heads, q, k] forward)
    manifest = check_model(model_path("tp_bias_table"), schedule="gpipe", num_microbatches=2,
                           layout=Layout(pp=1, tp=2), verify="on")
    tp = manifest["tp"]
    assert tp["verified"]["status"] == "verified", tp["verified"]
    d = 32
    assert tp["params"]["layers.0.attn.qkv.weight"] == {"dim": 0, "role": "colwise", "segments": [d, d, d]}
    assert tp["params"]["layers.0.attn.o.weight"]["role"] == "rowwise"
    assert tp["params"]["relative_attention_bias.weight"]["dim"] == 1
    afters = [c["after"] for c in tp["stages"][0]["collectives"]]
    assert not [a for a in afters if "bias" in a], afters
    assert tp["stages"][0]["share"]["params"] > 0.95 and not tp["stages"][0]["replicated"]


def test_a_bias_sharded_by_heads_crosses_the_stage_boundary_as_a_shard():
    # the bias [1, heads, q, k] is made on stage 0 and read by every layer: sent to stage 1 as each rank's heads (it
    # was gathered for the boundary, so the table was replicated and stage 1 read it at its heads again, the
    # gradient's pieces all-gathered per layer: CPM-Ant 1.31x Megatron's bytes at pp 2, now 1.00x)
    manifest = check_model(model_path("tp_bias_table"), schedule="gpipe", num_microbatches=2,
                           layout=Layout(pp=2, tp=2), verify="on")
    tp = manifest["tp"]
    assert tp["verified"]["status"] == "verified", tp["verified"]
    assert tp["params"]["relative_attention_bias.weight"]["dim"] == 1
    assert list(tp["sent"].values()) == [1], tp["sent"]  # the heads dim of [1, heads, q, k]
    sent = next(iter(tp["sent"]))
    assert manifest["values"][sent]["shape"][1] == 4 // 2, manifest["values"][sent]  # this rank's 2 of 4 heads
    for stage in tp["stages"]:
        assert not [c for c in stage["collectives"] if "bias" in c["after"]], stage["collectives"]
        assert all(moved == megatron for moved, megatron in stage["layers"].values()), stage["layers"]


def test_a_factorized_embeddings_mapping_read_by_several_row_wise_linears_is_computed_whole():
    # ALBERT's and RemBERT's embedding_hidden_mapping_in (16 -> 64): column-wise, the first layer's q, k and v read
    # its sharded output row-wise (three all-reduces, 1.62x Megatron's bytes at RemBERT's default size); the cost
    # trial computes it whole on every rank (2.6% of a layer's parameters) and the layer is Megatron's plan
    manifest = check_model(model_path("tp_factorized_embedding"), schedule="gpipe", num_microbatches=2,
                           layout=Layout(pp=1, tp=2), verify="on")
    tp = manifest["tp"]
    assert tp["verified"]["status"] == "verified", tp["verified"]
    mapping = tp["params"]["embedding_hidden_mapping_in.weight"]
    assert mapping["dim"] is None and mapping["why"].startswith("computed whole on every rank: its sharded output "
                                                                "is read by 3 row-wise linears"), mapping
    assert [tp["params"][f"layers.0.{p}_proj.weight"]["role"] for p in "qkvo"] == ["colwise"] * 3 + ["rowwise"]
    assert all(moved == megatron for moved, megatron in tp["stages"][0]["layers"].values()), tp["stages"][0]


def test_dims_tp_does_not_divide_stay_whole():
    manifest, params = _params(model_path("tp_llama"), tp=3)  # vocabulary 64, 4 heads, MLP 64: none divide by 3
    assert all(entry["dim"] is None for entry in params.values())
    reasons = " ".join(r for stage in manifest["tp"]["stages"] for r in stage["replicated"])
    assert "which --tp 3 does not divide" in reasons


def _with_plan(tmp_path, plan_text: str) -> str:
    path = tmp_path / "model.py"
    shutil.copy(model_path("tp_llama"), path)
    with open(path, "a") as handle:
        handle.write(f"\n\ntp_plan = {plan_text}\n")
    return str(path)


def test_model_file_tp_plan_replicates_what_it_names(tmp_path):
    _manifest, params = _params(_with_plan(tmp_path, '{"layers.*.mlp.*": "replicate"}'))
    assert all(params[f"layers.{i}.mlp.{n}"]["dim"] is None for i in range(4) for n in ("up_proj.weight",
                                                                                          "down_proj.weight"))
    assert params["layers.0.mlp.up_proj.weight"]["why"] == "tp_plan 'layers.*.mlp.*'"
    assert params["layers.0.attn.o_proj.weight"]["role"] == "rowwise"


_SCALED_MLP = """
import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 64)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 64))  # per channel of the up-projection's output
        self.down = nn.Linear(64, 16)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)) * self.scale)


def model():
    torch.manual_seed(0)
    return nn.Sequential(MLP(), MLP())


def example_inputs():
    return (torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(0)),)


def example_target():
    return torch.zeros(2, 8, 16)


def loss_fn(out, target):
    return F.mse_loss(out, target)
"""


def test_model_file_tp_plan_keeps_whole_a_weight_beside_a_sharded_value(tmp_path):
    # a per-channel scale of a column-wise output is sharded with it; the model file's "replicate" for it is kept
    # (the walk sharded it anyway, with the override's note beside dim 0, as it did a norm weight a cost trial
    # kept whole: Zamba's mamba_decoder.input_layernorm)
    path = tmp_path / "scaled_mlp.py"
    path.write_text(_SCALED_MLP)
    params = check_model(str(path), schedule="gpipe", num_microbatches=2, layout=Layout(pp=1, tp=2),
                         verify="on")["tp"]["params"]
    assert params["0.scale"]["dim"] == 0 and params["0.up.weight"]["role"] == "colwise"
    path.write_text(_SCALED_MLP + '\ntp_plan = {"*.scale": "replicate"}\n')
    manifest = check_model(str(path), schedule="gpipe", num_microbatches=2, layout=Layout(pp=1, tp=2), verify="on")
    params = manifest["tp"]["params"]
    assert manifest["tp"]["verified"]["status"] == "verified", manifest["tp"]["verified"]
    # read at each rank's channels (tp_piece), its gradient parts summed once per step
    assert params["0.scale"] == {"dim": None, "role": "replicate", "grad": "partial", "why": "tp_plan '*.scale'"}, \
        params["0.scale"]
    assert params["0.up.weight"]["role"] == "colwise" and params["0.down.weight"]["role"] == "rowwise"


def test_model_file_tp_plan_that_contradicts_the_graph_names_the_parameter(tmp_path):
    with pytest.raises(ValueError, match=r"layers\.0\.attn\.o_proj\.weight can only be rowwise"):
        _params(_with_plan(tmp_path, '{"layers.0.attn.o_proj.weight": "colwise"}'))
    with pytest.raises(ValueError, match="use 'colwise', 'rowwise' or 'replicate'"):
        _params(_with_plan(tmp_path, '{"layers.*": "sharded"}'))


def test_mesh_ranks_keep_tp_innermost():
    layout = mesh_layout({"num_ranks": 2, "mesh": {"dp": 2, "tp": 2}})
    assert world_size(layout) == 8
    assert [global_rank(layout, d, p, t) for d in range(2) for p in range(2) for t in range(2)] == list(range(8))
    assert [(coordinates(layout, r), tp_index(layout, r)) for r in (0, 1, 2, 5, 7)] == [
        ((0, 0), 0), ((0, 0), 1), ((0, 1), 0), ((1, 0), 1), ((1, 1), 1)]


def test_cli_refuses_tp_with_dp_inner_order(capsys):
    from tracepp.cli import main

    code = main(["split", model_path("tp_llama"), "--tp", "2", "--dp", "2", "--dp-order", "dp-inner", "-o", "/tmp/x"])
    assert code != 0
    assert "--dp-order pp-inner" in capsys.readouterr().err


def test_a_shard_holds_only_its_own_storage():
    # a chunk along dim 0 is a view: kept as it is, every rank would hold the whole weight behind its half
    import torch

    from tracepp.runtime.tensor_parallel import shard

    weight = torch.arange(48.0).reshape(8, 6)
    for dim in (0, 1):
        piece = shard(weight, dim, 2, 1)
        assert torch.equal(piece, weight.chunk(2, dim=dim)[1])
        assert piece.untyped_storage().nbytes() == weight.untyped_storage().nbytes() // 2


def test_check_and_inspect_show_the_plan_and_calibrate_points_at_tp_sizes(tmp_path, capsys):
    from tracepp.cli import main
    from tracepp.driver import split_model

    assert main(["check", model_path("tp_llama"), "--tp", "2", "--microbatches", "2"]) == 0
    text = capsys.readouterr().out
    assert "tensor parallel (tp=2): 33 of 46 parameters sharded" in text
    assert "layers.*.attn.o_proj.weight  (x4)" in text and "Shard(1)" in text
    out = str(tmp_path / "out")
    split_model(model_path("tp_llama"), out, num_microbatches=2, layout=Layout(pp=2, tp=2))
    assert main(["inspect", out]) == 0
    text = capsys.readouterr().out
    assert "collectives per microbatch forward" in text and "all_gather of float32[4, 16, 64]" in text
    assert main(["calibrate", out]) == 2
    assert "--tune --tp-sizes 1,2" in capsys.readouterr().err


def test_vocab_embedding_pieces_sum_to_the_lookup_and_keep_padding(tmp_path):
    # one process: a gloo group of 1 makes tp_all_reduce the identity, so each "rank" returns its partial lookup;
    # the partials of the two halves must sum to the whole lookup, and each half's gradient must be its rows of
    # the whole gradient (the padding row, on rank 1, gets none)
    import torch
    import torch.distributed as dist

    from tracepp.runtime import tensor_parallel

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        weight = torch.randn(8, 3, requires_grad=True)
        ids = torch.tensor([[0, 5, 7, 3], [6, 6, 1, 4]])
        expected = torch.nn.functional.embedding(ids, weight, padding_idx=6)
        expected.pow(2).sum().backward()
        total, grads = 0, []
        for rank in range(2):
            tensor_parallel.set_group(dist.group.WORLD, 2, rank)
            piece = tensor_parallel.shard(weight.detach(), 0, 2, rank).requires_grad_()
            out = torch.ops.tracepp.tp_vocab_embedding.default(piece, ids, 6)
            total = total + out.detach()
            # the backward of the whole loss reaches each piece through its own rows only
            (2 * expected.detach() * out).sum().backward()
            grads.append(piece.grad)
        assert torch.allclose(total, expected)
        assert torch.allclose(torch.cat(grads), weight.grad)
        assert grads[1][2].abs().sum() == 0  # row 6 is the padding row
    finally:
        tensor_parallel.set_group(None, 1, 0)
        dist.destroy_process_group()


# ---- every family's decoder layers shard, at microbatch sizes 1 and 2 (tests/zoo/tp_hf.py)

def _family_manifest(monkeypatch, family: str, microbatch_size: int):
    import importlib.util

    monkeypatch.setenv("TP_HF_FAMILY", family)
    path = os.path.join(ZOO, "tp_hf.py")
    manifest = check_model(path, num_microbatches=4 // microbatch_size, layout=Layout(pp=2, tp=2))
    spec = importlib.util.spec_from_file_location("tp_hf_sizes", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.syspath_prepend(ZOO)
    spec.loader.exec_module(module)
    sizes = {name: p.numel() for name, p in module.model().named_parameters()}
    return manifest, sizes


@pytest.mark.parametrize("microbatch_size", [1, 2])
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "starcoder2", "olmo2", "gemma3", "gpt_neox", "phi3",
                                    "falcon", "gpt2", "mixtral"])
def test_every_family_shards_its_decoder_layers(monkeypatch, family, microbatch_size):
    # at tp 2 at least 0.95 of each decoder layer's parameters are sharded (norms stay whole); Mixtral's routed
    # experts and router are counted apart (they shard over --ep, not --tp)
    import re

    manifest, sizes = _family_manifest(monkeypatch, family, microbatch_size)
    params = manifest["tp"]["params"]
    layers: dict = {}
    for fqn, entry in params.items():
        match = re.search(r"\.(?:layers|h)\.(\d+)\.", fqn)
        if match is None or ".experts." in fqn or ".mlp.gate." in fqn or "block_sparse_moe" in fqn:
            continue
        total = layers.setdefault(match.group(1), [0, 0])
        total[1] += sizes[fqn]
        total[0] += sizes[fqn] if entry["dim"] is not None else 0
    shares = {layer: sharded / total for layer, (sharded, total) in layers.items()}
    whole = sorted(f for f, e in params.items() if e["dim"] is None and "norm" not in f and "ln" not in f)
    assert len(shares) == 2 and min(shares.values()) >= 0.95, (shares, whole, manifest["tp"]["stages"][0]["replicated"])
    for stage in manifest["tp"]["stages"]:  # inspect's figures: the sharded share of parameters and FLOPs
        assert 0 < stage["share"]["params"] <= 1 and 0 < stage["share"]["flops"] <= 1


def test_a_fused_projection_shards_each_part_and_its_rows_come_back_in_the_models_layout():
    import torch

    from tracepp.runtime.tensor_parallel import _runs, original_layout, shard

    weight = torch.arange(8 * 3.0).reshape(8, 3)  # rows: q 0-3, k 4-5, v 6-7
    pieces = [shard(weight, 0, 2, rank, [4, 2, 2]) for rank in range(2)]
    assert pieces[0][:, 0].tolist() == [0, 3, 12, 18] and pieces[1][:, 0].tolist() == [6, 9, 15, 21]
    assert torch.equal(original_layout(torch.cat(pieces), 0, 2, [4, 2, 2]), weight)
    # rank 1's rows [4, 8) of the rank-major layout are the model's rows 2-3, 5 and 7
    assert _runs(4, 4, 8, 2, [4, 2, 2]) == [(2, 4, 2), (5, 6, 1), (7, 7, 1)]
    assert _runs(5, 2, 8, 2, [4, 2, 2]) == [(3, 5, 1), (5, 6, 1)]  # an FSDP shard of it


def test_views_follow_the_sharded_dim_at_every_batch_size():
    import sympy

    from tracepp.split.rules import view_placement

    def place(before, after, dim, segments=None):
        return view_placement([sympy.Integer(s) for s in before], [sympy.Integer(s) for s in after], dim,
                              segments, 2)

    assert place([1, 8, 32], [1, 8, 4, 8], 2) == (2, None)  # into heads, batch of one
    assert place([1, 2, 2, 8, 8], [1, 4, 8, 8], 1) == (1, None)  # grouped-query heads repeated, batch of one
    assert place([1, 8, 8], [1, 8, 1, 8], 2) is None  # one key/value head cannot be split over 2 ranks
    assert place([2, 8, 4, 8], [2, 8, 32], 2) == (2, None)  # heads merged back
    assert place([2, 8, 96], [2, 8, 12, 8], 2, (32, 32, 32)) == (2, (4, 4, 4))  # a fused projection into heads
    assert place([2, 8, 24], [2, 8, 3, 8], 2) is None  # 3 heads: rank pieces would cut a head in two
    assert place([16, 32], [2, 8, 32], 0, (8, 8)) == (1, None)  # tokens of 2 samples, each sharded, split back
    # [batch, seq, heads] rows (Qwen3-Next's gated norm over [2 * 8 * 4, 16]), each sample's token's heads a
    # segment, split back into [batch, seq, heads, head_dim]: the heads dim, at every batch size
    assert place([64, 16], [2, 8, 4, 16], 0, (4,) * 16) == (2, None)
    assert place([32, 16], [1, 8, 4, 16], 0, (4,) * 8) == (2, None)
    assert place([64, 16], [2, 8, 64], 0, (4,) * 16) == (2, None)  # ... or into [batch, seq, heads * head_dim]
    assert place([64, 16], [1024], 0, (4,) * 16) == (0, (64,) * 16)  # flattened: 16 segments of 4 heads x 16
    # heads * head_dim split into rows of one head (OLMo hybrid's gate before its gated norm): each token's heads
    # are a segment of the rows
    assert place([2, 8, 64], [64, 16], 2) == (0, (4,) * 16)
    assert place([2, 8, 64], [16, 64], 2) == (1, None)
    assert place([2, 8, 24], [48, 8], 2) is None  # 3 heads of 8 in each token: 2 ranks would cut one in two
    # fairseq's and torchscale's time-major merge back, [seq, batch * heads, d] -> [seq, batch, heads * d]: at a
    # batch of one the dim of 1 before the shard is the batch, not a head of one (it was read as one, and kept
    # torchscale's attention whole at a microbatch of one); the shard merged with the features keeps whole heads
    assert place([8, 4, 16], [8, 1, 64], 1) == (2, None)
    assert place([8, 8, 16], [8, 2, 64], 1, (4, 4)) == (2, None)
    assert place([2, 8, 16], [2, 8, 1, 8, 2], 2) is None  # one head's features split in pairs: still a head of one


# ---- sequence parallelism

def test_sequence_parallel_plan_scatters_rows_gathers_columns_and_sends_shards():
    # tp_llama (batch 8, sequence 16) at pp2 x tp2: each row-wise output and the vocabulary lookup are
    # reduce-scattered over the sequence, each column-parallel region begins with an all-gather of it, and the
    # value crossing the pipeline boundary is the sequence shard: [4, 8, 32] per rank instead of [4, 16, 32]
    manifest = check_model(model_path("tp_llama"), num_microbatches=2,
                           layout=Layout(pp=2, tp=2, sequence_parallel=True))
    assert manifest["plan"]["mesh"]["sequence_parallel"] is True
    assert manifest["tp"]["sequence_parallel"] == {"sequence": "16", "sent": {"layers_1_out": 1}}
    assert manifest["values"]["layers_1_out"]["shape"] == [4, 8, 32]
    ops = [[c["op"] for c in stage["collectives"]] for stage in manifest["tp"]["stages"]]
    # stage 0: the embedding and 2 layers x (o_proj, down_proj); stage 1: 2 layers
    assert ops[0].count("reduce_scatter") == 1 + 2 * 2 and ops[1].count("reduce_scatter") == 2 * 2
    # per layer: the attention and the MLP regions; stage 1 also the head's
    assert ops[0].count("all_gather (sequence)") == 2 * 2 and ops[1].count("all_gather (sequence)") == 2 * 2 + 1
    assert "all_reduce" not in ops[0] + ops[1]  # no forward all-reduce left
    assert not any(stage["replicated"] for stage in manifest["tp"]["stages"])


def test_sequence_parallel_refuses_what_it_cannot_split():
    with pytest.raises(ValueError, match="--sequence-parallel splits the activations between tensor-parallel "
                                         "regions over the tp ranks: use it with --tp T"):
        check_model(model_path("tp_llama"), layout=Layout(pp=2, sequence_parallel=True))
    with pytest.raises(ValueError, match=r"the traced sequence length 16 does not split into 3 equal shards; use a "
                                         r"sequence length that 3 divides, or --tp in \[2, 4, 8, 16\]"):
        check_model(model_path("tp_llama"), layout=Layout(pp=2, tp=3, sequence_parallel=True))


# ---- the tuner's figures (split.tensor_parallel.segment_figures)

from tracepp.tuner_figures import segments_with_figures  # noqa: E402

_MLP_LM = '''
import torch
import torch.nn as nn
import torch.nn.functional as F

B, S, D, H, V = 4, 8, 16, 32, 64


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(D, H)
        self.down = nn.Linear(H, D)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(D, V, bias=False)

    def forward(self, idx):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def model():
    torch.manual_seed(0)
    return Net()


def example_inputs():
    return (torch.randint(0, V, (B, S)),)


def example_target():
    return torch.randint(0, V, (B, S))


def loss_fn(logits, target):
    return F.cross_entropy(logits.reshape(-1, V), target.reshape(-1))
'''


def test_segment_figures_count_the_activations_tp_and_sequence_parallelism_shard(tmp_path):
    # a hand count on a model small enough to count: per block (microbatch b = 2 of the batch of 4, sequence
    # S = 8, width D = 16, hidden H = 32, fp32) the values that carry a gradient are up (b S H), relu (b S H),
    # down (b S D) and the residual add (b S D). tp shards up and relu; sequence parallelism adds down's output
    # (reduce-scattered over the sequence) and the add, whose sequence shard the next column-parallel region
    # (the next block's up, or the head) all-gathers: its linear keeps the shard and gathers again in backward
    path = tmp_path / "mlp_lm.py"
    path.write_text(_MLP_LM)
    table = segments_with_figures(str(path), num_microbatches=2, split_points=["blocks.1"])
    b, S, D, H, V = 2, 8, 16, 32, 64
    hidden, width = b * S * H * 4, b * S * D * 4
    segments = {seg["begins"]: seg for seg in table}
    assert set(segments) == {None, "blocks.0", "blocks.1", "head"}
    for name in ("blocks.0", "blocks.1"):
        seg = segments[name]
        assert seg["activation_bytes"] == 2 * hidden + 2 * width
        for tp in ("2", "4", "8"):
            figures = seg["tp"][tp]
            assert figures["sharded_activation_bytes"] == 2 * hidden
            assert figures["all_reduce"] == [1, width]  # down's partial sums
            assert figures["all_reduce_backward"] == [1, width]  # the gradient of up's (whole) input
            sp = figures["sequence_parallel"]
            assert sp["sharded_activation_bytes"] == 2 * hidden and sp["sequence_activation_bytes"] == 2 * width
            assert sp["all_reduce"] == [0, 0] and sp["all_reduce_backward"] == [0, 0]
            assert sp["reduce_scatter"] == [1, width] and sp["all_gather_sequence"] == [1, width]
    assert segments["blocks.1"]["cut_bytes"] == width  # the residual stream, sent as a sequence shard
    assert segments["blocks.1"]["tp"]["2"]["sequence_parallel"]["cut_sequence_bytes"] == width
    assert segments["blocks.1"]["tp"]["2"]["sequence_parallel"]["cut_sequence_grad_bytes"] == width
    # the vocabulary-parallel embedding: its lookup reduce-scattered; its output (a sequence shard) is gathered
    # by blocks.0's up, which keeps the shard
    embed = segments[None]["tp"]["2"]
    assert embed["all_reduce"] == [1, width] and embed["sequence_parallel"]["reduce_scatter"] == [1, width]
    assert embed["sequence_parallel"]["sequence_activation_bytes"] == width
    # the head: its logits computed on vocabulary shards, its input all-gathered over the sequence
    head = segments["head"]["tp"]["2"]
    assert head["sharded_activation_bytes"] == b * S * V * 4
    assert head["sequence_parallel"]["all_gather_sequence"] == [1, width]


@pytest.mark.parametrize("model", ["tp_split_value", "tp_gemma_mqa_fused"])
def test_segment_figures_count_the_gathers_a_plan_runs_backward(model):
    # a whole value read at each rank's piece has its gradient pieces all-gathered backward (ZAYA's split value
    # heads, a norm's weight beside the MLP's sharded features): the plan lists them and prices them
    # (split.plan_cost), and the tuner's figures counted none of them
    import math

    import torch

    manifest = check_model(model_path(model), num_microbatches=2, layout=Layout(pp=1, tp=2), verify="off")
    listed = [c for stage in manifest["tp"]["stages"] for c in stage["collectives"] if c["op"] == "all_gather (backward)"]
    expected = [len(listed), sum(math.prod(int(d) for d in c["shape"]) * getattr(torch, c["dtype"]).itemsize
                                 for c in listed)]
    assert expected[0] > 0
    counted = [0, 0]
    for seg in segments_with_figures(model_path(model), tp_sizes=(2,), num_microbatches=2, layout=Layout(pp=1)):
        count, size = seg["tp"]["2"]["all_gather_backward"]
        counted = [counted[0] + count, counted[1] + size]
    assert counted == expected, (counted, expected, listed)


def test_a_sequence_tp_does_not_divide_records_no_sequence_parallel_figures(tmp_path):
    # sequence 8: tp 2, 4 and 8 divide it; a sequence of 6 only tp 2 (the tuner prices no sequence parallelism
    # at 4 or 8)
    path = tmp_path / "mlp_lm.py"
    path.write_text(_MLP_LM.replace("B, S, D, H, V = 4, 8,", "B, S, D, H, V = 4, 6,"))
    for seg in segments_with_figures(str(path), num_microbatches=2, split_points=["blocks.1"]):
        assert "sequence_parallel" in seg["tp"]["2"]
        assert "sequence_parallel" not in seg["tp"]["4"] and "sequence_parallel" not in seg["tp"]["8"]


def test_sequence_parallel_still_replicates_what_is_needed_whole(monkeypatch):
    # the walk joins regions through tensor-parallel shards only: a router (logits needed whole by its softmax)
    # stays replicated under --sequence-parallel, and so do key/value heads fewer than tp (the queries shard)
    monkeypatch.setenv("TP_HF_FAMILY", "mixtral")
    manifest = check_model(os.path.join(ZOO, "tp_hf.py"), num_microbatches=2,
                           layout=Layout(pp=2, tp=2, sequence_parallel=True))
    assert manifest["tp"]["params"]["model.layers.0.mlp.gate.weight"]["dim"] is None
    manifest = check_model(model_path("tp_llama"), num_microbatches=2, layout=Layout(pp=2, tp=4, sequence_parallel=True))
    roles = {n: manifest["tp"]["params"][f"layers.0.attn.{n}_proj.weight"]["role"] for n in "qkvo"}
    assert roles == {"q": "colwise", "k": "replicate", "v": "replicate", "o": "rowwise"}


def test_torch_rules_place_the_ops_the_walk_has_no_rule_for():
    # DTensor's sharding propagator, asked with placements only (no process group): a stack of heads keeps
    # them sharded, a sum over the sharded dim is a partial sum, a scan along it has no answer without a gather
    import torch
    import torch.fx as fx

    from tracepp.split import torch_rules

    aten = torch.ops.aten
    g = fx.Graph()
    a, b = g.placeholder("a"), g.placeholder("b")
    a.meta["val"] = b.meta["val"] = torch.empty(2, 4, 8, 8)

    def node(target, args, shape):
        out = g.call_function(target, args)
        out.meta["val"] = torch.empty(shape)
        return out

    stacked = torch_rules.ask(node(aten.stack.default, ([a, b], -1), (2, 4, 8, 8, 2)), {a: 1, b: 1}, 2,
                              lambda arg: False)
    assert stacked.out == 1 and not stacked.partial and not stacked.scatter
    summed = torch_rules.ask(node(aten.sum.dim_IntList, (a, [1]), (2, 8, 8)), {a: 1}, 2, lambda arg: False)
    assert summed.partial
    assert torch_rules.ask(node(aten.cumsum.default, (a, 1), (2, 4, 8, 8)), {a: 1}, 2, lambda arg: False) is None
    # a whole operand without a gradient beside the sharded one is read at its piece
    added = torch_rules.ask(node(aten.atan2.default, (a, b), (2, 4, 8, 8)), {a: 1}, 2, lambda arg: arg is b)
    assert added.out == 1 and added.scatter == {b: 1}
    assert torch_rules.ask(node(aten.atan2.default, (a, b), (2, 4, 8, 8)), {a: 1}, 2, lambda arg: False) is None


def test_torch_rules_answer_each_question_once(monkeypatch):
    """Issue 56: a model's layers ask torch the same questions (DeepSeek-V3 at tp 8: 651 asks, 5 s of its 16 s tp
    plan). An answer is remembered by the op, its arguments' shapes, strides, dtypes and placements and whether
    each whole input may be read at its piece, and mapped onto the nodes of the next asker; any difference asks
    again."""
    import torch
    import torch.fx as fx

    from tracepp.split import torch_rules

    aten = torch.ops.aten
    asked = []
    original = torch_rules._ask
    monkeypatch.setattr(torch_rules, "_ask", lambda *args: asked.append(args[0]) or original(*args))
    monkeypatch.setattr(torch_rules, "_ANSWERS", {})
    g = fx.Graph()

    def value(name, shape):
        out = g.placeholder(name)
        out.meta["val"] = torch.empty(shape)
        return out

    def atan2(x, y):
        out = g.call_function(aten.atan2.default, (x, y))
        out.meta["val"] = torch.empty(2, 4, 8, 8)
        return out

    a, b, c, d = (value(name, (2, 4, 8, 8)) for name in "abcd")
    first = torch_rules.ask(atan2(a, b), {a: 1}, 2, lambda arg: arg is b)
    second = torch_rules.ask(atan2(c, d), {c: 1}, 2, lambda arg: arg is d)  # another layer's: the same question
    assert (first.out, first.scatter) == (1, {b: 1}) and (second.out, second.scatter) == (1, {d: 1})
    assert len(asked) == 1
    assert torch_rules.ask(atan2(c, d), {c: 1}, 2, lambda arg: False) is None  # may not scatter: asked again
    assert torch_rules.ask(atan2(c, d), {c: 2}, 2, lambda arg: arg is d).out == 2  # another placement: again
    assert torch_rules.ask(atan2(c, d), {c: 1}, 4, lambda arg: arg is d).scatter == {d: 1}  # another tp: again
    assert len(asked) == 4


@pytest.mark.parametrize("family,share,sharded,why", [
    ("bloom", 0.99, ["self_attention.query_key_value.weight", "self_attention.dense.weight"], None),  # ALiBi
    ("cohere", 0.99, ["self_attn.q_proj.weight", "self_attn.o_proj.weight"], None),  # interleaved rotary: stack
    ("stablelm", 0.99, ["self_attn.q_proj.weight", "self_attn.o_proj.weight"], None),  # per-head norms
    ("gpt_bigcode", 0.84, ["attn.c_proj.weight"], ("attn.c_attn.weight", "(key/value heads fewer than --tp)")),
    ("doge", 0.99, ["self_attn.q_proj.weight", "self_attn.dt_proj.weight", "self_attn.o_proj.weight"], None),
    ("gemma4_text", 0.99, ["per_layer_input_gate.weight", "per_layer_projection.weight"], None),
    ("falcon_mamba", 0.99, ["mixer.in_proj.weight", "mixer.dt_proj.weight", "mixer.out_proj.weight", "mixer.A_log",
                            "mixer.D", "mixer.conv1d.weight"], None),
    ("llama4_text", 0.99, ["feed_forward.experts.gate_up_proj", "feed_forward.experts.down_proj"], None),
    ("mamba2", 0.99, ["mixer.in_proj.weight", "mixer.conv1d.weight", "mixer.norm.weight", "mixer.out_proj.weight"],
     None),
    ("falcon_h1", 0.99, ["mamba.in_proj.weight", "mamba.conv1d.weight", "mamba.out_proj.weight"], None)])
def test_families_written_their_own_way_shard_their_attention(monkeypatch, family, share, sharded, why):
    # issue 47: heads read by baddbmm over [batch * heads] with a whole ALiBi table (Bloom), rotary interleaved by
    # a stack of head-local slices (Cohere), per-head LayerNorms of a ModuleList over heads split one by one
    # (StableLM), a multi-query fused c_attn whose key/value part stays whole (GPTBigCode), a mask per head computed
    # from the values and carrying a gradient (Doge), a per-layer input gating a projection (Gemma 4), Mamba's mixer:
    # a depthwise causal conv over sharded channels and dt_proj.weight @ dt, A_log, D and the conv's weight held
    # as pieces (Falcon-Mamba), experts computed on
    # every token by bmm with 3-D weights [experts, in, out] (Llama 4): each expert column- then row-wise; Mamba-2's
    # mixer with one group, its B and C gathered for every head, its norm over one group of every head's features
    # (Mamba2; Falcon-H1's muP multipliers over in_proj's parts read at each part's piece)
    import sys

    sys.path.insert(0, REPO)
    sys.path.insert(0, ZOO)
    import hf_family
    from benchmarks.studies.families import layer_shares

    monkeypatch.setenv("HF_FAMILY", family)
    manifest = check_model(os.path.join(ZOO, "hf_family.py"), num_microbatches=4, layout=Layout(pp=2, tp=2))
    shares = layer_shares(manifest, hf_family.model_class(family)(hf_family.config(family)))
    assert min(shares.values()) >= share, (shares, manifest["tp"]["stages"][0]["replicated"])
    params = manifest["tp"]["params"]
    layer = next(fqn for fqn in params if ".0." in fqn).split(".0.")[0] + ".0."
    for name in sharded:
        assert params[layer + name]["dim"] is not None, (name, params[layer + name])
    if why is not None:
        assert why[1] in params[layer + why[0]]["why"]



def test_a_new_tensor_made_from_a_shard_reads_only_its_dtype():
    # x.new_zeros(sizes) of sharded x with other sizes than a piece of it (Mamba's scan state made from A, of
    # another rank: transformers 5.25's Falcon-Mamba) is a whole new tensor: A was gathered for it, so A_log, read
    # whole there, was replicated
    manifest = check_model(model_path("tp_mamba_fresh_state"), num_microbatches=2, layout=Layout(pp=1, tp=2),
                           verify="off")
    params = manifest["tp"]["params"]
    for name in ("A_log", "D", "in_proj.weight", "dt_proj.weight", "conv1d.weight"):
        assert params[f"blocks.0.{name}"]["dim"] == 0, (name, params[f"blocks.0.{name}"])
    # held whole, each rank's gradient of A_log was a part of it, all-reduced once per step
    assert not any("a_log" in c["after"] for stage in manifest["tp"]["stages"] for c in stage["collectives"])


def test_sequence_parallel_backward_gathers_a_regions_input_once(monkeypatch):
    # q, k and v (or gate and up) each save the all-gathered input of their region: backward keeps its shard and
    # gathers it again once for all of them, not once per linear (the gather stands in: 2 ranks faked)
    import torch

    from tracepp.runtime import tensor_parallel as tp

    gathers = []

    def gather(tensor, dim, groups=1):
        gathers.append(tuple(tensor.shape))
        return torch.cat([tensor, tensor], dim=dim)

    monkeypatch.setattr(tp, "_gather", gather)
    monkeypatch.setitem(tp._STATE, "size", 2)
    monkeypatch.setitem(tp._STATE, "rank", 0)
    shard = torch.randn(2, 3, 8)  # no gradient: its backward (a reduce-scatter) is not this test's
    weights = [torch.randn(4, 8, requires_grad=True) for _ in range(3)]
    with tp.shards_kept_for_backward():
        whole = torch.ops.tracepp.sp_all_gather.default(shard, 1, 1)
        out = sum(torch.nn.functional.linear(whole, w).sum() for w in weights)
    assert len(gathers) == 1  # the forward's
    out.backward()
    assert len(gathers) == 2, gathers  # one more for the three weight gradients, not three
    expected = torch.cat([shard, shard], dim=1).sum(dim=(0, 1)).expand(4, 8)
    assert all(torch.allclose(w.grad, expected) for w in weights)


def test_mla_gathers_its_down_projections_and_shards_the_heads_they_make(monkeypatch):
    # issue 47: DeepSeek-V3's attention as transformers writes it: q_a_proj -> norm -> q_b_proj and
    # kv_a_proj_with_mqa -> norm -> kv_b_proj are low-rank pairs. Sharded as column/row pairs, their wide outputs
    # come back whole and the attention runs whole. Megatron-Core keeps the down-projections whole so that the
    # up-projections shard the heads they make; here they are column-wise with their narrow output (the latent)
    # all-gathered, so each rank holds half of them and the up-projections still shard the heads. The keys' two
    # parts are written with copy_ into a new_empty buffer: allocated on this rank's heads, the shared rotary key
    # expanded to them.
    import sys

    sys.path.insert(0, ZOO)
    monkeypatch.setenv("HF_FAMILY", "deepseek_v3")
    # At the zoo's tiny dims (hidden 64) Megatron-Core's plan (both down-projections whole) is over the budget of
    # parameters a cheaper plan may hold whole (tp_settle.within_budget: 5% of a layer, routed experts apart), so both
    # latents are gathered (tests/models/tp_mla_wide_mlp.py: at real-size proportions, Megatron-Core's plan)
    manifest = check_model(os.path.join(ZOO, "hf_family.py"), num_microbatches=4, layout=Layout(pp=2, tp=2))
    params = manifest["tp"]["params"]
    for layer in (0, 1):
        prefix = f"model.layers.{layer}.self_attn."
        for name in ("q_a_proj", "kv_a_proj_with_mqa"):
            entry = params[prefix + name + ".weight"]
            assert entry["role"] == "colwise" and "low-rank down-projection" in entry["why"], entry
            assert "all-gathered" in entry["why"], entry
        for name in ("q_b_proj", "kv_b_proj"):
            assert params[prefix + name + ".weight"]["role"] == "colwise"
        assert params[prefix + "o_proj.weight"]["role"] == "rowwise"
    assert params["model.layers.1.mlp.shared_experts.down_proj.weight"]["role"] == "rowwise"  # a narrow MLP: a pair
    assert not any(stage["replicated"] for stage in manifest["tp"]["stages"]), manifest["tp"]["stages"]
    gathered = [c["shape"][-1] for c in manifest["tp"]["stages"][0]["collectives"] if c["op"] == "all_gather"]
    assert gathered == ["32", "24"], gathered  # stage 0 (layer 0): the q and kv latents, one all-gather each


def test_mla_down_projections_whole_where_they_are_a_small_share_megatrons_plan():
    # issue 57: at real size (an MLP far wider than the latents) Megatron-Core's MLA plan costs less: the
    # down-projections whole on every rank (1.9% of a layer's parameters here), the up-projections column-wise on
    # the heads, backward all-reducing the two latents' gradients where the gathered plan all-gathers the latents
    # forward and all-reduces the layer input's gradient backward. Chosen by price (split/plan_cost.py), verified
    manifest = check_model(model_path("tp_mla_wide_mlp"), num_microbatches=2, layout=Layout(pp=2, tp=2))
    params = manifest["tp"]["params"]
    for layer in range(2):
        attn = f"layers.{layer}.self_attn."
        for down, up in (("q_a_proj", "q_b_proj"), ("kv_a_proj_with_mqa", "kv_b_proj")):
            entry = params[attn + down + ".weight"]
            assert entry["role"] == "replicate" and "Megatron-Core's MLA plan" in entry["why"], entry
            assert f"{attn}{up}.weight shards the heads" in entry["why"], entry
            assert params[attn + up + ".weight"] == {"dim": 0, "role": "colwise"}
        assert params[attn + "o_proj.weight"] == {"dim": 1, "role": "rowwise"}
    stages = manifest["tp"]["stages"]
    assert all(0.95 <= stage["share"]["params"] < 0.99 for stage in stages), stages
    assert not any(c["op"] == "all_gather" and c["shape"][-1] in ("16", "24") for s in stages for c in s["collectives"])
    latents = [c["shape"] for c in stages[0]["collectives"] if c["op"] == "all_reduce (backward)"]
    # the two latents, the shared rotary key (expanded to this rank's heads: one head's gradient, not every head's
    # gathered back), the MLP input
    assert sorted(latents) == sorted([["2", "8", "16"], ["2", "8", "16"], ["2", "1", "8", "8"], ["2", "8", "64"]]), \
        latents
    layers = [figures for stage in stages for figures in stage["layers"].values()]
    assert layers and all(megatron is not None and moved <= megatron for moved, megatron in layers), layers
    assert manifest["tp"]["verified"]["status"] == "verified", manifest["tp"]["verified"]


def test_sparse_attention_indexer_keeps_every_layers_attention_sharded_by_heads(monkeypatch):
    # DeepSeek-V3.2: the query latent is also read by the indexer's wq_b (as wide as the latent in the tiny config)
    # whose heads' scores are summed over the heads. Its low-rank pair used to be refused in layer 0 (q_b row-wise,
    # the attention whole, o_proj column-wise) and the residual stream stayed sharded in every later layer, up to
    # the router that needs it whole
    import sys

    sys.path.insert(0, ZOO)
    monkeypatch.setenv("HF_FAMILY", "deepseek_v32")
    manifest = check_model(os.path.join(ZOO, "hf_family.py"), num_microbatches=4, layout=Layout(pp=2, tp=2))
    params = manifest["tp"]["params"]
    for layer in range(4):
        prefix = f"model.layers.{layer}."
        roles = [params[prefix + "self_attn." + name + ".weight"]["role"]
                 for name in ("q_a_proj", "q_b_proj", "indexer.wq_b", "kv_b_proj", "o_proj")]
        assert roles == ["colwise", "colwise", "colwise", "colwise", "rowwise"], (layer, roles)
        assert params[prefix + "input_layernorm.weight"]["dim"] is None  # the residual stream whole


def test_per_head_weights_of_a_batched_matmul_shard_with_their_heads(monkeypatch):
    # RecurrentGemma's recurrent gates: baddbmm(bias[:, None, :], x [heads, tokens, width], W [heads, width,
    # width]) per head, on the heads of its column-parallel linear_x: each rank holds its heads' gate weights
    # (dim 0) and reads its heads' biases
    import sys

    sys.path.insert(0, ZOO)
    monkeypatch.setenv("HF_FAMILY", "recurrent_gemma")
    manifest = check_model(os.path.join(ZOO, "hf_family.py"), num_microbatches=2, layout=Layout(pp=2, tp=2))
    params = manifest["tp"]["params"]
    prefix = "model.layers.0.temporal_block."
    assert params[prefix + "linear_x.weight"]["role"] == "colwise"
    for gate in ("input_gate_weight", "recurrent_gate_weight"):
        assert params[prefix + "rg_lru." + gate]["dim"] == 0, params[prefix + "rg_lru." + gate]
    assert not any("baddbmm" in reason for stage in manifest["tp"]["stages"] for reason in stage["replicated"])


@pytest.mark.parametrize("microbatches", [4, 2])  # microbatch sizes 1 and 2
def test_keys_tiled_to_the_query_heads_shard_the_query_heads_that_read_them(microbatches):
    # x-transformers' grouped-query attention: key/value heads tiled by einops' repeat('b kvh n d -> b (r kvh) n d'),
    # so query head i reads key/value head i % 2. Each rank holds one key/value head and the query heads that read
    # it ({r, r + 2}: to_q's output features in two segments, a piece of each), through the interleaved rotary's
    # stack; the key/value projections were whole (0.906 of each stage), every query head reading every key
    path = model_path("tp_tiled_kv_einsum")
    manifest = check_model(path, num_microbatches=microbatches, layout=Layout(pp=2, tp=2))
    params = manifest["tp"]["params"]
    for layer in range(2):
        attn = f"transformer.h.{layer}.attn."
        assert params[attn + "to_q.weight"] == {"dim": 0, "role": "colwise", "segments": [32, 32]}
        assert params[attn + "to_k.weight"] == params[attn + "to_v.weight"] == {"dim": 0, "role": "colwise"}
        assert params[attn + "to_out.weight"] == {"dim": 1, "role": "rowwise", "segments": [32, 32]}
    assert all(stage["share"]["params"] >= 0.99 for stage in manifest["tp"]["stages"]), manifest["tp"]["stages"]
    assert manifest["tp"]["verified"]["status"] == "verified", manifest["tp"]["verified"]
    # Megatron's bytes: an all-reduce of [b, s, h] after the attention and one after the MLP, forward and backward
    layers = [figures for stage in manifest["tp"]["stages"] for figures in stage["layers"].values()]
    assert layers and all(megatron is not None and moved <= megatron for moved, megatron in layers), layers


def test_a_narrow_gate_on_the_residual_stream_is_kept_whole_where_it_is_a_small_share():
    # issue 57 (Gemma 4's per-layer input gate, 64 -> 4 -> 64 on the residual stream): sharded as a column/row pair it
    # all-reduced its output forward and its input's gradient backward, as much as an MLP (1.5x Megatron's bytes a
    # layer); whole on every rank (0.4% of a layer's parameters) the layer moves Megatron's bytes. Chosen by price.
    # Layer 0's attention is narrower than the hidden size (a pair's shapes, as Gemma 4's sliding-window layers):
    # every kind at once is over budget there (its attention whole), within it in layer 1, whose gate is kept
    # first; layer 0's gate used to be skipped then (a kind partly kept was not tried for its other layers)
    manifest = check_model(model_path("tp_per_layer_gate"), num_microbatches=2, layout=Layout(pp=2, tp=2))
    params = manifest["tp"]["params"]
    for layer in range(2):
        for name in ("per_layer_input_gate", "per_layer_projection"):
            entry = params[f"layers.{layer}.{name}.weight"]
            assert entry["role"] == "replicate" and "a low-rank pair kept whole" in entry["why"], entry
        assert params[f"layers.{layer}.o_proj.weight"] == {"dim": 1, "role": "rowwise"}
    stages = manifest["tp"]["stages"]
    layers = [figures for stage in stages for figures in stage["layers"].values()]
    assert layers and all(moved == megatron for moved, megatron in layers), layers
    assert all(stage["share"]["params"] >= 0.99 for stage in stages), stages
    assert manifest["tp"]["verified"]["status"] == "verified", manifest["tp"]["verified"]


def test_mla_down_projection_whose_latent_a_norm_needs_whole_is_gathered():
    # torchtitan's MLA: kv_norm is nn.RMSNorm (F.rms_norm, one op), which needs the latent whole, so the walk's first
    # plan kept wkv_a whole and never saw a low-rank pair (transformers' DeepSeek-V3 writes its norm as a mean of
    # squares: partial sums, a row-wise kv_b_proj, a pair). A whole narrowing linear whose latent reaches a
    # column-wise widening one is tried gathered as the pairs are: wkv_a column-wise, its latent all-gathered
    manifest, params = _params(model_path("tp_mla_rms_norm"))
    for layer in range(2):
        attn = f"layers.{layer}.attention."
        assert params[attn + "wkv_a.weight"]["role"] == "colwise" and "low-rank" in params[attn + "wkv_a.weight"]["why"]
        assert params[attn + "wkv_b.weight"] == params[attn + "wq.weight"] == {"dim": 0, "role": "colwise"}
        assert params[attn + "wo.weight"] == {"dim": 1, "role": "rowwise"}
    assert all(stage["share"]["params"] >= 0.99 for stage in manifest["tp"]["stages"]), manifest["tp"]["stages"]
    assert manifest["tp"]["verified"]["status"] == "verified", manifest["tp"]["verified"]
    gathers = [c for stage in manifest["tp"]["stages"] for c in stage["collectives"] if c["op"] == "all_gather"]
    assert [c["shape"][1:] for c in gathers if c["shape"][-1] == "40"] == [["8", "40"]] * 2  # a latent a layer


def test_differential_attention_shards_a_piece_of_each_half_of_the_heads():
    # DiffLlama (8 query heads over 4 key/value heads): its values chunked into two halves of the key/value heads,
    # each tiled back by repeat(1, 2, 1, 1), and its output chunked into two halves of the query heads, combined
    # head by head. The chunks ask the projections for segments through the view of heads (a head's features a
    # unit), repeat tiles a segment per copy, and the attention asks q/k/v for each other's segments: each rank
    # holds a piece of each half (q heads {0, 1, 4, 5} on rank 0), the plan is Megatron's (the attention was whole,
    # the residual stream sharded after o_proj: 2.0x)
    manifest = check_model(model_path("tp_diffllama"), num_microbatches=2, layout=Layout(pp=2, tp=2))
    params = manifest["tp"]["params"]
    for layer in range(2):
        attn = f"model.layers.{layer}.self_attn."
        assert params[attn + "q_proj.weight"] == {"dim": 0, "role": "colwise", "segments": [32, 32]}
        for name in ("k_proj", "v_proj"):
            assert params[attn + name + ".weight"] == {"dim": 0, "role": "colwise", "segments": [16, 16]}
        assert params[attn + "o_proj.weight"]["role"] == "rowwise"
    assert all(stage["share"]["params"] >= 0.99 for stage in manifest["tp"]["stages"]), manifest["tp"]["stages"]
    assert manifest["tp"]["verified"]["status"] == "verified", manifest["tp"]["verified"]
    # Megatron's bytes, and the all-reduce of the scalar lambda's gradient (2 x 4 bytes, ring-weighted)
    layers = [figures for stage in manifest["tp"]["stages"] for figures in stage["layers"].values()]
    assert layers and all(megatron is not None and moved <= megatron + 8 for moved, megatron in layers), layers


def test_a_heads_scores_over_sharded_features_are_computed_whole_where_their_all_reduce_moves_more(monkeypatch):
    # Karpathy's Head modules (tests/models/tp_karpathy_heads.py): each head's q @ k.T summed over its sharded
    # features, [b, t, t] all-reduced per head: 688 KiB a stage at a context of 64 where the heads' q and k are 8
    # wide. Gathered, then their projections computed whole: 176 KiB. At a context of 8 the all-reduce is cheaper
    # and kept
    for block, scores_reduced in (("64", False), ("8", True)):
        monkeypatch.setenv("BLOCK", block)
        manifest = check_model(model_path("tp_karpathy_heads"), num_microbatches=2, layout=Layout(pp=2, tp=2))
        assert manifest["tp"]["verified"]["status"] == "verified", manifest["tp"]["verified"]
        shapes = [entry["shape"] for stage in manifest["tp"]["stages"] for entry in stage["collectives"]]
        assert (["2", block, block] in shapes) == scores_reduced, (block, shapes)
        if not scores_reduced:
            params = manifest["tp"]["params"]
            assert params["blocks.0.sa.heads.0.query.weight"]["role"] == "replicate"
            assert params["blocks.0.sa.heads.0.value.weight"]["role"] == "colwise"
            assert all(stage["bytes"] <= 180 * 1024 for stage in manifest["tp"]["stages"]), manifest["tp"]["stages"]


def test_a_parameter_scaled_by_a_broadcast_one_is_held_as_the_pieces_it_is_read_at():
    # PEFT's AdaLoRA: x @ (lora_A * lora_E).T beside a row-parallel base, x sharded on its features. The product is
    # read at the rank's columns; lora_A was whole on every rank (read at its piece), and is now held as its columns,
    # lora_E ([r, 1], broadcast along them) whole: PEFT's LoraParallelLinear plan
    manifest = check_model(model_path("tp_adalora"), num_microbatches=2, layout=Layout(pp=2, tp=2))
    assert manifest["tp"]["verified"]["status"] == "verified", manifest["tp"]["verified"]
    params = manifest["tp"]["params"]
    for name in ("attn.to_out", "mlp.proj"):
        assert params[f"transformer.h.1.{name}.lora_A"]["dim"] == 1, params[f"transformer.h.1.{name}.lora_A"]
        assert params[f"transformer.h.1.{name}.lora_E"]["dim"] is None
        assert params[f"transformer.h.1.{name}.lora_B"]["dim"] is None
    assert params["transformer.h.0.attn.to_q.lora_B"]["role"] == "colwise"
