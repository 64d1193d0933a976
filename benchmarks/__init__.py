"""The benchmark suite (``python -m benchmarks.run``) and the single-question benchmarks beside it."""
import json
import os
import time


def write_result(folder: str, name: str, record: dict) -> str:
    """Write ``record`` as ``folder/<YYYYmmdd-HHMMSS>_<name>.json`` (the results folder's naming), say where,
    and return the path."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{time.strftime('%Y%m%d-%H%M%S')}_{name}.json")
    with open(path, "w") as handle:
        json.dump(record, handle, indent=1)
    print(f"wrote {path}")
    return path
