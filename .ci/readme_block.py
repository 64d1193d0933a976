"""Print the command of the README's code block marked ``<!-- ci: NAME ... -->`` (the block right after it).

.ci/run runs the README's commands through this, so CI runs exactly what a newcomer copies.
"""
import os
import sys

README = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "README.md")


def block(name: str, text: str) -> str:
    lines = text.splitlines()
    marker = next((i for i, line in enumerate(lines) if line.startswith(f"<!-- ci: {name} ")), None)
    if marker is None:
        raise SystemExit(f"README.md has no '<!-- ci: {name} ...' marker before a code block")
    fence = marker + 1
    if not lines[fence].startswith("```"):
        raise SystemExit(f"README.md line {fence + 1}: a ``` code block must follow the '<!-- ci: {name}' marker")
    end = next(i for i in range(fence + 1, len(lines)) if lines[i].startswith("```"))
    return "\n".join(lines[fence + 1:end])


if __name__ == "__main__":
    with open(README) as handle:
        print(block(sys.argv[1], handle.read()))
