"""The rank script is the program: each rank runs its script's ``ACTIONS`` and ``RELEASES``, and nothing else.

The rule for an edited script. ``tracepp split`` records a digest of every rank's ``ACTIONS`` and ``RELEASES``
(``manifest.json`` ``plan.digests``, and each script's header). At start-up every process describes what it is
about to run (:func:`describe_program`) and all of them exchange that in one ``all_gather_object``. Where every
rank's digest equals the recorded one, the plan is the one tracepp validated and nothing more happens. Where a
rank's differs (its script was edited, or a caller passed other actions), every rank validates the gathered plan
with the planner's own engine (``replay.validate``: the same rules and deadlock replay) and checks that each
send listed in a ``RELEASES`` is provably received by then (the engine derives when; waiting later is as safe,
earlier is not). A valid plan runs as edited, and rank 0 prints a one-line note naming the edited scripts; an
invalid one stops every rank before the first step, ``run.py`` printing the one message (on rank 0) that names
the file, the line and the rule broken (:func:`check_programs`). Deleting ``RELEASES`` is a valid edit: every send is then waited on at
the end of the step. Every rank decides from the same gathered data, so they all agree without talking again.

Standard library only (``replay`` and ``actions`` too): ``tracepp split`` uses :func:`program_digest` to
write the digests, and an output folder runs where tracepp is not installed.
"""
from __future__ import annotations

import ast
import hashlib
import json
import os
from typing import Optional

from .actions import Action, Topology
from .failure import PipelineError
from .replay import ScheduleError, validate


def _refuse(message: str) -> PipelineError:
    """The error every rank raises alike (they all decide from the same gathered data): one message, on rank 0."""
    error = PipelineError(message)
    error.every_rank_agrees = True
    return error


def normal_releases(releases) -> Optional[dict]:
    """``{position: [send positions]}`` with int keys and values, or None (no ``RELEASES``)."""
    if releases is None:
        return None
    return {int(position): [int(send) for send in sends] for position, sends in releases.items()}


def program_digest(actions: list, releases) -> str:
    """A short digest of one rank's program: its action texts and its release points (None when absent)."""
    releases = normal_releases(releases)
    text = json.dumps({"actions": [str(a) for a in actions],
                       "releases": None if releases is None else {str(p): s for p, s in sorted(releases.items())}},
                      sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def script_lines(path: str, actions: list):
    """``(line of each ACTIONS entry, {release position: line}, line of ACTIONS)`` in the script at ``path``,
    read with ``ast``; the first is None when the file's ACTIONS are not ``actions`` (a caller passed others)."""
    try:
        with open(path) as handle:
            tree = ast.parse(handle.read(), filename=path)
    except (OSError, SyntaxError):
        return None, {}, None
    lines, release_lines, actions_line = None, {}, None
    for node in tree.body:
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)):
            continue
        name = node.targets[0].id
        if name == "ACTIONS" and isinstance(node.value, (ast.List, ast.Tuple)):
            actions_line = node.lineno
            entries = node.value.elts
            texts = [e.value if isinstance(e, ast.Constant) else None for e in entries]
            if texts == [str(a) for a in actions]:
                lines = [e.lineno for e in entries]
        elif name == "RELEASES" and isinstance(node.value, ast.Dict):
            for key in node.value.keys:
                if isinstance(key, ast.Constant) and isinstance(key.value, int):
                    release_lines[key.value] = key.lineno
    return lines, release_lines, actions_line


def describe_program(pp_rank: int, path: str, actions: list, releases) -> dict:
    """What this process runs, for the start-up exchange (plain data, picklable)."""
    actions = [str(a) for a in actions]
    lines, release_lines, actions_line = script_lines(path, actions)
    return {"rank": pp_rank, "file": os.path.basename(path), "actions": actions,
            "releases": normal_releases(releases), "digest": program_digest(actions, releases),
            "lines": lines, "release_lines": release_lines, "actions_line": actions_line}


