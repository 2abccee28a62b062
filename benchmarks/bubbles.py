"""Measured bubble fraction per stage against the prediction, 2 stages x 1 thread, M in {2, 4, 8},
for 1F1B and GPipe.

    python benchmarks/bubbles.py                 # full size, writes benchmarks/results/bubbles.json
    python benchmarks/bubbles.py --tiny --out D  # seconds; what the test suite runs

For each microbatch count the same run is measured (idle waits recorded by the runtime) and
predicted twice: by timing the schedule with the run's own median stage times (sends free), and by
the closed form (P-1)/(M+P-1) for equal stages.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
from pathlib import Path

import torch

from bubbleguard.pipeline.schedules import build_schedule
from bubbleguard.report.bubbles import compare_bubbles
from bubbleguard.train import TrainConfig, run_local


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a few steps of a small model")
    parser.add_argument("--schedules", default="1f1b,gpipe", help="comma-separated schedules")
    parser.add_argument("--out", default="benchmarks/results", help="directory for bubbles.json")
    args = parser.parse_args()
    steps, width, rows_per_mb = (4, 32, 2) if args.tiny else (40, 256, 8)
    results = []
    for schedule, m in [(sc, m) for sc in args.schedules.split(",") for m in (2, 4, 8)]:
        with tempfile.TemporaryDirectory() as run_dir:
            cfg = TrainConfig(model="gpt", stages=2, microbatches=m, batch_size=rows_per_mb * m,
                              schedule=schedule, steps=steps,
                              model_options={"d_model": width, "num_layers": 4},
                              run_dir=run_dir, progress=False)
            run = run_local(cfg)
        # Skip the first quarter of the steps: allocator and cache warm-up.
        table, record = compare_bubbles(run.events, build_schedule(schedule, 2, m),
                                        skip_steps=max(1, steps // 4))
        print(table, flush=True)
        results.append({
            "schedule": schedule,
            "microbatches": m,
            "measured_fraction": [s["fraction"] for s in record["measured"]["stages"]],
            "predicted_fraction": [s["fraction"] for s in record["predicted"]["stages"]],
            "closed_form_fraction": record["closed_form_fraction"],
            "forward_s": record["forward_s"], "backward_s": record["backward_s"],
            "iteration_s": [s["iteration_s"] for s in record["measured"]["stages"]],
        })
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"benchmark": "bubbles", "stages": 2, "threads_per_rank": 1,
           "steps": steps, "d_model": width, "torch": torch.__version__,
           "machine": platform.machine(), "results": results}
    (out / "bubbles.json").write_text(json.dumps(doc, indent=2))
    print(f"\n{'schedule':>8} {'M':>3} {'stage':>5} {'measured':>9} {'predicted':>9} {'closed form':>11}")
    for r in results:
        for s in range(2):
            print(f"{r['schedule']:>8} {r['microbatches']:>3} {s:>5} {r['measured_fraction'][s]:9.1%} "
                  f"{r['predicted_fraction'][s]:9.1%} {r['closed_form_fraction']:11.1%}")
    print(f"written to {out / 'bubbles.json'}")


if __name__ == "__main__":
    main()
