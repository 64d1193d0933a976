"""Context parallelism (issue 48), tiers 1 and 2: the layout and its ranks, the chunk order and the cp ops in one
process, the plan read from the graph (what is cut, gathered, made for this rank's positions, refused by name),
the RNG state in a checkpoint, and the tuner's price. Training runs are in ``tests/test_e2e_cp.py``."""
import math
import os
import random
import re

import pytest
import torch

from tracepp.driver import check_model
from tracepp.runtime import context_parallel as cp_ops
from tracepp.runtime.mesh import Layout, coordinates, cp_index, describe, ep_index, global_rank, tp_index
from util import model_path

ZOO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "zoo")


def test_the_layout_holds_cp_and_places_its_ranks_inside_pp_and_dp():
    layout = Layout(pp=2, dp=2, cp=2, tp=2)
    layout.check()
    assert layout.world_size == 16 and layout.to_json()["cp"] == 2
    assert Layout.from_json(layout.to_json(), 2) == layout
    seen = set()
    for dp in range(2):
        for pp in range(2):
            for cp in range(2):
                for tp in range(2):
                    rank = global_rank(layout, dp, pp, tp, cp)
                    seen.add(rank)
                    assert coordinates(layout, rank) == (dp, pp)
                    assert (cp_index(layout, rank), tp_index(layout, rank)) == (cp, tp)
    assert seen == set(range(16))
    # the cp x tp ranks of one (dp, pp) place are consecutive: rank = ((dp * pp + pp_rank) * cp + cp) * tp + tp
    assert global_rank(layout, 0, 1, 0, 1) == 6
    assert layout.data_parallel() == Layout(pp=2, dp=4, tp=2)  # FSDP's dim: dp x cp
    assert ep_index(Layout(pp=1, dp=1, cp=2, ep=2), 0, 1) == 1  # ep taken from dp x cp
    Layout(pp=1, dp=1, cp=2, ep=2).check()
    with pytest.raises(ValueError, match=r"--ep 4 takes .* --dp 1 x --cp 2 .* \[1, 2\]"):
        Layout(pp=1, dp=1, cp=2, ep=4).check()
    with pytest.raises(ValueError, match="--cp 0"):
        Layout(cp=0).check()
    text = " ".join(describe({"num_ranks": 2, "mesh": layout.to_json()}))
    assert "cp rank r holding chunks r and 3-r" in text and "fully_shard of each stage over dp x cp (4 ranks)" in text


def test_the_chunk_order_and_the_ops_in_one_process(monkeypatch):
    # rank r of cp holds chunks r and 2cp-1-r: cp 2, 8 positions: rank 0 [0, 1, 6, 7], rank 1 [2, 3, 4, 5]
    assert cp_ops.positions(8, 2, 0).tolist() == [0, 1, 6, 7] and cp_ops.positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert sorted(torch.cat([cp_ops.positions(16, 4, r) for r in range(4)]).tolist()) == list(range(16))
    whole = torch.arange(2 * 8 * 3, dtype=torch.float32).reshape(2, 8, 3).requires_grad_()
    pieces = []
    for rank in range(2):
        monkeypatch.setitem(cp_ops._STATE, "size", 2)
        monkeypatch.setitem(cp_ops._STATE, "rank", rank)
        piece = torch.ops.tracepp.cp_shard.default(whole, 1)
        assert torch.equal(piece, whole[:, cp_ops.positions(8, 2, rank)])
        assert torch.equal(torch.ops.tracepp.cp_positions.default(8), cp_ops.positions(8, 2, rank))
        # a [batch * seq] dim of 2 sequences: each sequence's two chunks, sequence after sequence
        flat = torch.ops.tracepp.cp_shard.default(whole.reshape(16, 3), 0, 2)
        assert torch.equal(flat, piece.reshape(8, 3))
        pieces.append(piece)
    # backward of a cut: the gradient at this rank's positions, zeros elsewhere; the ranks' parts sum to the whole
    sum(piece.sum() * (rank + 1) for rank, piece in enumerate(pieces)).backward()
    expected = torch.ones_like(whole)
    expected[:, cp_ops.positions(8, 2, 1)] = 2
    assert torch.equal(whole.grad, expected)
    # what the ranks' all-gather joins, in sequence order (the runtime's reorder, without a process group)
    joined = torch.empty(2, 8, 3)
    for rank, piece in enumerate(pieces):
        joined[:, cp_ops.positions(8, 2, rank)] = piece.detach()
    assert torch.equal(joined, whole.detach())
    with pytest.raises(RuntimeError, match="2 x cp = 4"):
        monkeypatch.setitem(cp_ops._STATE, "size", 2)
        torch.ops.tracepp.cp_shard.default(torch.zeros(2, 6), 1)


