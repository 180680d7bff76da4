"""Node-loss drill recovery: wall time from the node loss to the first completed iteration after it, per
variant of scripts/node_loss_drill.py, and each variant's ratio to variant a (resume from replicas) run
in the same benchmark.

    python benchmarks/bench_drill.py [--variants abcd] [--repeats 1] [--json OUT]

The drill itself measures the time (its drill_summary.json: `recovery_s`, from the node-loss event it
writes into the run's event log to the first `progress` event after it) and also reports restarts,
iterations recomputed and wall time lost. Variants run one after another, interleaved across repeats
(a b c d, a b c d, ...), so that slow phases of this shared machine fall on all of them alike.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DRILL = REPO / "scripts" / "node_loss_drill.py"


def run_drill(variant: str, workdir: Path) -> dict:
    subprocess.run([sys.executable, str(DRILL), "--variant", variant, "--workdir", str(workdir)], cwd=REPO,
                   stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, timeout=900)
    summary = json.loads((workdir / "drill_summary.json").read_text())
    print(f"[bench] variant {variant}: {summary}", flush=True)
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variants", default="abcd")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--json", default=None)
    opts = parser.parse_args()
    results: dict[str, list[dict]] = {v: [] for v in opts.variants}
    with tempfile.TemporaryDirectory(prefix="bench-drill-") as tmp:
        for repeat in range(opts.repeats):
            for variant in opts.variants:
                results[variant].append(run_drill(variant, Path(tmp) / f"{variant}{repeat}"))
    base = statistics.median(r["recovery_s"] for r in results["a"]) if "a" in results else None
    print("\nvariant  passed  recovery_s (median, runs)  ratio to a  restarts  recomputed  lost_s  exit")
    table = {}
    for variant, runs in results.items():
        recovery = statistics.median(r["recovery_s"] for r in runs)
        table[variant] = {"recovery_s": recovery, "runs": [r["recovery_s"] for r in runs],
                          "ratio_to_a": round(recovery / base, 2) if base else None,
                          "restarts": [r["restarts"] for r in runs],
                          "recomputed": [r["recomputed"] for r in runs],
                          "lost_s": [r["lost_s"] for r in runs], "exit_code": [r["exit_code"] for r in runs],
                          "passed": all(r["passed"] for r in runs)}
        row = table[variant]
        print(f"{variant:7}  {str(row['passed']):6}  {recovery:6.1f} {row['runs']}  {row['ratio_to_a']}  "
              f"{row['restarts']}  {row['recomputed']}  {row['lost_s']}  {row['exit_code']}")
    if opts.json:
        Path(opts.json).write_text(json.dumps(table, indent=1) + "\n")
    return 0 if all(row["passed"] for row in table.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
