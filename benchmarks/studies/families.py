"""Every causal-LM family transformers ships, through tracepp: one generated table (``docs/families.md``).

For each entry of transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` the family's own config class gives a tiny
config (``tests/zoo/hf_family.py``: hidden 64, 2 to 4 layers, 4 query heads, 2 key/value heads where the family
has them, 4 routed experts top-2 where it has experts, dropout off), and these steps run in order, each only if
the one before it passed:

1. ``build``: the config and the model (random weights, nothing downloaded);
2. ``eager``: its own forward, loss and backward on a batch of 4 x 8 tokens (a failure is the family's);
3. ``export``: ``torch.export.export`` of one microbatch of 2 samples (a failure is torch.export's);
4. ``pp``: ``tracepp split --ranks 2`` (2 microbatches) and 3 SGD steps on 2 ranks (gloo), the parameters
   against 3 eager steps on the same batches: exact when every one is within 2e-5;
5. ``tp``: the ``--ranks 2 --tp 2`` plan at microbatch sizes 1 and 2: the share of each decoder layer's
   parameters (elements) it shards (routed experts and their router apart: they shard over ``--ep``), the
   smallest layer's share, and what stays whole and why; then 3 steps on 4 ranks (pp 2 x tp 2, microbatch
   size 1) against eager;
6. ``ep``: for a family with routed experts (grouped matmuls over an expert dim, as tracepp finds them), 3 steps
   at ``--ranks 2 --dp 2 --ep 2`` (4 ranks) against eager.

Each family runs in its own process with a time limit; its record is kept in the cache folder after every step,
so a run resumes where it stopped and ``--families a,b`` reruns a few (``--redo tp,ep`` forgets those steps'
records first). The table is written from the cache, and a family the cache has no record of keeps its row
from the newest results JSON that has one (said under the table)::

    nice -n 5 python -m benchmarks.studies.families [--families llama,gpt_oss] [--redo tp] [--jobs 1]
    python -m benchmarks.studies.families --table      # docs/families.md and the results JSON from the cache
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ZOO = os.path.join(REPO, "tests", "zoo")
PATH = os.path.join(ZOO, "hf_family.py")
CACHE = os.path.join(REPO, "out_families")
STEPS = ("build", "eager", "export", "pp", "tp", "ep")
TRAIN_STEPS = 3
ATOL = 2e-5
FAMILY_TIMEOUT_S = 1800
RUN_TIMEOUT_S = 400


def families() -> list:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


# ---- one family, in its own process ----------------------------------------------------------------------------

def _short(error: BaseException, limit: int = 600) -> str:
    text = f"{type(error).__name__}: {error}".strip()
    return text if len(text) <= limit else text[:limit] + " ..."


def _where(error: BaseException) -> str:
    """The innermost frame of the error's traceback inside transformers or the model file: ``file.py:42``."""
    frames = traceback.extract_tb(error.__traceback__)
    inside = [f for f in frames if "transformers" in f.filename or "hf_family" in f.filename]
    frame = (inside or frames or [None])[-1]
    return f"{os.path.basename(frame.filename)}:{frame.lineno}" if frame is not None else ""


def _layer_list(model) -> str:
    """The name of the model's decoder layers: the ModuleList holding the most parameters (``model.layers``, not
    MusicGen's one embedding per codebook, ``model.decoder.embed_tokens.0``)."""
    import torch

    lists = [(sum(p.numel() for p in module.parameters()), name) for name, module in model.named_modules()
             if isinstance(module, torch.nn.ModuleList)]
    return max(lists)[1] if lists else ""


def _layer_of(fqn: str, layers: str):
    """The index in ``layers`` (the decoder layers' ModuleList) of the layer a parameter belongs to, or None."""
    match = re.match(re.escape(layers) + r"\.(\d+)\.", fqn)
    return int(match.group(1)) if match else None