def test_the_plan_reads_the_graph():
    manifest = check_model(model_path("tp_llama"), schedule="1f1b", num_microbatches=2, layout=Layout(pp=2, cp=2))
    cp = manifest["cp"]
    assert cp["size"] == 2 and cp["sequence"] == "16"
    first = cp["stages"][0]
    assert "idx" in first["cut"] and first["positions"] >= 2  # token ids cut; rotary and causal positions made
    # keys and values gathered before repeat_interleave (the values up to their projection): the 2 key/value
    # heads of the whole sequence, 2 gathers per layer
    assert len(first["gathered"]) == 4 and {g["bytes"] for g in first["gathered"]} == {4 * 2 * 16 * 8 * 4}
    assert ["4", "2", "16", "8"] in [g["shape"] for g in first["gathered"]]
    assert first["kv_bytes"] == 4 * 4 * 2 * 16 * 8 * 4 and first["kv_received_bytes_per_rank"] == first["kv_bytes"] // 2
    assert cp["sent"] == {"layers_1_out": 1}
    assert manifest["values"]["layers_1_out"]["shape"] == [4, 8, 32]  # a shard crosses the boundary: 1/cp
    assert cp["loss"]["reductions"][0]["op"] == "cross_entropy_loss" and cp["loss"]["reductions"][0]["reduction"] == "mean"
    placements = manifest["placements"]["layers.0.attn.q_proj.weight"]
    assert placements["dp"] == "shard(0) over 2" and placements["per_rank"] == [16, 32]  # FSDP over dp x cp


@pytest.mark.parametrize("mode,message", [
    ("conv", r"\(conv1d\) at cp_refusals.py:\d+: a convolution along the sequence dim that is not causal as written"),
    ("gather", r"\(index.Tensor\) at cp_refusals.py:\d+: a gather of positions of the sequence"),
    ("chunkpad", r"\(pad\) at cp_refusals.py:\d+: pads the sequence dim by \(0, 3\) positions"),
    ("custom", r"\(running_mean\) at cp_refusals.py:\d+: tracepp_test::running_mean is a custom op "
               r"\(torch.library\) that reads sequence shards"),
    ("mask", r"the attention mask mask is an input of the model \(\[4, 1, 8, 8\]\).*pass a \[batch, seq\] padding "
             r"mask.*or use is_causal"),
])
def test_what_mixes_positions_is_refused_by_name_under_strict_verification(monkeypatch, mode, message):
    monkeypatch.setenv("CP_REFUSE", mode)
    with pytest.raises(ValueError, match=message):
        check_model(model_path("cp_refusals"), num_microbatches=1, layout=Layout(pp=1, cp=2), verify="strict")


@pytest.mark.parametrize("mode,op", [("conv", "conv1d"), ("gather", "index.Tensor"),
                                     ("chunkpad", "pad"), ("custom", "running_mean"),
                                     ("mask", "scaled_dot_product_attention")])
