"""Run the test suite N times in a row while K CPU-bound processes run beside it.

The suite must hold on a busy machine: its waits are for events with scaled deadlines
(tests/waits.py), never for durations. This script is the proof::

    python benchmarks/under_load.py                   # 3 runs of the whole suite, 2 burners
    python benchmarks/under_load.py --runs 1 --burners 4 -- -m "not slow" tests/test_watch.py

Everything after ``--`` goes to pytest (default: the whole suite, ``-q``). Each run's time
and result is printed, and a summary at the end; the exit status is 1 if any run failed.
CI (``.ci/run``) runs the suite once, without load.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BURN = "while True: pass"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="runs of the suite (default 3)")
    parser.add_argument("--burners", type=int, default=2,
                        help="CPU-bound processes beside it (default 2)")  # fmt: skip
    parser.add_argument("pytest_args", nargs="*", help="after --: arguments for pytest")
    args = parser.parse_args(argv)
    command = [sys.executable, "-m", "pytest", *(args.pytest_args or ["-q"])]
    burners = [
        subprocess.Popen([sys.executable, "-c", BURN], stdin=subprocess.DEVNULL)
        for _ in range(args.burners)
    ]
    results: list[tuple[int, float]] = []
    try:
        for run in range(1, args.runs + 1):
            print(f"== run {run}/{args.runs} beside {args.burners} CPU burners: "
                  f"{' '.join(command[1:])}", flush=True)  # fmt: skip
            started = time.monotonic()
            code = subprocess.call(command, cwd=ROOT, env=os.environ.copy())
            results.append((code, time.monotonic() - started))
            print(f"== run {run}: exit {code} in {_minutes(results[-1][1])}, "
                  f"load average {os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip
    finally:
        for b in burners:
            b.kill()
            b.wait()
    print(f"\n{len(results)} runs beside {args.burners} CPU burners on {os.cpu_count()} CPUs:")
    for run, (code, seconds) in enumerate(results, 1):
        print(f"  run {run}: {'passed' if code == 0 else f'FAILED (exit {code})'} "
              f"in {_minutes(seconds)}")  # fmt: skip
    return 0 if all(code == 0 for code, _ in results) else 1


def _minutes(seconds: float) -> str:
    return f"{int(seconds // 60)} min {seconds % 60:.0f} s"


if __name__ == "__main__":
    sys.exit(main())
