"""Find flaky tests before a stop: the fast tier three times in a row, then the test modules a change
touches twice, each run's outcome per test compared across runs.

    .venv/bin/python scripts/check_flaky.py                 # against the upstream branch (or HEAD~1)
    .venv/bin/python scripts/check_flaky.py --base 2e36fe3  # against a commit
    .venv/bin/python scripts/check_flaky.py --modules tests/test_workers.py --module-runs 3

A module is touched when the change edits it or edits a module it imports by name (the product's
``connector/``, ``language_side/`` ... and the tests' helpers). A test that fails in some runs and
passes in others is flaky; one that fails in every run is broken. Exit status 1 when any test failed.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYTEST = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2"]


def changed_files(base: str) -> list[str]:
    """Files the working tree changes against ``base`` (committed or not), and new untracked ones."""
    diff = subprocess.run(["git", "diff", "--name-only", base], cwd=ROOT, capture_output=True, text=True, check=True)
    new = subprocess.run(["git", "ls-files", "--others", "--exclude-standard"], cwd=ROOT, capture_output=True,
                         text=True, check=True)
    return sorted({*diff.stdout.split(), *new.stdout.split()})


def default_base() -> str:
    upstream = subprocess.run(["git", "rev-parse", "--verify", "-q", "@{upstream}"], cwd=ROOT, capture_output=True,
                              text=True)
    return upstream.stdout.strip() or "HEAD~1"


def touched_modules(changed: list[str]) -> list[str]:
    """Test modules that ``changed`` edits, or that import (by dotted name) a Python module it edits."""
    names = set()
    for path in changed:
        if path.endswith(".py") and Path(ROOT / path).exists():
            parts = Path(path).with_suffix("").parts
            names.add(".".join(parts))
            if parts[0] in ("tests", "scripts"):
                names.add(parts[-1])  # the tests import their helpers and the scripts by bare name
    touched = set()
    for module in sorted((ROOT / "tests").glob("test_*.py")):
        relative = str(module.relative_to(ROOT))
        text = module.read_text()
        imported = set(re.findall(r"^\s*(?:from|import)\s+([\w.]+)", text, re.MULTILINE))
        if relative in changed or imported & names or any(n.startswith(f"{i}.") for n in names for i in imported):
            touched.add(relative)
    return sorted(touched)


def run(label: str, args: list[str]) -> dict[str, str]:
    """One pytest run; each test's outcome ("passed", "failed", "skipped") by its id."""
    with tempfile.NamedTemporaryFile(suffix=".xml") as report:
        started = time.monotonic()
        print(f"[{label}] {' '.join(args)}", flush=True)
        done = subprocess.run([*PYTEST, f"--junitxml={report.name}", *args], cwd=ROOT, capture_output=True, text=True)
        summary = (done.stdout.strip().splitlines() or ["(no output)"])[-1]
        print(f"[{label}] {summary} ({time.monotonic() - started:.0f} s)", flush=True)
        outcomes = {}
        for case in ET.parse(report.name).iter("testcase"):
            outcome = "passed"
            if case.find("failure") is not None or case.find("error") is not None:
                outcome = "failed"
            elif case.find("skipped") is not None:
                outcome = "skipped"
            outcomes[f"{case.get('classname')}::{case.get('name')}"] = outcome
        return outcomes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", help="the commit the change is measured against (default: upstream, or HEAD~1)")
    parser.add_argument("--modules", nargs="*", help="test modules to run repeatedly (default: those touched)")
    parser.add_argument("--fast-runs", type=int, default=3, help="runs of the fast tier (default 3)")
    parser.add_argument("--module-runs", type=int, default=2, help="runs of the touched modules (default 2)")
    args = parser.parse_args()
    modules = args.modules
    if modules is None:
        base = args.base or default_base()
        modules = touched_modules(changed_files(base))
        print(f"modules touched since {base}: {' '.join(modules) or 'none'}", flush=True)
    results: dict[str, list[str]] = defaultdict(list)
    for i in range(args.fast_runs):
        for test, outcome in run(f"fast {i + 1}/{args.fast_runs}", ["-m", "fast"]).items():
            results[test].append(outcome)
    if modules:
        for i in range(args.module_runs):
            touched = run(f"touched {i + 1}/{args.module_runs}", ["--dist", "loadfile", *modules])
            for test, outcome in touched.items():
                results[test].append(outcome)
    flaky = sorted(t for t, o in results.items() if "failed" in o and "passed" in o)
    broken = sorted(t for t, o in results.items() if "failed" in o and "passed" not in o)
    for name, tests in (("flaky", flaky), ("broken", broken)):
        for test in tests:
            print(f"{name}: {test} ({' '.join(results[test])})")
    print(f"check_flaky tests={len(results)} flaky={len(flaky)} broken={len(broken)}")
    return 1 if flaky or broken else 0


if __name__ == "__main__":
    sys.exit(main())