def test_what_no_rule_places_runs_on_the_whole_sequence_verified_and_named(monkeypatch, mode, op):
    """By default an op no cp rule places runs on the whole sequence at every cp rank (its shards all-gathered
    first, what it makes cut back where it meets a shard): the plan is verified against the unsharded stage, and
    the split names the op, its line and the bytes gathered for it."""
    monkeypatch.setenv("CP_REFUSE", mode)
    manifest = check_model(model_path("cp_refusals"), num_microbatches=1, layout=Layout(pp=1, cp=2))
    cp = manifest["cp"]
    assert cp["verified"]["status"] == "verified"
    (stage,) = cp["stages"]
    assert [w["op"] for w in stage["whole"]] == [op] and re.match(r"cp_refusals\.py:\d+", stage["whole"][0]["line"])
    assert stage["whole_bytes"] == (3 if mode == "mask" else 1) * 4 * 8 * 16 * 4  # [4, 8, 16] fp32 (mask: q, k, v)
    (note,) = [n for n in manifest["notes"] if "whole sequence" in n]
    assert f"{op} at cp_refusals.py:" in note and f"{stage['whole_bytes']:,} bytes per microbatch" in note


def test_a_sequence_that_does_not_cut_into_2cp_chunks_is_refused_at_split():
    with pytest.raises(ValueError, match=r"--cp 3: the traced sequence length 16 does not cut into 2 x cp = 6 "
                                         r"equal chunks.*--cp in \[2, 4, 8\]"):
        check_model(model_path("tp_llama"), num_microbatches=2, layout=Layout(pp=2, cp=3))


def test_the_rng_state_is_saved_as_tensors_and_plain_numbers(tmp_path):
    import torch.distributed.checkpoint as dcp

    from tracepp.runtime import checkpoint

    torch.manual_seed(7)
    random.seed(7)
    random.gauss(0, 1)  # a cached Gaussian in Python's state
    entries = checkpoint._rng_entries(3)
    assert all(isinstance(v, (torch.Tensor, int, float)) for v in entries.values())
    assert entries["rng.rank3.python"].dtype == torch.int64 and entries["rng.rank3.python"].numel() == 625
    dcp.save(dict(entries), checkpoint_id=str(tmp_path))
    expected = (torch.rand(3), random.random(), random.gauss(0, 1))
    loaded = {k: (torch.empty_like(v) if isinstance(v, torch.Tensor) else 0) for k, v in entries.items()}
    dcp.load(loaded, checkpoint_id=str(tmp_path))
    torch.manual_seed(0), random.seed(0)
    checkpoint._set_rng_state(loaded, "rng.rank3")
    again = (torch.rand(3), random.random(), random.gauss(0, 1))
    assert torch.equal(expected[0], again[0]) and expected[1:] == again[1:]
    assert not math.isnan(loaded["rng.rank3.python_gauss"])


def test_the_tuner_prices_cp():
    from test_calibration import _collective_calibration, _manifest
    from tracepp.costs.context_parallel import cp_costs, cp_messages
    from tracepp.costs.search import tune

    manifest = _manifest()
    for seg in manifest["segments"]:  # every FLOP and 800 of the 1000 activation bytes on sequence shards
        seg["cp"] = {"sequence": "16", "sharded_flops": seg["forward_flops"], "sequence_activation_bytes": 800,
                     "kv_gather": [2, 2e6], "sums": [0, 0], "cut_sequence_bytes": seg["cut_bytes"],
                     "cut_sequence_grad_bytes": seg["cut_grad_bytes"]}
    links = {"all_reduce": (0.0, 1e6), "all_gather": (0.0, 1e6)}
    costs = {(0, "F"): 10.0, (0, "B"): 20.0, (1, "F"): 10.0, (1, "B"): 20.0}
    priced = cp_costs(manifest, (0, 0, 1, 1), costs, 4, 2, links)
    # compute halved; 2 segments x 2 MB of whole keys and values all-gathered forward (one ring step: each rank
    # receives the other's half, 2 MB at 1 MB/s) and reduce-scattered backward
    assert priced[(0, "F")] == pytest.approx(5.0 + 2.0) and priced[(0, "B")] == pytest.approx(10.0 + 2.0)
    messages = {(0, 1, "F"): (1, 128.0), (0, 1, "B"): (1, 128.0)}
    assert cp_messages(manifest, (0, 0, 1, 1), messages, 4) == {(0, 1, "F"): (1, 32.0), (0, 1, "B"): (1, 32.0)}
    calibration = _collective_calibration(manifest, 1e6)
    kept, _dropped, _ = tune(manifest, calibration, schedules=["1f1b"], microbatch_counts=[4],
                             optimizer_bytes_per_param=0, cp_sizes=[1, 2, 4])
    peak = {c.cp: c.peak_memory[0] for c in kept}
    # rank 0: 2 segments of 4000 parameter bytes (FSDP over cp at cp > 1: whole weights and gradients held
    # through the step, plus 1/cp shard) + 2 microbatches in flight x 2 segments x the activations left per rank
    assert peak[1] == 16000 + 2 * 2 * 1000
    assert peak[2] == 2 * (4000 + 4000 + 4000 / 2) + 2 * 2 * (1000 - 800 / 2)
    assert peak[4] == 2 * (4000 + 4000 + 4000 / 4) + 2 * 2 * (1000 - 800 * 3 / 4)
    assert sorted(c.cp for c in kept) == [1, 2, 4] and all(c.to_json()["cp"] == c.cp for c in kept)
    with pytest.raises(ValueError, match=r"does not cut into 2 x cp chunks for cp in \[3\]; use cp in \[1, 2, 4, 8\]"):
        tune(manifest, calibration, schedules=["1f1b"], microbatch_counts=[4], cp_sizes=[1, 3])


