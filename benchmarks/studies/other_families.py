"""Decoder code from libraries other than transformers, through tracepp: the second table of ``docs/families.md``.

Each model file of ``tests/zoo_other`` builds one library's own model classes, unchanged, at a tiny size (hidden 64,
4 query heads of 16, 2 key/value heads where the architecture has grouped-query attention, 2 to 4 layers, a
vocabulary of 128, dropout off; ``tests/zoo_other/other_common.py``) and names its library, version and source
(``LIBRARY``, ``VERSION``, ``SOURCE``, ``HEADS_``, ``KV_HEADS_``). These steps run in order, as the first table's do
(``benchmarks/studies/families.py``, whose steps this study calls with the model file's path), each only if the
one before it passed:

1. ``build``: the model (random weights, nothing downloaded);
2. ``eager``: its own forward, loss and backward on a batch of 4 x 8 tokens (a failure is the library's);
3. ``export``: ``torch.export.export`` of one microbatch of 2 samples (along the model file's ``batch_dim``), as
   the split calls it (``nn.TransformerEncoder``'s causal-mask hint off: ``tracepp/sequence_first.py``; a failure
   is torch.export's);
4. ``pp``: ``tracepp split --ranks 2`` (2 microbatches), 3 SGD steps on 2 ranks (gloo) against 3 eager steps:
   exact when every parameter is within 2e-5;
5. ``tp``: the ``--ranks 2 --tp 2`` plan at microbatch sizes 1 and 2 (the share of each decoder layer's parameters
   it shards, routed experts apart) and 3 steps at pp 2 x tp 2 (4 ranks) against eager;
6. ``cp``: ``--ranks 2 --cp 2`` (2 microbatches), 3 steps on 4 ranks against eager;
7. ``ep``: for a model with routed experts (as tracepp finds them), 3 steps at ``--ranks 2 --dp 2 --ep 2``.

A step tracepp refuses counts as **refused by name** only when its message names the op and the model's source
line (``op (aten.x.y) at file.py:42``, or ``op at file.py:42``); any other error is a failure, recorded as it is.
Each model runs in its own process with a time limit; its record is kept in the cache folder after every step, so
a run resumes where it stopped (``--redo tp,cp`` forgets those steps first)::

    nice -n 10 python -m benchmarks.studies.other_families [--models torchtitan_llama3,nanogpt] [--redo cp]
    python -m benchmarks.studies.other_families --table    # docs/families.md's second table and the results JSON
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
from benchmarks.studies import families  # noqa: E402  (the first table's steps, called with a model file's path)
from benchmarks.studies import cp_families  # noqa: E402  (what a cp split runs on the whole sequence)

ZOO = os.path.join(REPO, "tests", "zoo_other")
CACHE = os.path.join(REPO, "out_other_families")
STEPS = ("build", "eager", "export", "pp", "tp", "cp", "ep")
MODEL_TIMEOUT_S = 2400
NOT_MODELS = {"other_common.py", "litgpt_common.py"}  # shared by the model files
BEGIN, END = "<!-- other libraries table: generated -->", "<!-- end of the other libraries table -->"


def models() -> list:
    """The model files of ``tests/zoo_other`` (every top-level ``.py`` but the shared helpers), by name."""
    return sorted(name[:-3] for name in os.listdir(ZOO) if name.endswith(".py") and name not in NOT_MODELS)


def path_of(name: str) -> str:
    return os.path.join(ZOO, name + ".py")


def _load(name: str):
    from tracepp.modelfile import load_model_file

    return load_model_file(path_of(name))


def _where(error: BaseException, name: str) -> str:
    """The innermost frame of the error's traceback outside torch and tracepp (the library's or the model
    file's line): ``file.py:42``."""
    frames = traceback.extract_tb(error.__traceback__)
    inside = [f for f in frames if not re.search(r"/(torch|tracepp|split|codegen|runtime|benchmarks)/", f.filename)
              and "importlib" not in f.filename]
    frame = (inside or frames or [None])[-1]
    return f"{os.path.basename(frame.filename)}:{frame.lineno}" if frame is not None else ""