def _expert_fqns(manifest: dict, sizes: dict, shapes: dict) -> set:
    """Routed expert weights (the blocks tracepp found) and the routers beside them (a 2-D weight with one row
    per expert, in the same layer): they shard over --ep, not --tp."""
    out = set()
    experts = set()
    for block in (manifest.get("ep") or {}).get("blocks", []):
        out.update(block.get("weights", []))
        out.update(fqn for fqn in shapes if fqn.startswith(block["name"] + "."))  # its biases, whatever moves
        experts.add(block["experts"])
    if not experts:
        return out
    for fqn, shape in shapes.items():
        if len(shape) == 2 and shape[0] in experts and re.search(r"(gate|router)", fqn.rsplit(".", 1)[0]):
            out.add(fqn)
        if len(shape) == 1 and shape[0] in experts and re.search(r"(gate|router|expert)", fqn):
            out.add(fqn)  # a router's bias or a per-expert score correction
    return out


def layer_shares(manifest: dict, model) -> dict:
    """{layer index: share of its parameters (elements) the tp plan shards}, routed experts and routers apart."""
    sizes = {name: p.numel() for name, p in model.named_parameters()}
    shapes = {name: list(p.shape) for name, p in model.named_parameters()}
    first = {id(p): name for name, p in model.named_parameters()}  # a module registered twice (performer-pytorch's
    canonical = {name: first[id(p)] for name, p in model.named_parameters(remove_duplicate=False)}  # proj_updater)
    apart = _expert_fqns(manifest, sizes, shapes)
    layers: dict = {}
    listed = _layer_list(model)
    for fqn, entry in manifest["tp"]["params"].items():
        fqn = canonical.get(fqn, fqn)  # the manifest names a parameter as export does: any of its names
        layer = _layer_of(fqn, listed)
        if layer is None or fqn not in sizes or fqn in apart:
            continue
        total = layers.setdefault(layer, [0, 0])
        total[1] += sizes[fqn]
        total[0] += sizes[fqn] if entry["dim"] is not None else 0
    return {layer: round(done / whole, 4) for layer, (done, whole) in sorted(layers.items()) if whole}


def _run_and_compare(out: str, nproc: int, record: dict, path: str = PATH) -> None:
    """3 steps of the folder on ``nproc`` ranks; the largest parameter difference from eager training of the model
    file ``path`` (this study's ``hf_family.py`` unless given: ``other_families.py`` passes its own)."""
    import torch
    from util import eager_train, torchrun

    from tracepp.modelfile import load_model_file

    ckpt = os.path.join(out, "trained.pt")
    result = torchrun(out, nproc, "--steps", str(TRAIN_STEPS), "--save", ckpt, "--quiet", timeout=RUN_TIMEOUT_S)
    if result.returncode != 0:
        record["error"] = "the run failed: " + _last_error(result.stderr or result.stdout)
        return
    saved = torch.load(ckpt)
    if path not in _EAGER:  # the same 3 eager steps for every layout of this model
        _EAGER[path] = eager_train(path, TRAIN_STEPS)
    expected = _EAGER[path]
    initial = {k: v.detach().clone() for k, v in
               (_model() if path == PATH else load_model_file(path).model()).state_dict().items()}
    if sorted(saved) != sorted(expected):
        record["error"] = f"the saved parameters differ in names: {sorted(set(saved) ^ set(expected))[:5]}"
        return
    diffs = {k: (saved[k].float() - expected[k].float()).abs().max().item() for k in expected
             if saved[k].numel()}
    worst = max(diffs, key=diffs.get) if diffs else None
    record["max_diff"] = diffs[worst] if worst else 0.0
    record["worst"] = worst
    record["moved"] = max(((saved[k].float() - initial[k].float()).abs().max().item() for k in initial
                           if k in saved and saved[k].numel()), default=0.0)
    record["exact"] = record["max_diff"] <= ATOL and record["moved"] > 1e-4
    if record["moved"] <= 1e-4:
        record["error"] = "training did not move the parameters: the comparison proves nothing"


