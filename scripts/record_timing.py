"""Record the wall time of a demo or test-suite run to a JSON file under benchmarks/results/.

Used by scripts/demo.sh and scripts/test.sh, so every timing the README states has a file behind
it.  Writes the command's wall time and exit status, the machine (CPU count, load average at the
end: other jobs on the machine slow a run down), the Python/torch/transformers versions, and, when
given, the demo's summary (losses) or the pytest JUnit counts.

Usage: ``python scripts/record_timing.py {demo,tests} --wall-s S --rc N --out FILE
[--summary OUT/summary.json] [--junit JUNIT.xml] [--args "..."]``
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from pathlib import Path


def _versions() -> dict:
    out = {"python": platform.python_version()}
    for name in ("torch", "transformers"):
        try:
            out[name] = __import__(name).__version__
        except ImportError:
            out[name] = None
    return out


def _junit_counts(path: str) -> dict:
    import xml.etree.ElementTree as ET

    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    keys = ("tests", "failures", "errors", "skipped")
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in keys}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return counts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", choices=["demo", "tests"])
    p.add_argument("--wall-s", type=float, required=True)
    p.add_argument("--rc", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--summary", default=None, help="the demo's summary.json")
    p.add_argument("--junit", default=None, help="pytest's --junitxml file")
    p.add_argument("--args", default="", help="the arguments the run was given")
    a = p.parse_args(argv)
    record = {
        "what": a.what, "args": a.args, "wall_s": round(a.wall_s, 1), "exit_status": a.rc,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "load_average_1m_at_end": round(os.getloadavg()[0], 2)},
        "versions": _versions(),
    }
    if a.summary and Path(a.summary).is_file():
        s = json.loads(Path(a.summary).read_text())
        record["losses"] = s.get("losses")
        record["settings"] = s.get("settings")
    if a.junit and Path(a.junit).is_file():
        record["counts"] = _junit_counts(a.junit)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(record, indent=1) + "\n")
    print(f"recorded {a.what}: {record['wall_s']} s, exit status {a.rc} -> {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