_NAMED = re.compile(r"\(aten\.[\w.]+\) at [\w.\-/]+\.py:\d+|\b[\w.]+ \([\w.]+\) at [\w.\-/]+\.py:\d+"
                    r"|\b[\w.]+ at [\w.\-/]+\.py:\d+")


def refused_by_name(message: str) -> bool:
    """Whether a refusal names the op and the model's source line (``expand_as (expand_as) at model.py:32``)."""
    return bool(message) and bool(_NAMED.search(message)) and "Traceback" not in message[:40]


# ---- one model, in its own process -----------------------------------------------------------------------------

def _layer_list(model) -> str:
    """The decoder layers' container: the ``ModuleList`` as the first table finds it, a ``ModuleDict`` keyed by
    layer index (torchtitan's ``Decoder.layers``), or the ``nn.Sequential`` whose children of one class are the
    blocks (PaLM-pytorch's ``PaLM``: embedding, blocks, norm, head); of these, the one holding the most parameters
    under its own name (a list registered twice, reformer-pytorch's ``blocks`` and ``irrev_blocks``, holds them under
    the name that registered them first, as the split names them)."""
    import torch

    named = dict(model.named_parameters())
    best = (0, "")
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) or (
                isinstance(module, torch.nn.ModuleDict) and module and all(k.isdigit() for k in module.keys())):
            best = max(best, (sum(p.numel() for key, p in named.items() if key.startswith(name + ".")), name))
        elif isinstance(module, torch.nn.Sequential):
            kinds: dict = {}
            for child in module.children():
                kinds.setdefault(type(child), []).append(sum(p.numel() for p in child.parameters()))
            blocks = max((sum(sizes) for sizes in kinds.values() if len(sizes) >= 2), default=0)
            best = max(best, (blocks, name))
    return best[1]


def _layer_of(fqn: str, layers: str, children: list):
    """``families._layer_of``, for a container at the root too (``1.fn.0.weight`` is layer 1), and for children not
    named by their index (revlib's ``ReversibleSequential`` names them ``0-0``, ``0-1``, ...): the position among
    ``children``, the container's child names in order."""
    match = re.match((re.escape(layers) + r"\." if layers else "") + r"([^.]+)\.", fqn)
    if not match:
        return None
    name = match.group(1)
    if name in children:
        return children.index(name)
    return int(name) if name.isdigit() else None


def _blocks_only(model, layers: str) -> set:
    """The indices of a ``Sequential``'s children that are not blocks (not of its most common class: its embedding,
    final norm and head), so they are not counted as layers: the model's own, or the one ``_layer_list`` found
    (token-shift-gpt's ``net``: blocks, then its norm and head)."""
    import torch

    container = model.get_submodule(layers) if layers else model
    if layers and not isinstance(container, torch.nn.Sequential):
        return set()
    children = list(container.children())
    classes = [type(c) for c in children]
    common = max(set(classes), key=classes.count)
    return {i for i, c in enumerate(children) if type(c) is not common}


_FIRST_TABLE_SHARES = families.layer_shares


def _layer_shares(manifest: dict, model) -> dict:
    """``families.layer_shares`` over the decoder layers ``_layer_list`` finds (a root ``Sequential``'s blocks
    only, not its embedding and head)."""
    listed = _layer_list(model)
    skip = _blocks_only(model, listed)
    children = [name for name, _ in (model.get_submodule(listed) if listed else model).named_children()]
    original = families._layer_list, families._layer_of
    families._layer_list = lambda m: listed
    families._layer_of = lambda fqn, layers: _layer_of(fqn, layers, children)
    try:
        shares = _FIRST_TABLE_SHARES(manifest, model)
    finally:
        families._layer_list, families._layer_of = original
    return {k: v for k, v in shares.items() if k not in skip}


