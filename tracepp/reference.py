"""docs/reference.md: every command and flag, written from the argparse parsers themselves.

    python -m tracepp.reference > docs/reference.md

``tests/test_docs.py`` regenerates it and compares, so the reference cannot drift from the code.
"""
from __future__ import annotations

import argparse

HEADER = """# Reference: every command and flag

Generated from the parsers by `python -m tracepp.reference > docs/reference.md`; `tests/test_docs.py`
fails when it differs from them. The guide says when to use what: [guide.md](guide.md).
"""


def _flag_row(action: argparse.Action) -> str:
    names = ", ".join(f"`{name}`" for name in action.option_strings) or f"`{action.dest}`"
    if action.metavar and action.option_strings and action.nargs != 0:
        names += f" `{action.metavar}`"
    elif action.choices and action.option_strings:
        names += " `" + "\\|".join(str(c) for c in action.choices) + "`"
    default = action.default
    if action.nargs == 0 or default in (None, argparse.SUPPRESS) or default is False:
        shown = ""
    else:
        shown = f"`{default}`"
    text = (action.help or "").replace("%%", "%").replace("|", "\\|").replace("\n", " ")  # argparse's %% is %
    if "%(default)" in text:
        text = text.replace("%(default)s", str(default))
    return f"| {names} | {shown} | {text} |"


def _section(title: str, parser: argparse.ArgumentParser, usage_name: str) -> list:
    lines = [f"## {title}", ""]
    if parser.description:
        lines += [parser.description, ""]
    parser.prog = usage_name
    usage = parser.format_usage().strip().replace("usage: ", "")
    lines += ["```", usage, "```", "", "| flag | default | meaning |", "| --- | --- | --- |"]
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        lines.append(_flag_row(action))
    return lines + [""]


def parsers() -> list:
    """(title, parser, usage name) of every command a user runs."""
    from tracepp.cli import build_parser
    from tracepp.runtime.launch import build_parser as run_parser

    top = build_parser()
    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    found = [(f"tracepp {name}", parser, f"tracepp {name}") for name, parser in sub.choices.items()]
    return found + [("out/run.py (torchrun --nproc-per-node R out/run.py ...)", run_parser(), "out/run.py")]


def reference() -> str:
    lines = [HEADER]
    for title, parser, usage_name in parsers():
        lines += _section(title, parser, usage_name)
    return "\n".join(lines).rstrip("\n") + "\n"


if __name__ == "__main__":
    import os

    os.environ.setdefault("COLUMNS", "110")  # argparse wraps the usage lines to the terminal's width
    print(reference(), end="")
