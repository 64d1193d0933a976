"""Every context-parallel plan is verified at split time (``split/verify_cp.py``): each stage's cp-rewritten program
and the rewritten loss run for every cp rank in this one process against the graphs before the rewrite, forward and
backward; with ``--tp`` too, tp's rewrite of the cp-rewritten stages runs for every (tp, cp) rank pair.

Correct plans verify (tp_llama, a model with complex rotary positions, ALiBi through ``baddbmm``, a transformers
Llama with padded targets, tp x cp with sequence parallelism); a wrong cp rule put into the rewrite (positions cut
as one contiguous chunk instead of chunks r and 2cp-1-r, a key all-gather left out) is refused naming the op and the
model's line, under ``--verify on`` and ``strict`` alike; ``--verify off`` records nothing.
"""
import os
import re

import pytest
import torch

from tracepp.driver import check_model
from tracepp.runtime import context_parallel as cp_runtime
from tracepp.runtime.mesh import Layout
from tracepp.split import context_parallel, cp_rewrite, tensor_parallel, tp_rewrite, verify
from tracepp.split import local_ranks
from util import REPO, model_path

pytestmark = pytest.mark.timeout(600)

LLAMA = model_path("tp_llama")


def _check(path, mode="on", pp=2, **layout):
    return check_model(path, schedule="1f1b", num_microbatches=2, layout=Layout(pp=pp, **layout), verify=mode)


def test_a_correct_cp_plan_verifies_and_inspect_prints_it():
    from tracepp.report.context_parallel import context_parallel_table

    manifest = _check(LLAMA, cp=2)
    record = manifest["cp"]["verified"]
    assert record["status"] == "verified", record
    assert record["ran"] == ["stage 0", "stage 1", "the loss"]
    assert "verification: verified: every stage's and the loss's cp ranks computed what the unsharded stage does" \
        in context_parallel_table(manifest)
    assert "verified" not in (manifest.get("tp") or {})


@pytest.mark.parametrize("name", ["cp_complex_rope", "cp_alibi_baddbmm", "cp_empty_cache", "cp_einsum_attention",
                                  "olmo_core_autocast"])
def test_cp_models_verify(name):
    record = _check(model_path(name), cp=2)["cp"]["verified"]
    assert record["status"] == "verified", record


@pytest.mark.parametrize("family,rule", [
    ("llama4_text", "repeat along the sequence: the tokens once per expert"),
    ("roformer", "reshape_as of a shard placed alike"),
    ("beam", "view_as of a shard placed alike"),
    ("phimoe", "concat, cat's other name"),
])
def test_transformers_families_refused_before_verify_at_cp2(monkeypatch, family, rule):
    """Each was refused ("mixes the positions of the sequence") at the op the rule now places."""
    monkeypatch.setenv("HF_FAMILY", family)
    record = _check(os.path.join(REPO, "tests", "zoo", "hf_family.py"), cp=2)["cp"]["verified"]
    assert record["status"] == "verified", (rule, record)


def test_a_transformers_llama_with_padded_targets_verifies_at_cp4(monkeypatch):
    monkeypatch.setenv("CP_HF_FAMILY", "llama")  # ignore_index padding spread unevenly over the ranks
    record = _check(os.path.join(REPO, "tests", "zoo", "cp_hf.py"), cp=4)["cp"]["verified"]
    assert record["status"] == "verified" and "the loss" in record["ran"], record


def test_tp_x_cp_is_verified_per_rank_pair():
    manifest = _check(LLAMA, cp=2, tp=2, sequence_parallel=True)
    assert manifest["cp"]["verified"]["status"] == "verified", manifest["cp"]["verified"]
    record = manifest["tp"]["verified"]
    assert record["status"] == "verified", record
    assert "every (tp, cp) rank pair" in record["scope"]


def test_a_tp_gather_off_by_one_under_cp_is_caught_and_repaired(monkeypatch):
    original = tp_rewrite._rewrite

    def rewrite(g, walk, tp, params):
        original(g, walk, tp, params)
        for node in g.nodes:
            if node.target is torch.ops.tracepp.tp_all_gather.default and node.args[1] > 0:
                node.args = (node.args[0], node.args[1] - 1) + tuple(node.args[2:])

    monkeypatch.setattr(tp_rewrite, "_rewrite", rewrite)
    with pytest.raises(ValueError, match=r"--tp 2: .*output head_out at cp rank 0 differs .*Fix: make head.weight "
                                         r"whole"):
        _check(LLAMA, mode="strict", cp=2, tp=2)
    record = _check(LLAMA, cp=2, tp=2)["tp"]["verified"]
    assert record["status"] == "repaired" and record["repairs"][0]["made_whole"] == ["head.weight"], record