_EAGER: dict = {}


def _last_error(text: str) -> str:
    """The error a failed run ends with: the last exception line and the line of the model it names."""
    lines = [line.rstrip() for line in text.splitlines() if line.strip()]
    picked = [line for line in lines if re.match(r"^[\w.]*(Error|Exception)\b", line.strip())
              or "tracepp:" in line or "rank " in line and "failed" in line]
    found = (picked or lines or ["(no output)"])[-1].strip()
    return found[:700]


def _model():
    sys.path.insert(0, ZOO)
    import hf_family

    return hf_family.model()


def step_build(record: dict) -> None:
    sys.path.insert(0, ZOO)
    import hf_family

    cls = hf_family.model_class()
    config = hf_family.config()
    model = hf_family.model()
    record["class"] = cls.__name__
    record["params"] = sum(p.numel() for p in model.parameters())
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    record["kv_heads"] = next((getattr(text, k) for k in ("num_key_value_heads", "num_kv_heads", "n_kv_heads",
                                                        "multi_query_group_num") if isinstance(getattr(text, k, None),
                                                                                                int)), None)
    if getattr(text, "multi_query", False) and not getattr(text, "new_decoder_architecture", False):
        record["kv_heads"] = 1  # multi-query (GPTBigCode; Falcon, whose num_kv_heads it then ignores)
    record["heads"] = next((getattr(text, k) for k in ("num_attention_heads", "n_head", "num_heads", "n_heads")
                            if isinstance(getattr(text, k, None), int)), None)


def step_eager(record: dict) -> None:
    import torch

    sys.path.insert(0, ZOO)
    import hf_family

    model = hf_family.model()
    args, kwargs, target = hf_family.batch(0)
    loss = hf_family.loss_fn(model(*args, **kwargs), target)
    loss.backward()
    record["loss"] = float(loss.detach())
    bad = [name for name, p in model.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
    if bad or not torch.isfinite(loss):  # the family's own backward: a pipelined run would stop on it (ERGO's)
        raise RuntimeError(f"eager's own loss ({record['loss']}) or gradients are not finite at the tiny config "
                           f"({len(bad)} parameters' gradients, the first {bad[:1]}): the family's, not tracepp's")


def step_export(record: dict) -> None:
    import torch

    sys.path.insert(0, ZOO)
    import hf_family

    from tracepp.trace import random_draws

    model = hf_family.model(hold=False)  # as the family builds it: what draws random numbers in training
    args, kwargs, _target = hf_family.batch(0)
    random_ops = list(dict.fromkeys(random_draws(torch.export.export(model, tuple(a[:2] for a in args), kwargs))))
    if random_ops:
        record["random"] = random_ops[:4]
        record["held_in_eval"] = list(hf_family.HELD_IN_EVAL.get(hf_family.FAMILY, ()))


def step_pp(record: dict, path: str = PATH) -> None:
    from tracepp.driver import split_model
    from tracepp.runtime.mesh import Layout

    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "out")
        manifest = split_model(path, out, num_microbatches=2, layout=Layout(pp=2))
        record["stages"] = len(manifest["stages"])
        blocks = (manifest.get("ep") or {}).get("blocks", [])
        record["moe_blocks"] = len(blocks)
        record["moe_refused"] = next((b["refused"] for b in blocks if b.get("refused")), "")
        _run_and_compare(out, 2, record, path)


