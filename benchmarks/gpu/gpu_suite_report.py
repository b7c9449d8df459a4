"""Bookkeeping for benchmarks/gpu_suite.sh: the suite's status file and the GPU tests' results.

    python -m benchmarks.gpu.gpu_suite_report env SUITE.json            # start the file: machine and versions
    python -m benchmarks.gpu.gpu_suite_report step SUITE.json N NAME RC SECONDS LIMIT
    python -m benchmarks.gpu.gpu_suite_report tests JUNIT.xml SUITE.json  # pass/fail per test, as gpu_tests

Torch-free except ``env`` (which imports torch and transformers for their versions), so a step's
record costs a fraction of a second and is written even when the step's own Python died.
"""
from __future__ import annotations

import json
import platform
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path


def _load(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {"steps": []}


def env(path: Path) -> None:
    doc = _load(path)
    doc["started"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    doc["python"] = platform.python_version()
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        doc["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        doc["nvidia_smi"] = f"unavailable ({type(exc).__name__})"
    versions = {}
    for name in ("torch", "transformers", "accelerate", "peft", "scipy", "numpy", "triton", "flash_attn"):
        try:
            versions[name] = __import__(name).__version__
        except Exception as exc:  # noqa: BLE001 - absent or broken: say which
            versions[name] = f"absent ({type(exc).__name__})"
    doc["versions"] = versions
    try:
        import torch

        doc["cuda"] = torch.version.cuda
        doc["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception as exc:  # noqa: BLE001
        doc["gpu"] = f"unknown ({type(exc).__name__})"
    path.write_text(json.dumps(doc, indent=1))
    print(json.dumps({k: doc[k] for k in ("nvidia_smi", "python", "versions")}))


def step(path: Path, number: str, name: str, rc: str, seconds: str, limit: str) -> None:
    doc = _load(path)
    code = int(rc)
    status = "passed" if code == 0 else ("timed out" if code in (124, 137) else "failed")
    doc["steps"] = [s for s in doc["steps"] if s["step"] != int(number)]
    doc["steps"].append({"step": int(number), "name": name, "status": status, "exit_code": code,
                         "wall_s": int(seconds), "limit_s": int(limit)})
    doc["steps"].sort(key=lambda s: s["step"])
    path.write_text(json.dumps(doc, indent=1))


def tests(junit: Path, out: Path) -> int:
    """Per-test outcome from pytest's JUnit XML into ``out``'s ``gpu_tests`` (the suite's status
    file: one file fewer for the device tool to bring back); returns the number of failed or
    errored tests."""
    rows = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (el.get("message") or el.text or "")[:800]
                break
        rows.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                     "time_s": float(case.get("time") or 0.0), "message": message})
    counts = {k: sum(r["outcome"] == k for r in rows) for k in ("passed", "failed", "error", "skipped")}
    doc = _load(out)
    doc["gpu_tests"] = {"counts": counts, "tests": rows}
    out.write_text(json.dumps(doc, indent=1))
    print(json.dumps(counts))
    return counts["failed"] + counts["error"]


def main(argv: list[str]) -> int:
    usage = __doc__.split("\n\n")[1]
    if not argv or argv[0] not in ("env", "step", "tests"):
        print(usage, file=sys.stderr)
        return 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "env" and len(rest) == 1:
        env(Path(rest[0]))
        return 0
    if cmd == "step" and len(rest) == 6:
        step(Path(rest[0]), *rest[1:])
        return 0
    if cmd == "tests" and len(rest) == 2:
        return 1 if tests(Path(rest[0]), Path(rest[1])) else 0
    print(usage, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