def _positions_in_one_chunk(monkeypatch):
    """A rewrite that builds the rotary positions as one contiguous chunk of S/cp (0..7 on every rank) instead of
    the rank's chunks r and 2cp-1-r."""
    original = cp_rewrite._rewrite

    def rewrite(g, walk, cp):
        original(g, walk, cp)
        for node in g.nodes:
            if node.target is torch.ops.tracepp.cp_positions.default:
                node.target, node.args = torch.ops.aten.arange.default, (node.args[0] // cp,)
                break

    monkeypatch.setattr(cp_rewrite, "_rewrite", rewrite)


@pytest.mark.parametrize("mode", ["on", "strict"])
def test_positions_cut_at_the_wrong_chunk_are_refused_naming_the_op(monkeypatch, mode):
    _positions_in_one_chunk(monkeypatch)
    with pytest.raises(ValueError, match=r"--cp 2: the plan does not compute what the model does: stage 0: the value "
                                         r"of cp_positions_default_\d+ \(this rank's positions of arange\) .*"
                                         r"\(aten.arange.default at tp_llama.py:\d+\) differs"):
        _check(LLAMA, mode=mode, cp=2)


def test_verify_off_records_nothing(monkeypatch):
    _positions_in_one_chunk(monkeypatch)
    manifest = _check(LLAMA, mode="off", cp=2)
    assert "verified" not in manifest["cp"]


def test_a_key_gather_left_out_is_caught_and_repaired_naming_attention(monkeypatch):
    """An injected fault (the first key/value all-gather dropped from the rewrite): verification finds attention
    failing on the ranks' values, runs that op (every layer's copy: its op and line) on the whole sequence and
    verifies again; ``strict`` refuses naming it."""
    original = cp_rewrite._rewrite

    def rewrite(g, walk, cp):
        original(g, walk, cp)
        for node in g.nodes:
            if node.target is torch.ops.tracepp.cp_all_gather.default and not node.meta.get(cp_rewrite.WHOLE):
                node.replace_all_uses_with(node.args[0])
                g.erase_node(node)
                break

    monkeypatch.setattr(cp_rewrite, "_rewrite", rewrite)
    manifest = _check(LLAMA, cp=2)
    record = manifest["cp"]["verified"]
    assert record["status"] == "repaired", record
    (repair,) = record["repairs"]
    assert repair["op"] == "scaled_dot_product_attention" and re.fullmatch(r"tp_llama\.py:\d+", repair["at"])
    whole = [w["op"] for stage in manifest["cp"]["stages"] for w in stage["whole"]]
    assert whole == ["scaled_dot_product_attention"] * 4, whole  # 2 layers in each of 2 stages
    assert manifest["cp"]["stages"][0]["kv_bytes"] == 0 and manifest["cp"]["stages"][0]["whole_bytes"] > 0
    assert any("verification found stage 0: the value of scaled_dot_product_attention" in n
               and "now runs on the whole sequence" in n for n in manifest["notes"])
    with pytest.raises(ValueError, match=r"stage 0: the value of scaled_dot_product_attention "
                                         r"\(aten.scaled_dot_product_attention.default at tp_llama.py:\d+\) fails on "
                                         r"the ranks' values"):
        _check(LLAMA, "strict", cp=2)


def test_a_stage_too_big_to_run_is_not_verified(monkeypatch):
    monkeypatch.setattr(verify, "LIMIT", 100)
    manifest = _check(LLAMA, cp=2)
    record = manifest["cp"]["verified"]
    assert record["status"] == "not verified" and "more than the 0M run here" in record["why"], record
    assert any("--cp 2: the plan was not verified" in note for note in manifest["notes"])


def test_a_repeated_stage_runs_unsharded_only(monkeypatch):
    monkeypatch.setenv("CP_HF_LAYERS", "4")
    manifest = check_model(os.path.join(REPO, "tests", "zoo", "cp_hf.py"), schedule="interleaved-1f1b", num_stages=4,
                           split_points="auto", num_microbatches=2, layout=Layout(pp=2, cp=2))
    record = manifest["cp"]["verified"]
    assert record["status"] == "verified", record
    assert "stage 2 (the same graph as stage 1)" in record["ran"], record


def test_the_simulated_cp_ops_are_the_runtimes():
    """The verifier's cut is the runtime's ``cp_shard``, its join the inverse in the runtime's chunk order, and each
    simulated collective's backward the adjoint of its forward over the group (what the runtime's autograd is)."""
    x = torch.randn(2, 3 * 8, 4, dtype=torch.float64)
    for cp, groups in ((2, 1), (2, 3), (4, 1)):
        pieces = [local_ranks._cp_piece(x, 1, groups, cp, r) for r in range(cp)]
        assert torch.equal(local_ranks._cp_join(pieces, 1, groups), x)
        if groups == 1:
            for r in range(cp):
                want = x[:, cp_runtime.positions(24, cp, r)]
                assert torch.equal(pieces[r], want)
                with local_ranks._Ranks(1, 0, cp, r):
                    assert torch.equal(torch.ops.tracepp.cp_positions.default(24), cp_runtime.positions(24, cp, r))
    cp = 2
    ops = ((torch.ops.tracepp.cp_all_gather.default, [1, 1, 2, 2]), (torch.ops.tracepp.cp_reduce_scatter.default, [1]),
           (torch.ops.tracepp.cp_all_reduce.default, []))
    for target, args in ops:
        shape = [2, 8, 3] if target is not torch.ops.tracepp.cp_reduce_scatter.default else [2, 16, 3]
        xs = [torch.randn(shape, dtype=torch.float64, requires_grad=True) for _ in range(cp)]
        outs = local_ranks._cp_collective(target, xs, args, cp)
        seeds = [torch.randn_like(o) for o in outs]
        torch.autograd.backward(outs, seeds)
        forward = sum((o * s).sum() for o, s in zip(outs, seeds))
        adjoint = sum((x * x.grad).sum() for x in xs)
        assert torch.allclose(forward, adjoint), target
    gathered = local_ranks._cp_collective(ops[0][0], [local_ranks._cp_piece(x, 1, 1, 2, r) for r in range(2)], [1, 1, 2, 2], 2)
    assert torch.equal(gathered[1], x.repeat_interleave(2, dim=2))


def test_the_runtime_collectives_compute_what_verification_simulates(tmp_path):
    """Verification runs each rank's program with the collectives simulated (``local_ranks._cp_collective``,
    ``local_ranks._collective``); the runtime's ops (``runtime/context_parallel.py``, ``runtime/tensor_parallel.py``)
    are code of their own, autograd included. Each is run here for real on 2 gloo ranks, forward and backward, and set
    against the simulation on the same inputs: cp_amax's first backward lacked the sum of the ranks' gradients, which
    verification passed and only a training run caught."""
    import collectives_worker as worker
    from util import start_ranks

    result = start_ranks([os.path.join(os.path.dirname(__file__), "collectives_worker.py"), str(tmp_path)], 2,
                         dict(os.environ, OMP_NUM_THREADS="1"), timeout=120)
    assert result.returncode == 0, result.stderr[-4000:]
    ran = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for case, (name, args, shape) in enumerate(worker.CASES):
        made = [worker.inputs(case, r, shape) for r in range(2)]
        xs = [x.clone().requires_grad_(True) for x, _seed in made]
        simulate = local_ranks._cp_collective if name.startswith("cp_") else local_ranks._collective
        outs = simulate(getattr(torch.ops.tracepp, name).default, xs, args, 2)
        seeds = [torch.randn(o.shape, generator=seed, dtype=o.dtype) for o, (_x, seed) in zip(outs, made)]
        torch.autograd.backward(outs, seeds)
        for r in range(2):
            out, grad = ran[r][case]
            assert torch.allclose(out, outs[r].detach()), (name, args, "forward", r)
            assert torch.allclose(grad, xs[r].grad), (name, args, "backward", r, (grad - xs[r].grad).abs().max())


def test_the_last_stage_memory_is_counted_with_a_cast_in_the_loss():
    # the loss's .float() leaves export's check of the device it was traced on (meta) in the cp-rewritten loss graph:
    # a last stage counted on CPU fake tensors (its attention, sdpa) ran it and fell back to a bound ("memory not
    # counted on fake tensors (AssertionError: Tensor device mismatch! Expected: meta, Got: cpu)"), as every litgpt
    # and x-transformers model of the second families table did at --cp 2
    manifest = _check(model_path("cp_window_mask_rows"), cp=2)
    assert not [note for note in manifest["notes"] if "memory not counted" in note], manifest["notes"]
    assert not any(stage.get("bound") for stage in manifest["memory"]["stages"])


@pytest.mark.parametrize("kernel", ["3", "6"])
def test_a_causal_convolution_reads_the_positions_before_each_chunk(kernel, monkeypatch):
    """LFM2's short convolution and Primer EZ's depth-wise q/k/v convolutions (``conv1d(padding=k - 1)`` cut back to
    the sequence, ``[..., :seqlen]`` and ``[:, :, :-(k - 1)]``, or unpadded after ``F.pad(x, (k - 1, 0))``) and
    x-transformers' token shift (``F.pad(t, (0, 0, 1, -1))``) were refused by ``--cp`` ("a convolution along the
    sequence dim", "a pad over the sharded dim"). Each chunk is now given the positions before it by the rank that
    holds them (``cp_halo``): a
    reach of 2 inside a chunk of 4, and of 5, past a whole chunk, both verified at split; a centred convolution,
    which reads the positions after each one too, runs on the whole sequence (named), or is refused by name under
    ``--verify strict``."""
    monkeypatch.setenv("CONV_KERNEL", kernel)
    path = model_path("cp_causal_conv")
    manifest = _check(path, cp=2)
    assert manifest["cp"]["verified"]["status"] == "verified", manifest["cp"]["verified"]
    halos = [[(h["reach"], h["line"].split(":")[0]) for h in stage["halos"]] for stage in manifest["cp"]["stages"]]
    reach = int(kernel) - 1
    conv, shift = (reach, "cp_causal_conv.py"), (1, "cp_causal_conv.py")
    assert halos == [[conv, shift], [conv] * 3 + [shift]], halos
    kept = min(reach, 4)  # each chunk's last positions, every chunk's: [b, channels, 4 chunks x kept]
    assert manifest["cp"]["stages"][0]["halos"][0]["bytes"] == 2 * 64 * 4 * kept * 4
    monkeypatch.setenv("CONV_CENTERED", "1")
    manifest = _check(path, cp=2)
    assert manifest["cp"]["verified"]["status"] == "verified", manifest["cp"]["verified"]
    assert "conv1d" in {w["op"] for stage in manifest["cp"]["stages"] for w in stage["whole"]}
    with pytest.raises(ValueError, match=r"conv1d \(conv1d\) at cp_causal_conv\.py:\d+: a convolution along the "
                                         r"sequence dim that is not causal"):
        _check(path, "strict", cp=2)


@pytest.mark.parametrize("cp", [2, 3])
def test_the_halo_of_each_chunk_is_the_zero_padded_sequence_before_it(cp):
    """``cp_halo``'s output on every rank against the sequence itself, zero-padded in front: ``[before_a, chunk_a,
    before_b, chunk_b]`` for the rank's chunks r and 2cp-1-r, for reaches inside a chunk, equal to it and past it."""
    chunk = 3
    x = torch.randn(2, 5, 2 * cp * chunk, dtype=torch.float64)
    for reach in (1, chunk, chunk + 2, 2 * chunk + 1):
        padded = torch.cat([torch.zeros(2, 5, reach, dtype=torch.float64), x], dim=-1)
        pieces = [local_ranks._cp_piece(x, 2, 1, cp, r) for r in range(cp)]
        got = local_ranks._cp_collective(torch.ops.tracepp.cp_halo.default, pieces, [2, reach], cp)
        for r in range(cp):
            want = torch.cat([padded[..., c * chunk:c * chunk + reach + chunk] for c in (r, 2 * cp - 1 - r)], -1)
            assert torch.equal(got[r], want), (cp, reach, r)


def test_running_sums_along_the_sequence_are_each_chunks_plus_the_chunks_before():
    """minGRU's log-space scan (``cumsum`` and ``logcumsumexp`` along the sequence), x-transformers' data-dependent
    ALiBi (a cumsum, then the difference of every query's and key's) and token-shift-gpt's cumulative mean were
    refused by ``--cp`` ("a cumulative sum along the sequence dim"); each chunk's running values are now its
    own plus the totals of every chunk before it (``cp_cumsum``, ``cp_logcumsumexp``), verified at split; a running
    product likewise (``cp_cumprod``: ``tests/test_context_parallel.py``)."""
    manifest = _check(model_path("cp_prefix_scan"), cp=2)
    assert manifest["cp"]["verified"]["status"] == "verified", manifest["cp"]["verified"]
    ops = [[s["op"] for s in stage["scans"]] for stage in manifest["cp"]["stages"]]
    assert ops == [["cumsum", "logcumsumexp", "cumsum"], ["cumsum", "cumsum"]], ops
    # x-transformers' data-dependent ALiBi: the gates' running sums of every key gathered beside the keys and values
    # (an outer difference of two position shards, refused before as "mixes the positions of the sequence")
    gathered = [g["value"] for g in manifest["cp"]["stages"][1]["gathered"]]
    assert len(gathered) == 3 and gathered[2].startswith("cumsum"), gathered


@pytest.mark.parametrize("cp", [2, 3])
def test_a_running_sum_over_the_ranks_chunks_is_the_whole_sequences(cp):
    """``cp_cumsum``, ``cp_logcumsumexp`` and ``cp_cumprod`` on every rank, forward and backward (verification's
    simulation: the
    runtime's code, the chunks' totals all-gathered across the ranks' values), against torch's on the whole sequence:
    each rank's chunks of the whole one, and the whole one's gradient."""
    x = torch.randn(2, 5, 2 * cp * 3, dtype=torch.float64)
    seed = torch.randn(x.shape, dtype=torch.float64)
    for op, whole_op in ((torch.ops.tracepp.cp_cumsum.default, torch.cumsum),
                         (torch.ops.tracepp.cp_logcumsumexp.default, torch.logcumsumexp),
                         (torch.ops.tracepp.cp_cumprod.default, torch.cumprod)):
        whole_x = x.clone().requires_grad_(True)
        whole = whole_op(whole_x, 2)
        whole.backward(seed)
        pieces = [local_ranks._cp_piece(x, 2, 1, cp, r).requires_grad_(True) for r in range(cp)]
        got = local_ranks._cp_collective(op, pieces, [2], cp)
        torch.autograd.backward(got, [local_ranks._cp_piece(seed, 2, 1, cp, r) for r in range(cp)])
        for r in range(cp):
            assert torch.allclose(got[r], local_ranks._cp_piece(whole.detach(), 2, 1, cp, r)), (op, r)
        assert torch.allclose(local_ranks._cp_join([p.grad for p in pieces], 2, 1), whole_x.grad), op


@pytest.mark.parametrize("scan", ["project", "stack"])
def test_a_scan_written_as_a_loop_over_positions_runs_each_ranks_steps(scan, monkeypatch):
    """Mamba's selective scan as a Python loop over the positions (transformers' slow path: each step's output the
    state times its C; mambapy's: the states stacked), unrolled by the trace into 8 steps of ``select(x, dim, t)``:
    under --cp 2 every ``select`` had no rule and each rank ran the whole scan on the whole sequence. Each rank now
    runs its own positions' steps, the state entering each of its chunks carried from the chunks before it
    (``cp_linear_scan``); verified at split, with --tp 2 too (the channels sharded through the steps)."""
    monkeypatch.setenv("SCAN", scan)
    manifest = _check(model_path("cp_sequential_scan"), pp=1, cp=2)
    assert manifest["cp"]["verified"]["status"] == "verified", manifest["cp"]["verified"]
    stage = manifest["cp"]["stages"][0]
    assert stage["whole"] == [] and [s["op"] for s in stage["scans"]] == ["a recurrence over 8 positions"] * 2, stage
    manifest = _check(model_path("cp_sequential_scan"), pp=1, cp=2, tp=2)
    assert manifest["cp"]["verified"]["status"] == "verified", manifest["cp"]["verified"]
    assert manifest["tp"]["verified"]["status"] == "verified", manifest["tp"]["verified"]
    assert manifest["tp"]["stages"][0]["share"]["params"] >= 0.95, manifest["tp"]["stages"][0]


@pytest.mark.parametrize("cp", [1, 2, 3])
def test_a_linear_recurrence_over_the_ranks_chunks_is_the_whole_sequences(cp):
    """``cp_linear_scan(a, b, dim)`` on every rank, forward and backward (verification's simulation: the runtime's
    code, the chunks' totals all-gathered), against the recurrence ``h[t] = a[t] * h[t - 1] + b[t]`` run over the whole
    sequence: each rank's chunks of its states, and their gradients (``a`` broadcast along a dim)."""
    a = torch.rand(2, 2 * cp * 3, 1, 4, dtype=torch.float64) + 0.5
    b = torch.randn(2, 2 * cp * 3, 5, 4, dtype=torch.float64)
    seed = torch.randn(b.shape, dtype=torch.float64)
    wa, wb = a.clone().requires_grad_(True), b.clone().requires_grad_(True)
    h, states = torch.zeros(2, 5, 4, dtype=torch.float64), []
    for t in range(a.shape[1]):
        h = wa[:, t] * h + wb[:, t]
        states.append(h)
    whole = torch.stack(states, 1)
    whole.backward(seed)
    pa, pb = ([local_ranks._cp_piece(x, 1, 1, cp, r).requires_grad_(True) for r in range(cp)] for x in (a, b))
    got = local_ranks._cp_collective(torch.ops.tracepp.cp_linear_scan.default, pa, [pb, 1], cp)
    torch.autograd.backward(got, [local_ranks._cp_piece(seed, 1, 1, cp, r) for r in range(cp)])
    for r in range(cp):
        assert torch.allclose(got[r], local_ranks._cp_piece(whole.detach(), 1, 1, cp, r)), r
    assert torch.allclose(local_ranks._cp_join([p.grad for p in pa], 1, 1), wa.grad)
    assert torch.allclose(local_ranks._cp_join([p.grad for p in pb], 1, 1), wb.grad)
    if cp == 1:  # the op itself, in one process (no group): the recurrence
        assert torch.allclose(torch.ops.tracepp.cp_linear_scan.default(a, b, 1), whole.detach())


@pytest.mark.parametrize("name,sp", [("cp_causal_conv", True), ("cp_prefix_scan", True), ("cp_aft_max", False)])
def test_tp_shards_through_the_look_back_ops_of_cp(name, sp):
    """Under --tp 2 --cp 2 the tp walk runs on the cp-rewritten stages: cp's halos, running sums and their drops work
    along the sequence, and the maximum over it (cp_amax) over its dims; a tp shard of the channels passes through
    them (the channels of a causal convolution, the features of a running sum or of AFT's keys). Before, tp made
    their inputs whole (0.74, 0.82 and 0.83 of the stage's parameters, 0.99 at tp 2 alone); each plan is verified
    over every (tp, cp) rank pair."""
    manifest = _check(model_path(name), pp=1, cp=2, tp=2, sequence_parallel=sp)
    assert manifest["cp"]["verified"]["status"] == "verified", manifest["cp"]["verified"]
    assert manifest["tp"]["verified"]["status"] == "verified", manifest["tp"]["verified"]
    assert manifest["tp"]["stages"][0]["share"]["params"] >= 0.99, manifest["tp"]["stages"][0]


@pytest.mark.parametrize("name", ["tp_llama", "cp_causal_conv"])
def test_tp_x_cp_without_sequence_parallelism_moves_megatrons_bytes(name):
    """--tp 2 --cp 2 without sequence parallelism plans each layer as --tp 2 alone does: Megatron's two all-reduces of
    the layer's [b, s / cp, h]. Two faults of the tp walk over cp's rewrite made it more: the causal mask cp builds
    from its gathered keys' length (``sym_size``) made the keys whole across tp (the Llama at 1.25x), and the token
    ids taken through ``cp_shard`` read as indices the model computes, so the embedding was a table of weights alone
    and the residual stream beside it was read at each rank's piece (cp_causal_conv's attention layer row-wise on a
    sharded stream, 0.86 of the stage's parameters, 1.38x)."""
    manifest = _check(model_path(name), pp=1, cp=2, tp=2)
    assert manifest["tp"]["verified"]["status"] == "verified", manifest["tp"]["verified"]
    stage = manifest["tp"]["stages"][0]
    assert stage["share"]["params"] >= 0.98 and not stage["replicated"], stage
    layers = {layer: figures for layer, figures in stage["layers"].items() if figures[1]}
    assert layers and all(ours <= megatron for ours, megatron in layers.values()), stage["layers"]