def step_build(record: dict, name: str) -> None:
    model_file = _load(name)
    module = model_file.module
    model = model_file.model()
    record["class"] = f"{type(model).__module__}.{type(model).__qualname__}"
    record["params"] = sum(p.numel() for p in model.parameters())
    record["library"] = getattr(module, "LIBRARY", "")
    record["version"] = getattr(module, "VERSION", "")
    record["source"] = getattr(module, "SOURCE", "")
    record["heads"] = getattr(module, "HEADS_", None)
    record["kv_heads"] = getattr(module, "KV_HEADS_", None)


def step_eager(record: dict, name: str) -> None:
    model_file = _load(name)
    module = model_file.module
    model = model_file.model()
    args, kwargs, target = module.batch(0)
    loss = module.loss_fn(model(*args, **kwargs), target)
    loss.backward()
    record["loss"] = float(loss)


def step_export(record: dict, name: str) -> None:
    import torch

    from tracepp.trace import random_draws

    model_file = _load(name)
    model = model_file.model()
    args, kwargs, _target = model_file.module.batch(0)
    from tracepp import batch_mixing, sequence_first
    from tracepp.trace import batched_leaves

    dim = model_file.batch_dim  # 1 for a [seq, batch] layout
    size = args[0].shape[dim]
    probe = batch_mixing.probe(model, 2, size)  # before export, as the split takes it
    import torch.utils._pytree as pytree

    two = pytree.tree_map_only(torch.Tensor, lambda a: a.narrow(dim, 0, 2) if a.dim() > dim and a.shape[dim] == size
                               else a, tuple(args))
    with sequence_first.causal_mask_hint_off():  # as the split traces: nn.TransformerEncoder's mask hint off
        program = torch.export.export(model, two, kwargs)
    drawn = list(dict.fromkeys(random_draws(program)))
    if drawn:
        record["random"] = drawn[:4]
        return
    leaves, spec = pytree.tree_flatten((tuple(args), kwargs))
    batched = batched_leaves(leaves, size, dim)
    mixes = batch_mixing.check(probe, program, leaves, spec, batched, size, 2, dim)  # as the split warns of it
    if mixes:
        record["mixes"] = mixes


def step_cp(record: dict, name: str) -> None:
    from tracepp.driver import split_model
    from tracepp.runtime.mesh import Layout

    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "out")
        manifest = split_model(path_of(name), out, num_microbatches=2, layout=Layout(pp=2, cp=2))
        record.update(cp_families.whole_record(manifest, limit=12))  # what runs on the whole sequence
        families._run_and_compare(out, 4, record, path_of(name))