def step_tp(record: dict, path: str = PATH, model=None) -> None:
    import contextlib
    import io

    from tracepp.driver import check_model, split_model
    from tracepp.runtime.mesh import Layout

    model = _model() if model is None else model
    shares, reasons = {}, []
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "out")
        for size, microbatches in ((1, 4), (2, 2)):  # the run's own split gives microbatch size 1's plan
            with contextlib.redirect_stdout(io.StringIO()):
                manifest = (split_model(path, out, num_microbatches=microbatches, layout=Layout(pp=2, tp=2))
                            if size == 1 else check_model(path, num_microbatches=microbatches,
                                                          layout=Layout(pp=2, tp=2)))
            shares[str(size)] = layer_shares(manifest, model)
            for stage in manifest["tp"]["stages"]:
                for reason in stage["replicated"]:
                    if reason not in reasons:
                        reasons.append(reason)
        record["layer_share"] = shares
        record["min_share"] = min((min(s.values()) for s in shares.values() if s), default=None)
        record["whole"] = reasons[:8]
        _run_and_compare(out, 4, record, path)


def step_ep(record: dict, pp: dict, path: str = PATH) -> None:
    from tracepp.driver import split_model
    from tracepp.runtime.mesh import Layout

    if not pp.get("moe_blocks"):
        record["skipped"] = "no routed experts"
        return
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "out")
        split_model(path, out, num_microbatches=2, layout=Layout(pp=2, dp=2, ep=2))
        _run_and_compare(out, 4, record, path)