def _where(program: dict, position=None, action=None, in_releases: bool = False) -> str:
    """``rank1.py line 142: action '1B0' (ACTIONS[3])`` as far as it is known."""
    line = None
    if in_releases:
        line = program["release_lines"].get(position)
    elif position is not None and program["lines"] is not None and position < len(program["lines"]):
        line = program["lines"][position]
    elif position is None:
        line = program["actions_line"]
    text = program["file"] + (f" line {line}" if line is not None else "")
    if in_releases:
        return text + f": RELEASES[{position}]"
    if position is not None:
        return text + f": action '{action}' (ACTIONS[{position}])"
    return text


def check_programs(programs: list, manifest: dict) -> Optional[str]:
    """Check the gathered programs (one per process) against the plan tracepp recorded; see the module doc.

    Returns None when nothing was edited, a one-line note when an edited plan is valid; raises
    :class:`PipelineError` naming file, line and rule when it is not. Ranks no process reported (a single
    process of a larger plan) are taken as planned.
    """
    plan = manifest["plan"]
    by_rank: dict = {}
    for program in programs:
        first = by_rank.setdefault(program["rank"], program)
        if first["digest"] != program["digest"]:  # data-parallel replicas of one pipeline rank
            raise _refuse(f"two processes run {program['file']} with different ACTIONS or RELEASES (digests "
                                f"{first['digest']} and {program['digest']}): copy the same output folder to every node")
    recorded = plan.get("digests", {})
    edited = sorted(r for r, program in by_rank.items() if program["digest"] != recorded.get(str(r)))
    if not edited:
        return None
    lists = {int(r): [Action.parse(text) for text in actions] for r, actions in plan["actions"].items()}
    for rank, program in by_rank.items():
        parsed = []
        for position, text in enumerate(program["actions"]):
            try:
                parsed.append(Action.parse(text))
            except ValueError as error:
                raise _refuse(f"{_where(program, position, text)}: {error}; fix the script or re-run "
                                    f"`tracepp split`") from None
        lists[rank] = parsed
    names = ", ".join(by_rank[r]["file"] for r in edited)
    stage_to_rank = plan["stage_to_rank"]
    try:
        result = validate(lists, stage_to_rank, Topology.from_manifest(manifest), plan["num_microbatches"],
                          manifest["training"])
    except ScheduleError as error:
        program = by_rank.get(error.rank) if error.rank is not None else None
        where = _where(program, error.position, error.action) if program is not None else "the rank scripts"
        raise _refuse(f"{where}: {error.problem} [the plan in the rank scripts ({names} edited) breaks this "
                            f"rule, so no rank starts: fix the script or re-run `tracepp split`]") from None
    for rank, program in sorted(by_rank.items()):
        releases = program["releases"]
        if releases is None:
            continue
        actions, safe = lists[rank], result.first_release.get(rank, {})
        for position, sends in sorted(releases.items()):
            for send in sends:
                problem = None
                if not 0 <= position < len(actions):
                    problem = f"position {position} is not in ACTIONS (0..{len(actions) - 1})"
                elif not (0 <= send < position and actions[send].kind.startswith("SEND")):
                    problem = f"position {send} is not a send before action {position} '{actions[position]}'"
                elif safe.get(send) is None or safe[send] > position:
                    peer = stage_to_rank[actions[send].peer]
                    proven = (f"only after action {safe[send]} '{actions[safe[send]]}'" if safe.get(send) is not None
                              else "never in the step")
                    problem = (f"waits on '{actions[send]}' (ACTIONS[{send}]) after action {position} "
                               f"'{actions[position]}', but rank {peer} has provably posted its receive {proven}: "
                               f"the wait could hang")
                if problem is not None:
                    raise _refuse(f"{_where(program, position, in_releases=True)}: {problem} [fix RELEASES, "
                                        f"delete it (every send is then waited on at the step end), or re-run "
                                        f"`tracepp split`]")
    return (f"{names} differ{'s' if len(edited) == 1 else ''} from the plan tracepp wrote; the gathered plan was "
            f"validated and runs as edited")
