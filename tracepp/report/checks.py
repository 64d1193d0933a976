"""``tracepp check``: what a split would look like, and what may be wrong with it, without writing anything.

:func:`stage_warnings` reads a manifest (plain data) and returns one sentence per problem worth a look:
stages far apart in parameter count or forward FLOPs, a stage with no parameters, a value sent to many stages.
"""
from __future__ import annotations

UNBALANCED_RATIO = 2.0  # the biggest stage holds more than this times the smallest: the pipeline waits on it
MANY_CONSUMERS = 3  # a value sent to this many stages or more costs a transfer to each, every microbatch


def _imbalance(stages: list, key: str, what: str) -> list:
    sized = [(stage["index"], stage.get(key)) for stage in stages if stage.get(key)]
    if len(sized) < 2:
        return []
    (small_index, small), (big_index, big) = min(sized, key=lambda s: s[1]), max(sized, key=lambda s: s[1])
    if big <= UNBALANCED_RATIO * small:
        return []
    return [f"unbalanced stages: stage {big_index} has {big / small:.1f}x the {what} of stage {small_index} "
            f"({big:,} vs {small:,}); the pipeline runs at the pace of its slowest stage: move a split point "
            f"(--split-points) so each stage holds a similar share"]


def stage_warnings(manifest: dict) -> list:
    stages = manifest["stages"]
    warnings = _imbalance(stages, "num_params", "parameters") + _imbalance(stages, "forward_flops", "forward FLOPs")
    for stage in stages:
        if stage["num_params"] == 0:
            modules = ", ".join(stage.get("module_fqns", [])[:4]) or "no modules"
            warnings.append(f"stage {stage['index']} has no parameters ({modules}): it only passes values on; "
                            f"merge it with a neighbour by removing the split point that starts it")
    for name, value in sorted(manifest["values"].items()):
        if len(value["consumers"]) >= MANY_CONSUMERS:
            warnings.append(f"value {name!r} from stage {value['producer']} is sent to {len(value['consumers'])} "
                            f"stages ({', '.join(map(str, value['consumers']))}) every microbatch: if it is a "
                            f"mask or position ids made from the inputs, compute it where it is used, or use "
                            f"fewer stages")
    return warnings
