"""The front page and the docs stay true: the reference equals what the parsers say (every flag, both ways),
the README stays a front page with CI's two command blocks, every relative link resolves, and the README's
picture is what `tracepp plan --svg` draws for the quick start today."""
import os
import re
import subprocess
import sys

from util import REPO


def test_reference_is_generated_from_the_parsers(monkeypatch):
    from tracepp.reference import parsers, reference

    monkeypatch.setenv("COLUMNS", "110")
    with open(os.path.join(REPO, "docs", "reference.md")) as handle:
        written = handle.read()
    assert written == reference(), ("docs/reference.md differs from the parsers: regenerate it with "
                                    "`python -m tracepp.reference > docs/reference.md`")
    for _title, parser, _usage in parsers():  # and every flag appears, spelled as the parser spells it
        for action in parser._actions:
            for name in action.option_strings:
                if name not in ("-h", "--help"):
                    assert f"`{name}`" in written, name


def test_readme_is_a_front_page_with_the_ci_blocks():
    with open(os.path.join(REPO, "README.md")) as handle:
        text = handle.read()
    assert len(text.splitlines()) < 250
    for marker in ("<!-- ci: main job", "<!-- ci: tests"):
        assert marker in text
    for name in ("guide.md", "long-jobs.md", "reference.md", "design.md", "benchmarks.md"):
        assert f"docs/{name}" in text


def test_relative_links_resolve():
    pages = [os.path.join(REPO, "README.md")] + [os.path.join(REPO, "docs", n)
                                                 for n in os.listdir(os.path.join(REPO, "docs")) if n.endswith(".md")]
    broken = []
    for page in pages:
        text = open(page).read()
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if "://" in target:
                continue
            if not os.path.exists(os.path.join(os.path.dirname(page), target)):
                broken.append(f"{os.path.relpath(page, REPO)} -> {target}")
    assert not broken, broken


def test_readme_picture_is_the_quick_start_plan(tmp_path):
    out = str(tmp_path / "out")
    tracepp = [sys.executable, "-m", "tracepp"]
    subprocess.run(tracepp + ["split", os.path.join(REPO, "examples", "gpt.py"), "-o", out, "--ranks", "2",
                              "--schedule", "1f1b", "--microbatches", "4"], check=True, capture_output=True)
    picture = str(tmp_path / "plan.svg")
    subprocess.run(tracepp + ["plan", out, "--svg", picture], check=True, capture_output=True)
    with open(picture) as drawn, open(os.path.join(REPO, "docs", "quick-start-plan.svg")) as committed:
        assert drawn.read() == committed.read(), ("docs/quick-start-plan.svg is not what `tracepp plan out --svg` "
                                                  "draws for the README's quick start: regenerate it")