def run_one(name: str, cache: str, steps=STEPS) -> None:
    """Every step not yet in ``cache/name.json``, in order, saving after each."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    for folder in (os.path.join(REPO, "tests"), ZOO):
        sys.path.insert(0, folder)
    path = os.path.join(cache, name + ".json")
    record = json.load(open(path)) if os.path.exists(path) else {"model": name}
    record.setdefault("steps", {})
    import torch

    torch.set_num_threads(1)
    for step in steps:
        done = record["steps"].get(step)
        if done is not None and not ("error" in done or done.get("running")):
            continue
        if done is not None:
            if step in ("tp", "cp", "ep"):
                continue  # a failed parallel step leaves the others to run
            return  # a failed step: the later ones need it
        entry = {"started": time.strftime("%Y-%m-%d %H:%M:%S")}
        record["steps"][step] = dict(entry, running=True)
        families._save(path, record)
        begin = time.monotonic()
        try:
            if step == "pp":
                families.step_pp(entry, path_of(name))
            elif step == "tp":
                families.layer_shares = _layer_shares  # the first table's, and a root Sequential's blocks
                families.step_tp(entry, path_of(name), _load(name).model())
            elif step == "ep":
                families.step_ep(entry, record["steps"]["pp"], path_of(name))
            else:
                globals()["step_" + step](entry, name)
        except BaseException as error:  # noqa: BLE001 - a failure is the step's result
            entry["error"] = families._short(error, 1200)
            entry["at"] = _where(error, name)
            entry["traceback"] = traceback.format_exc()[-3000:]
            entry["refused_by_name"] = step in ("pp", "tp", "cp", "ep") and refused_by_name(entry["error"])
            if isinstance(error, KeyboardInterrupt):
                raise
        if "error" not in entry and entry.get("max_diff") is not None:  # trained to other parameters, no word
            entry["silently_wrong"] = entry["max_diff"] > families.ATOL
        entry["seconds"] = round(time.monotonic() - begin, 1)
        record["steps"][step] = entry
        families._save(path, record)
        print(f"{name} {step}: {entry.get('error') or 'ok'} ({entry['seconds']} s)", flush=True)
        if "error" in entry and step not in ("tp", "cp", "ep"):
            return


# ---- the table -------------------------------------------------------------------------------------------------

def _result(step, random=(), mixes=None) -> str:
    """One cell: ``yes (diff)``, ``NO (diff)`` (silently wrong), ``random (diff)`` (a model drawing random numbers in
    training, which tracepp says at split), ``mixes (diff)`` (a model whose samples mix across its batch, which
    tracepp warns of at split), ``refused`` (by name), ``error`` or ``-``."""
    if step is None:
        return ""
    if step.get("running"):
        return "timeout"
    if step.get("skipped"):
        return "-"
    if "error" in step:
        return "refused" if step.get("refused_by_name") else "error"
    if not step.get("exact") and random:
        return f"random ({step['max_diff']:.1e})"
    if not step.get("exact") and mixes:
        return f"mixes ({step['max_diff']:.1e})"
    return families._diff(step) if step.get("exact") else f"**NO** ({step['max_diff']:.1e})"


def outcome(record: dict) -> dict:
    """The table's facts about one model, from its cached record."""
    steps = record.get("steps", {})
    build = steps.get("build") or {}
    pp, tp, cp, ep = (steps.get(k) or {} for k in ("pp", "tp", "cp", "ep"))
    first = None
    for step in ("build", "eager", "export"):  # the first of these that failed (or has not run)
        entry = steps.get(step)
        if entry is None or entry.get("running") or "error" in entry:
            first = step
            break
    facts = {"model": record["model"], "library": build.get("library", ""), "version": build.get("version", ""),
             "kv_heads": build.get("kv_heads"), "outside": first if first in steps else None}
    pp_failed = bool(pp) and ("error" in pp or pp.get("running"))
    facts["finished"] = bool(facts["outside"]) or pp_failed or "ep" in steps  # every step run, or one failed
    facts["moe"] = bool(pp.get("moe_blocks"))
    parallel = {"pp": pp, "tp": tp, "cp": cp} | ({"ep": ep} if facts["moe"] else {})
    facts["exact"] = {k: bool(v.get("exact")) for k, v in parallel.items()}
    facts["refused"] = {k: bool(v.get("refused_by_name")) for k, v in parallel.items()}
    facts["random"] = (steps.get("export") or {}).get("random") or []  # drawn in training: compared in distribution
    facts["mixes"] = (steps.get("export") or {}).get("mixes")  # samples mix across the batch: warned of at split
    said = bool(facts["random"]) or bool(facts["mixes"])
    facts["wrong"] = {k: ("error" not in v and v.get("max_diff") is not None and not v.get("exact")
                          and not said) for k, v in parallel.items()}
    facts["differs"] = {k: ("error" not in v and v.get("max_diff") is not None and not v.get("exact")
                            and said) for k, v in parallel.items()}
    facts["min_share"] = tp.get("min_share")
    facts["whole"] = tp.get("whole", [])
    return facts