def _save(path: str, record: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as handle:
        json.dump(record, handle, indent=1)
    os.replace(tmp, path)


def run_one(family: str, cache: str) -> None:
    """Every step not yet in ``cache/family.json``, in order, saving after each."""
    os.environ["HF_FAMILY"] = family
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.path.insert(0, os.path.join(REPO, "tests"))
    sys.path.insert(0, ZOO)
    path = os.path.join(cache, family + ".json")
    record = json.load(open(path)) if os.path.exists(path) else {"family": family}
    record.setdefault("steps", {})
    import torch

    torch.set_num_threads(1)
    for step in STEPS:
        done = record["steps"].get(step)
        if done is not None and not ("error" in done or done.get("running")):
            continue
        if done is not None:
            if step in ("tp", "ep"):
                continue  # a failed tp plan leaves ep to run
            return  # a failed step: the later ones need it
        entry = {"started": time.strftime("%Y-%m-%d %H:%M:%S")}
        record["steps"][step] = dict(entry, running=True)
        _save(path, record)
        begin = time.monotonic()
        try:
            if step == "ep":
                step_ep(entry, record["steps"]["pp"])
            else:
                globals()["step_" + step](entry)
        except BaseException as error:  # noqa: BLE001 - a failure is the step's result
            entry["error"] = _short(error)
            entry["at"] = _where(error)
            entry["traceback"] = traceback.format_exc()[-3000:]
            if isinstance(error, KeyboardInterrupt):
                raise
        entry["seconds"] = round(time.monotonic() - begin, 1)
        record["steps"][step] = entry
        _save(path, record)
        print(f"{family} {step}: {entry.get('error') or 'ok'} ({entry['seconds']} s)", flush=True)
        if "error" in entry and step not in ("tp", "ep"):
            return


# ---- the table ------------------------------------------------------------------------------------------------

def _cell(step: dict, good) -> str:
    if step is None:
        return ""
    if step.get("running"):
        return "timeout"
    if step.get("skipped"):
        return "-"
    if "error" in step:
        return "no"
    return good(step)


def _diff(step: dict) -> str:
    return ("yes" if step.get("exact") else "no") + f" ({step['max_diff']:.1e})"


def outcome(record: dict) -> dict:
    """The table's facts about one family, from its cached record."""
    steps = record.get("steps", {})
    get = steps.get
    facts = {"family": record["family"], "class": get("build", {}).get("class", "")}
    first = None
    for name in STEPS:
        step = get(name)
        if step is None:
            break
        if step.get("running"):
            first = (name, f"timed out after {FAMILY_TIMEOUT_S} s", "")
            break
        if "error" in step:
            first = (name, step["error"], step.get("at", ""))
            break
    facts["failed_step"], facts["reason"], facts["at"] = first if first else (None, "", "")
    facts["outside"] = bool(first) and first[0] in ("build", "eager", "export")
    facts["finished"] = bool(first) or "ep" in steps  # every step run (or one failed): the goals count it
    pp, tp, ep = get("pp") or {}, get("tp") or {}, get("ep") or {}
    facts["exports"] = "export" in steps and "error" not in steps["export"] and not steps["export"].get("running")
    facts["pp_exact"] = bool(pp.get("exact"))
    build = get("build") or {}  # key/value heads: the config's count, else one per query head (multi-head)
    facts["kv_heads"] = build.get("kv_heads") if build.get("kv_heads") is not None else build.get("heads")
    facts["min_share"] = tp.get("min_share")
    facts["tp_exact"] = bool(tp.get("exact"))
    facts["moe"] = bool(pp.get("moe_blocks"))
    facts["ep_exact"] = bool(ep.get("exact"))
    facts["whole"] = tp.get("whole", [])
    return facts


def goals(rows: list) -> dict:
    """The issue's goals over the families whose steps have all run: of those torch.export traces, the share
    exact at pp 2; of those with 2 or more key/value heads, the share sharding at least 0.95 of every decoder
    layer at tp 2 (microbatch sizes 1 and 2) and exact; of those with routed experts, the share exact at ep 2."""
    pending = [r for r in rows if not r["finished"]]
    rows = [r for r in rows if r["finished"]]
    exported = [r for r in rows if r["exports"]]
    pp = [r for r in exported if r["pp_exact"]]
    kv = [r for r in exported if (r["kv_heads"] or 0) >= 2]
    tp = [r for r in kv if r["tp_exact"] and (r["min_share"] or 0) >= 0.95]
    moe = [r for r in exported if r["moe"]]
    ep = [r for r in moe if r["ep_exact"]]

    def share(part, whole):
        return {"count": len(part), "of": len(whole), "share": round(len(part) / len(whole), 4) if whole else None,
                "missing": sorted(r["family"] for r in whole if r not in part)}

    return {"families": len(rows), "pending": sorted(r["family"] for r in pending),
            "builds": sum(1 for r in rows if r["failed_step"] not in ("build",)),
            "exports": len(exported), "pp_exact": share(pp, exported), "tp_kv2_sharded_exact": share(tp, kv),
            "ep_exact": share(ep, moe)}


def _table_rows(records: list) -> list:
    rows = []
    for record in records:
        facts = outcome(record)
        steps = record.get("steps", {})
        tp = steps.get("tp")
        share = ""
        if tp and tp.get("layer_share"):
            share = " / ".join(f"{min(v.values()):.2f}" if v else "-" for v in tp["layer_share"].values())
        reason = facts["reason"].replace("|", "\\|").replace("\n", " ")
        if len(reason) > 300:
            reason = reason[:300] + " ..."
        where = f" ({facts['at']})" if facts["at"] else ""
        if not facts["failed_step"] and facts["whole"] and facts["min_share"] is not None and facts["min_share"] < 0.95:
            reason = "tp keeps whole: " + facts["whole"][0].replace("|", "\\|")
        drawn = (steps.get("export") or {}).get("random")
        if drawn:  # compared with the sampling modules in eval mode (hf_family.HELD_IN_EVAL), said beside the row
            held = (steps.get("export") or {}).get("held_in_eval")
            said = (f"draws random numbers in training ({', '.join(drawn)}): compared with its "
                    f"{', '.join(held)} in eval mode" if held else
                    f"draws random numbers in training ({', '.join(drawn)}): not comparable number for number")
            reason = f"{said}; {reason}" if reason else said
        label = f"{facts['failed_step']}: " if facts["failed_step"] else ""
        if facts["outside"]:
            label = {"build": "outside tracepp (build): ", "eager": "outside tracepp (eager forward): ",
                     "export": "outside tracepp (torch.export): "}[facts["failed_step"]]
        rows.append("| " + " | ".join([
            facts["family"], _cell(steps.get("build"), lambda s: "yes"), _cell(steps.get("export"), lambda s: "yes")
            if "eager" in steps and "error" not in steps["eager"] else ("no (eager)" if "eager" in steps else ""),
            _cell(steps.get("pp"), _diff), f"{share}" if share else "",
            _cell(tp, _diff) if tp else "", _cell(steps.get("ep"), _diff) if steps.get("ep") else "",
            (label + reason + where).strip()]) + " |")
    return rows


def _results_records(data, key: str) -> dict:
    """name -> record in one results JSON: a table's (``{"families": [...]}``, ``{"models": [...]}`` or a dict of
    them by name) or one record alone (``{"family": ..., "steps": ...}``)."""
    if isinstance(data, dict) and key in data and "steps" in data:
        return {data[key]: data}
    for listed in ("families", "models"):
        held = data.get(listed) if isinstance(data, dict) else None
        if isinstance(held, dict):
            return {name: record for name, record in held.items() if isinstance(record, dict)}
        if isinstance(held, list):
            return {record[key]: record for record in held if isinstance(record, dict) and key in record}
    return {}


def table_records(names: list, cache: str, results: str, kind: str, key: str) -> tuple:
    """(records, carried) for a generated table: each name's record from the cache where it has one, else from the
    newest results JSON in ``results`` named ``<stamp>_<kind>[_<what>].json`` that holds a record of it with steps
    run. ``carried``: name -> the results file it came from. A table written after a run of a few names keeps every
    other row as last measured (a cache is lost with its machine; a table of the few alone erased the rest)."""
    pattern = re.compile(r"^\d{8}-\d{6}_" + re.escape(kind) + r"(_[A-Za-z0-9_]+)?\.json$")
    folders = dict.fromkeys([results, os.path.join(REPO, "benchmarks", "results")])  # --out first, then the record
    files = sorted(((f, os.path.join(folder, f)) for folder in folders if os.path.isdir(folder)
                    for f in os.listdir(folder) if pattern.match(f)), reverse=True)
    loaded: dict = {}

    def earlier(name):
        for file, full in files:
            if file not in loaded:
                try:
                    loaded[file] = _results_records(json.load(open(full)), key)
                except (OSError, ValueError):
                    loaded[file] = {}
            record = loaded[file].get(name)
            if record and record.get("steps"):
                return file, record
        return None, None

    records, carried = [], {}
    for name in names:
        path = os.path.join(cache, name + ".json")
        record = json.load(open(path)) if os.path.exists(path) else None
        if not (record and record.get("steps")):
            file, found = earlier(name)
            if found is not None:
                record, carried[name] = found, file
        records.append(record or {key: name, "steps": {}})
    return records, carried


def carried_text(carried: dict, what: str) -> str:
    """The line under a table that says which rows were not run with it, and from which results."""
    if not carried:
        return ""
    by_file: dict = {}
    for name, file in carried.items():
        by_file.setdefault(file, []).append(name)
    parts = "; ".join(f"`benchmarks/results/{file}`: {len(names)}" for file, names in sorted(by_file.items()))
    return f"{len(carried)} {what} not run in this table's run, their rows as last measured ({parts}).\n\n"


def _goals_text(summary: dict) -> str:
    def line(what, entry, goal):
        share = f"{entry['share']:.1%}" if entry["share"] is not None else "-"
        missing = ", ".join(entry["missing"]) or "none"
        return f"| {what} | {entry['count']} of {entry['of']} ({share}) | {goal} | {missing} |"

    pending = summary["pending"]
    return "\n".join([
        f"**Goals** over the {summary['families']} families whose steps have all run ({summary['exports']} export)"
        + (f"; {len(pending)} not yet run: {', '.join(pending)}" if pending else "") + ":",
        "",
        "| goal | met | target | families that miss it |",
        "| --- | --- | --- | --- |",
        line("pp 2 equal to eager (of those that export)", summary["pp_exact"], "95%"),
        line("tp 2 shards >= 0.95 of every decoder layer and is exact (2+ key/value heads)",
             summary["tp_kv2_sharded_exact"], "90%"),
        line("ep 2 equal to eager (routed experts)", summary["ep_exact"], "100%")])


def write_table(cache: str, out: str, doc: str) -> dict:
    sys.path.insert(0, REPO)
    from benchmarks import write_result

    records, carried = table_records(families(), cache, out, "families", "family")
    rows = [outcome(r) for r in records]
    summary = goals([r for r in rows if r["failed_step"] != "missing"])
    import torch
    import transformers

    result = {"what": "every causal-LM family of transformers through tracepp (benchmarks/studies/families.py)",
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "torch": torch.__version__,
              "transformers": transformers.__version__, "goals": summary, "carried": carried, "families": records}
    path = write_result(out, "families", result)
    text = open(doc).read() if os.path.exists(doc) else ""
    table = "\n".join(["| family | builds | exports | pp exact (max diff) | tp share, mb 1 / 2 | tp exact | ep exact "
                       "| first failure, or what tp keeps whole |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
                      + _table_rows(records))
    begin, end = "<!-- families table: generated -->", "<!-- end of the generated table -->"
    block = (f"{begin}\n{_goals_text(summary)}\n\n{table}\n\n{carried_text(carried, 'families were')}"
             f"Results: `{os.path.relpath(path, REPO)}`.\n{end}")
    if begin in text:
        text = text[:text.index(begin)] + block + text[text.index(end) + len(end):]
    else:
        text = text + "\n" + block + "\n"
    with open(doc, "w") as handle:
        handle.write(text)
    print(json.dumps(summary, indent=1))
    return summary


def run_each(names: list, args, module: str, extra: list = (), env_of=None) -> None:
    """Each of ``names`` in a process of its own (``python -m module --one NAME``) within ``args.timeout``, its
    cached record's ``args.redo`` steps dropped first: the studies' driver loop."""
    redo = [s for s in args.redo.split(",") if s]
    for name in names:
        path = os.path.join(args.cache, name + ".json")
        if redo and os.path.exists(path):
            record = json.load(open(path))
            for step in redo:
                record.get("steps", {}).pop(step, None)
            _save(path, record)
        command = [sys.executable, "-m", module, "--one", name, "--cache", args.cache, *extra]
        try:
            subprocess.run(command, cwd=REPO, timeout=args.timeout, env=env_of(name) if env_of else None)
        except subprocess.TimeoutExpired:
            print(f"{name}: timed out after {args.timeout} s", flush=True)


def main(argv=None) -> int:
    global STEPS
    parser = argparse.ArgumentParser(prog="python -m benchmarks.studies.families")
    parser.add_argument("--families", default="", help="comma-separated model types (default: every one)")
    parser.add_argument("--redo", default="", help="comma-separated steps to run again (their records dropped)")
    parser.add_argument("--cache", default=CACHE)
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results"))
    parser.add_argument("--doc", default=os.path.join(REPO, "docs", "families.md"))
    parser.add_argument("--timeout", type=float, default=FAMILY_TIMEOUT_S, help="seconds per family")
    parser.add_argument("--until", default="ep", choices=STEPS, help="the last step to run")
    parser.add_argument("--table", action="store_true", help="only write the table from the cache")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    os.makedirs(args.cache, exist_ok=True)
    if args.one:
        STEPS = STEPS[:STEPS.index(args.until) + 1]
        run_one(args.one, args.cache)
        return 0
    if not args.table:
        chosen = [f for f in args.families.split(",") if f] or families()
        unknown = sorted(set(chosen) - set(families()))
        if unknown:
            parser.error(f"unknown families {unknown}: choose from {families()}")
        run_each(chosen, args, "benchmarks.studies.families", ["--until", args.until],
                 lambda family: dict(os.environ, HF_FAMILY=family))
    write_table(args.cache, args.out, args.doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
