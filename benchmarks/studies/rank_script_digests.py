"""Digests of the generated programs (rank scripts and run.py) for the examples, the test models and the zoo at
two schedules: run before and after a refactor and diff the output to show the scripts are byte-identical.

    python -m benchmarks.studies.rank_script_digests > before.txt   # (on the old commit)
    python -m benchmarks.studies.rank_script_digests > after.txt && diff before.txt after.txt
"""
import glob
import hashlib
import os
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CASES = [("1f1b", 2, None), ("interleaved-1f1b", 2, 4)]


def model_files() -> list:
    found = sorted(glob.glob(os.path.join(REPO, "examples", "*.py")) + glob.glob(os.path.join(REPO, "tests", "models", "*.py"))
                   + glob.glob(os.path.join(REPO, "tests", "zoo", "*.py")))
    return [path for path in found if not os.path.basename(path).startswith(("zoo_common", "own_loop", "prepare_"))]


def digests(path: str, schedule: str, ranks: int, stages) -> list:
    from tracepp.driver import split_model
    from tracepp.runtime.mesh import Layout

    with tempfile.TemporaryDirectory() as out:
        try:
            split_model(path, out, num_stages=stages, schedule=schedule, num_microbatches=2, layout=Layout(pp=ranks))
        except Exception as error:  # a model that does not split this way: its error is part of the record
            return [f"error {type(error).__name__}: {str(error).splitlines()[0][:120] if str(error) else ''}"]
        names = sorted(n for n in os.listdir(out) if n.startswith("rank") or n == "run.py")
        return [f"{name} {hashlib.sha256(open(os.path.join(out, name), 'rb').read()).hexdigest()[:16]}"
                for name in names]


def main() -> None:
    import contextlib
    import io

    for path in model_files():
        for schedule, ranks, stages in CASES:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                lines = digests(path, schedule, ranks, stages)
            for line in lines:
                print(f"{os.path.relpath(path, REPO)} {schedule}: {line}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