def test_a_forward_only_model_returns_its_outputs_whole(tmp_path):
    # no loss_fn: the last stage's outputs are all-gathered over cp, so --save-outputs and eval see whole values
    source = open(model_path("tp_llama")).read()
    with open(tmp_path / "forward_llama.py", "w") as handle:
        handle.write(source.split("\ndef example_target")[0] + "\n\ndef batch(step):\n    return (_data(step)[0],), {}, None\n")
    manifest = check_model(str(tmp_path / "forward_llama.py"), num_microbatches=2, layout=Layout(pp=2, cp=2))
    assert not manifest["training"]
    last = manifest["cp"]["stages"][-1]
    assert [g["shape"] for g in last["gathered"]][-1] == ["4", "16", "64"]  # the logits, whole
    assert manifest["cp"]["outputs"] == [None]


def test_a_tied_weight_on_one_rank_is_refused_as_fsdp_wraps_over_cp():
    # zbv places stages 0 and 3 (the tied embedding and head) on rank 0; FSDP over dp x cp cannot hold it twice
    with pytest.raises(ValueError, match=r"--cp 2 \(FSDP/DDP over dp x cp\) with schedule 'zbv' puts stages 0 and 3"):
        check_model(model_path("tp_llama"), schedule="zbv", num_microbatches=4, layout=Layout(pp=2, cp=2))


CACHE_OUTPUT = '''
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils._pytree as pytree


class Cache:
    """A cache object in the output, as transformers' DynamicCache exported: rebuilding it from its leaves joins
    each to an empty tensor the rebuild makes (a constant torch.export lifts into an input)."""

    def __init__(self, keys):
        self.keys = keys


def _flatten(cache):
    return [cache.keys], None


def _unflatten(leaves, _context):
    return Cache(torch.cat([torch.tensor([], dtype=leaves[0].dtype, device=leaves[0].device), leaves[0].flatten()]))


pytree.register_pytree_node(Cache, _flatten, _unflatten)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.k, self.head = nn.Embedding(32, 16), nn.Linear(16, 16), nn.Linear(16, 32)

    def forward(self, ids):
        x = self.embed(ids)
        return self.head(x), Cache(self.k(x))


def model():
    torch.manual_seed(0)
    return Net()


def example_inputs():
    return torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(0))


def example_target():
    return torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(1))


def loss_fn(output, target):
    return F.cross_entropy(output[0].reshape(-1, 32), target.reshape(-1))
'''


