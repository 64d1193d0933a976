"""Repeated layers are planned once (split/blocks.py): a graph's runs of identical blocks folded to a few copies,
a pipeline's middle stages of the same structure walked once, and the decisions mapped back onto every copy. The
work counted, not timed: a model four times as deep costs the tensor- and context-parallel walks no more, and
the folded plans are the unfolded ones, node for node."""
import json
import os

import pytest

from util import model_path

from tracepp.driver import _plan, check_model
from tracepp.runtime.mesh import Layout
from tracepp.split import blocks, context_parallel, tensor_parallel, tp_settle

ZOO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "zoo")


def _work(monkeypatch, env: dict, path: str, layout: Layout) -> tuple:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    tensor_parallel.WORK["visits"] = context_parallel.WORK["visits"] = 0
    manifest = check_model(path, num_microbatches=2, layout=layout)
    return tensor_parallel.WORK["visits"], context_parallel.WORK["visits"], manifest


def test_four_times_the_layers_cost_the_tp_walk_no_more_work(monkeypatch):
    layout = Layout(pp=2, tp=2, sequence_parallel=True)
    shallow, _, few = _work(monkeypatch, {"TP_LLAMA_LAYERS": "8"}, model_path("tp_llama"), layout)
    deep, _, many = _work(monkeypatch, {"TP_LLAMA_LAYERS": "32"}, model_path("tp_llama"), layout)
    assert deep <= 1.2 * shallow, (shallow, deep)
    per_layer = {f.split(".", 2)[2]: entry for f, entry in few["tp"]["params"].items() if f.startswith("layers.0.")}
    for layer in range(32):  # every layer planned, as the shallow model's first
        assert {f.split(".", 2)[2]: entry for f, entry in many["tp"]["params"].items()
                if f.startswith(f"layers.{layer}.")} == per_layer


def test_four_times_the_layers_cost_the_cp_walk_no_more_work(monkeypatch):
    monkeypatch.syspath_prepend(ZOO)
    layout = Layout(pp=2, cp=2)
    path = os.path.join(ZOO, "cp_hf.py")
    _, shallow, _ = _work(monkeypatch, {"CP_HF_LAYERS": "8"}, path, layout)
    _, deep, manifest = _work(monkeypatch, {"CP_HF_LAYERS": "32"}, path, layout)
    assert deep <= 1.2 * shallow, (shallow, deep)
    assert manifest["cp"]["size"] == 2


@pytest.mark.timeout(900)  # each case plans its model twice (folded and not): 40 - 90 s alone, more beside other work
@pytest.mark.parametrize("case", [
    ("tp_llama", {"TP_LLAMA_LAYERS": "14"}, dict(pp=3, tp=2, sequence_parallel=True)),
    ("zoo/hf_family.py", {"HF_FAMILY": "mixtral", "HF_LAYERS": "12"}, dict(pp=2, tp=2, sequence_parallel=True)),
    ("zoo/hf_family.py", {"HF_FAMILY": "deepseek_v3", "HF_LAYERS": "12"}, dict(pp=2, tp=2)),
    ("zoo/cp_hf.py", {"CP_HF_FAMILY": "qwen3", "CP_HF_LAYERS": "12"}, dict(pp=2, cp=2)),
], ids=["llama_tp_sp", "mixtral_tp_sp", "deepseek_v3_tp", "qwen3_cp"])
def test_folded_plans_are_the_unfolded_plans(monkeypatch, case):
    name, env, layout = case
    monkeypatch.syspath_prepend(ZOO)
    path = os.path.join(os.path.dirname(ZOO), name) if "/" in name else model_path(name)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    found = []
    for enabled in (False, True):
        monkeypatch.setattr(blocks, "ENABLED", enabled)
        tensor_parallel.WORK["visits"] = context_parallel.WORK["visits"] = 0
        _model, _traced, graph, _plan_json, _run = _plan(path, Layout(**layout), None, "1f1b", 2, None, None)
        work = tensor_parallel.WORK["visits"] + context_parallel.WORK["visits"]
        tp_plan = json.loads(json.dumps(graph.tensor_parallel, default=str)) if graph.tensor_parallel else None
        cp_plan = json.loads(json.dumps(graph.context_parallel, default=str)) if graph.context_parallel else None
        for record in (tp_plan, cp_plan):
            if record and isinstance(record.get("verified"), dict):
                record["verified"].pop("seconds", None)  # the verification's time, not the plan
        found.append((json.dumps([tp_plan, cp_plan], sort_keys=True, default=str),
                      [stage.graph.python_code("self").src for stage in graph.stages], work))
    (plan, code, unfolded), (plan_folded, code_folded, folded) = found
    assert plan_folded == plan
    assert code_folded == code  # the rewritten stage graphs, every inserted collective named alike
    if "deepseek" not in str(env):
        assert folded < unfolded
    # DeepSeek-V3's low-rank pairs are gathered layer by layer (gathering one makes the next a pair), a fixed point
    # that crosses layers: while b2 is gathered and b3 not, the fold is not steady and the whole graph is walked.
    # At 12 layers that costs more than it saves (220k nodes visited against 148k); at 24 it is half (315k, 620k)


def test_the_trials_of_a_settle_fold_and_compare_each_graph_once(monkeypatch):
    """DeepSeek-V3's low-rank pairs are tried kind by kind, each trial settling the same stage graphs again (15
    settles at 671B x tp 8): every graph is folded and its signature taken once per ``settle``, not per trial
    (``blocks.remembered``: that plan 16 -> 9 s)."""
    monkeypatch.syspath_prepend(ZOO)
    monkeypatch.setenv("HF_FAMILY", "deepseek_v3")
    monkeypatch.setenv("HF_LAYERS", "6")
    calls, trials, per_settle = [], [], []
    for name in ("_fold", "_graph_signature"):
        original = getattr(blocks, name)
        monkeypatch.setattr(blocks, name, lambda *args, _o=original, _n=name: calls.append((_n, id(args[0])))
                            or _o(*args))
    settle_once = tp_settle._settle
    monkeypatch.setattr(tp_settle, "_settle", lambda *a, **k: trials.append(1) or settle_once(*a, **k))
    settle = tensor_parallel.settle

    def counted(*args, **kwargs):
        calls.clear()
        trials.clear()
        out = settle(*args, **kwargs)
        per_settle.append((list(calls), len(trials)))
        return out
    monkeypatch.setattr(tensor_parallel, "settle", counted)
    check_model(os.path.join(ZOO, "hf_family.py"), num_microbatches=2, layout=Layout(pp=2, tp=2), verify="off")
    assert per_settle and max(count for _calls, count in per_settle) > 1  # the pairs were tried
    for found, _count in per_settle:
        assert found and len(found) == len(set(found)), found