def goals(rows: list) -> dict:
    """Issue 57's goals over the models whose steps have all run: every parallel step exact or refused by name
    (pp, tp, cp; ep where there are routed experts), and a tp share of at least 0.95 of every decoder layer, exact
    (or differing from eager only as the split says: random draws, samples that mix across the batch), on those with 2
    or more key/value heads."""
    done = [r for r in rows if r["finished"] and not r["outside"]]

    def ok(r):  # a pipeline split refused by name leaves nothing else to run; a model drawing random numbers in
        #         training differs from eager as tracepp says at split (naming the op and line), not silently
        return r["refused"]["pp"] or all(r["exact"][k] or r["refused"][k] or r["differs"][k] for k in r["exact"])

    good = [r for r in done if ok(r)]
    kv = [r for r in done if (r["kv_heads"] or 0) >= 2]
    tp = [r for r in kv if (r["exact"]["tp"] or r["differs"]["tp"]) and (r["min_share"] or 0) >= 0.95]
    wrong = sorted(f"{r['model']} ({', '.join(k for k, v in r['wrong'].items() if v)})" for r in done
                   if any(r["wrong"].values()))

    def share(part, whole):
        return {"count": len(part), "of": len(whole), "share": round(len(part) / len(whole), 4) if whole else None,
                "missing": sorted(r["model"] for r in whole if r not in part)}

    return {"models": len(done), "outside": sorted(r["model"] for r in rows if r["outside"]),
            "pending": sorted(r["model"] for r in rows if not r["finished"]),
            "exact_or_refused_by_name": share(good, done), "tp_kv2_sharded_exact": share(tp, kv),
            "silently_wrong": wrong}


def _failure(step: dict, label: str) -> str:
    if not step or "error" not in step:
        return ""
    kind = "refused" if step.get("refused_by_name") else "error"
    text = step["error"].replace("|", "\\|").replace("\n", " ")
    text = text if len(text) <= 260 else text[:260] + " ..."
    at = f" ({step['at']})" if step.get("at") and step["at"] not in text else ""
    return f"{label} {kind}: {text}{at}"


def _rows(records: list) -> list:
    lines = []
    for record in records:
        steps = record.get("steps", {})
        facts = outcome(record)
        build = steps.get("build") or {}
        tp = steps.get("tp") or {}
        share = " / ".join(f"{min(v.values()):.2f}" if v else "-" for v in (tp.get("layer_share") or {}).values())
        notes = []
        if facts["outside"]:
            entry = steps.get(facts["outside"]) or {}
            notes.append(f"outside tracepp ({facts['outside']}): "
                         + (entry.get("error", "timed out") or "")[:300].replace("|", "\\|").replace("\n", " ")
                         + (f" ({entry['at']})" if entry.get("at") else ""))
        for key in ("pp", "tp", "cp", "ep"):
            note = _failure(steps.get(key) or {}, key)
            if note:
                notes.append(note)
            if facts["wrong"].get(key):
                worst = (steps.get(key) or {}).get("worst", "")
                notes.append(f"{key} silently wrong: {steps[key]['max_diff']:.1e} from eager ({worst})")
            if facts["differs"].get(key) and facts["random"]:
                notes.append(f"{key} {steps[key]['max_diff']:.1e} from eager: the model draws random numbers in "
                             f"training ({', '.join(facts['random'])}), said at split: equal to eager in "
                             f"distribution, not number for number")
            elif facts["differs"].get(key):
                notes.append(f"{key} {steps[key]['max_diff']:.1e} from eager, warned of at split: "
                             + facts["mixes"].split(". A pipelined")[0])
        if not notes and facts["whole"] and facts["min_share"] is not None and facts["min_share"] < 0.95:
            notes.append("tp keeps whole: " + facts["whole"][0].replace("|", "\\|"))
        cp = steps.get("cp") or {}
        if cp.get("whole") and "error" not in cp:
            notes.append(f"cp runs {cp['whole']} op(s) on the whole sequence at every cp rank, as no cp rule places "
                         f"them: " + ", ".join(cp.get("whole_ops", [])[:3]).replace("|", "\\|")
                         + (" ..." if len(cp.get("whole_ops", [])) > 3 else ""))
        library = f"{build.get('library', '')} {build.get('version', '')}".strip()
        lines.append("| " + " | ".join([
            facts["model"], library, str(facts["kv_heads"] if facts["kv_heads"] is not None else ""),
            _result(steps.get("pp"), facts["random"], facts["mixes"]), share,
            _result(steps.get("tp"), facts["random"], facts["mixes"]) if tp else "",
            _result(steps.get("cp"), facts["random"], facts["mixes"]),
            _result(steps.get("ep"), facts["random"], facts["mixes"]) if facts["moe"] else (
                "-" if steps.get("ep") else ""),
            "; ".join(notes)]) + " |")
    return lines


