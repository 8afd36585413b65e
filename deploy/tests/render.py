"""Writes the chart's rendered objects for every test scenario to a folder, one
file per scenario, for command-line tools (kubernetes-validate, kubectl diff).

    python deploy/tests/render.py OUT_DIR
"""

import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_chart import SCENARIOS, render, strip  # noqa: E402


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for name, values in sorted(SCENARIOS.items()):
        objs = [strip(o) for o in render(values)]
        path = out / f"{name.removesuffix('.yaml')}.yaml"
        path.write_text(yaml.safe_dump_all(objs, sort_keys=False))
        print(f"{path}: {len(objs)} objects")


if __name__ == "__main__":
    main()