def test_a_loss_whose_output_object_rebuilds_with_constants_is_traced(tmp_path):
    # PEFT's prefix tuning returns a DynamicCache; rebuilding it in the traced loss makes empty tensors torch.export
    # lifts into inputs before the output's leaves, and the loss's inputs were matched to the leaves one place off
    # ("loss_fn reads output leaf 0 as ... of 1 dims"). Unread, they are dropped, and the leaves line up
    path = tmp_path / "cache_output.py"
    path.write_text(CACHE_OUTPUT)
    manifest = check_model(str(path), num_microbatches=2, layout=Layout(pp=1, cp=2))
    assert manifest["cp"]["verified"]["status"] == "verified", manifest["cp"]["verified"]


def test_a_scan_written_as_a_loop_over_positions_runs_each_ranks_steps():
    """Mamba's slow path (``tests/models/cp_loop_scan.py``: the state passed from each position to the next in a
    Python loop, unrolled by the trace into a ``select`` per position) was refused under ``--cp``, then run on the
    whole sequence at every cp rank (its three inputs all-gathered per layer, 3 x 8 selects whole). Each rank now
    runs its own positions' steps, the state entering each of its chunks carried from the chunks before it
    (``cp_linear_scan``, split/cp_loop.py): nothing of the scan is gathered. Griffin's shifted window (a slice of the
    sequence, written into in place) still runs on the whole sequence; the attention layers stay on each rank's
    positions with their key/value gathers. Verified against the unsharded stages."""
    manifest = check_model(model_path("cp_loop_scan"), num_microbatches=2, layout=Layout(pp=2, cp=2))
    cp = manifest["cp"]
    assert cp["verified"]["status"] == "verified", cp["verified"]
    for index, stage in enumerate(cp["stages"]):
        assert [s["op"] for s in stage["scans"]] == ["a recurrence over 8 positions"], stage["scans"]
        assert [w["op"] for w in stage["whole"]] == (["slice.Tensor"] if index == 0 else []), stage["whole"]
        assert stage["whole_bytes"] == (2 * 8 * 16 * 4 if index == 0 else 0), stage["whole_bytes"]  # the window's
        assert stage["kv_bytes"] > 0  # the attention layer's keys and values: still this rank's positions
    assert cp["sent"]  # the residual stream crosses the pipeline cut as a shard


def test_a_running_product_along_the_sequence_is_each_chunks_times_the_chunks_before(monkeypatch):
    """``cumprod`` along the sequence (gateloop's gates, ``tests/models/cp_refusals.py``) was refused, then run on
    the whole sequence; each chunk's running products are now its own times the product of every chunk's before it
    (``cp_cumprod``: the chunks' totals all-gathered), verified at split."""
    monkeypatch.setenv("CP_REFUSE", "cumprod")
    manifest = check_model(model_path("cp_refusals"), num_microbatches=1, layout=Layout(pp=1, cp=2))
    (stage,) = manifest["cp"]["stages"]
    assert manifest["cp"]["verified"]["status"] == "verified", manifest["cp"]["verified"]
    assert [s["op"] for s in stage["scans"]] == ["cumprod"] and not stage["whole"]


def test_a_value_written_position_by_position_is_made_whole_where_it_is_created(monkeypatch):
    """RWKV's and recurrentgemma's CPU scans write ``output[:, i] = ...`` into a ``zeros_like`` of a shard, position
    by position. Run on the whole sequence, the ``select`` of position i read a gathered copy of ``output``, so the
    writes landed in the copy and ``output`` stayed zeros: verification caught it and repaired the plan (the two
    families read "repaired"), and under ``--verify off`` it would have trained wrong. The plan is now made again
    with ``zeros_like`` whole from the start: verified on the first try."""
    monkeypatch.setenv("CP_REFUSE", "written")
    manifest = check_model(model_path("cp_refusals"), num_microbatches=1, layout=Layout(pp=1, cp=2))
    (stage,) = manifest["cp"]["stages"]
    assert manifest["cp"]["verified"]["status"] == "verified", manifest["cp"]["verified"]
    assert "zeros_like" in {w["op"] for w in stage["whole"]}, stage["whole"]