def _goals_text(summary: dict) -> str:
    def line(what, entry, goal):
        share = f"{entry['share']:.1%}" if entry["share"] is not None else "-"
        missing = ", ".join(entry["missing"]) or "none"
        return f"| {what} | {entry['count']} of {entry['of']} ({share}) | {goal} | {missing} |"

    head = f"**Goals** over the {summary['models']} models whose steps have all run"
    if summary["outside"]:
        head += f" ({len(summary['outside'])} more fail outside tracepp: {', '.join(summary['outside'])})"
    if summary["pending"]:
        head += f"; not yet run: {', '.join(summary['pending'])}"
    return "\n".join([
        head + ":", "", "| goal | met | target | models that miss it |", "| --- | --- | --- | --- |",
        line("pp 2, tp 2, cp 2 (and ep 2 with routed experts) each exact, or refused by name with its source line "
             "(or, where the model draws random numbers in training, equal in distribution as said at split; where its "
             "samples mix across the batch, as warned of at split)",
             summary["exact_or_refused_by_name"], "100%"),
        line("tp 2 shards >= 0.95 of every decoder layer and is exact, or differs only as said at split (2+ key/value "
             "heads)",
             summary["tp_kv2_sharded_exact"], "100%"),
        f"| silently wrong (trained, parameters beyond 2e-5 from eager) | {len(summary['silently_wrong'])} | 0 | "
        f"{', '.join(summary['silently_wrong']) or 'none'} |"])


def write_table(cache: str, out: str, doc: str) -> dict:
    from benchmarks import write_result

    records, carried = families.table_records(models(), cache, out, "other_families", "model")
    summary = goals([outcome(r) for r in records])
    import torch

    result = {"what": "decoder code from libraries other than transformers through tracepp "
                      "(benchmarks/studies/other_families.py)",
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "torch": torch.__version__, "goals": summary,
              "carried": carried, "models": records}
    path = write_result(out, "other_families", result)
    table = "\n".join(["| model | library | kv heads | pp exact (max diff) | tp share, mb 1 / 2 | tp exact | cp exact "
                       "| ep exact | failures, or what tp keeps whole |",
                       "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"] + _rows(records))
    block = (f"{BEGIN}\n{_goals_text(summary)}\n\n{table}\n\n{families.carried_text(carried, 'models were')}"
             f"Results: `{os.path.relpath(path, REPO)}`.\n{END}")
    text = open(doc).read() if os.path.exists(doc) else ""
    if BEGIN in text:
        text = text[:text.index(BEGIN)] + block + text[text.index(END) + len(END):]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    with open(doc, "w") as handle:
        handle.write(text)
    print(json.dumps(summary, indent=1))
    return summary


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.studies.other_families")
    parser.add_argument("--models", default="", help="comma-separated model files of tests/zoo_other (default: all)")
    parser.add_argument("--redo", default="", help="comma-separated steps to run again (their records dropped)")
    parser.add_argument("--cache", default=CACHE)
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results"))
    parser.add_argument("--doc", default=os.path.join(REPO, "docs", "families.md"))
    parser.add_argument("--timeout", type=float, default=MODEL_TIMEOUT_S, help="seconds per model")
    parser.add_argument("--table", action="store_true", help="only write the table from the cache")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    os.makedirs(args.cache, exist_ok=True)
    if args.one:
        run_one(args.one, args.cache)
        return 0
    if not args.table:
        chosen = [m for m in args.models.split(",") if m] or models()
        unknown = sorted(set(chosen) - set(models()))
        if unknown:
            parser.error(f"unknown models {unknown}: choose from {models()}")
        families.run_each(chosen, args, "benchmarks.studies.other_families")
    write_table(args.cache, args.out, args.doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
