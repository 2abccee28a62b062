"""Pool the rounds of several ``benchmarks/overhead.py`` runs of the same code into one estimate.

    python benchmarks/pool_overhead.py benchmarks/results/A.json benchmarks/results/B.json \\
        --out benchmarks/results/pooled.json

On the 2-core dev VM one round's overhead varies by ~5% (std), so an interval of +-0.5% around a
mode's overhead takes ~400 rounds: longer than one sitting. Rounds are independent (each pairs a
mode's blocks with the ``none`` blocks beside it in time), so runs of the same benchmark on the
same code can be pooled: their blocks are put together, each run's rounds numbered apart, and
summarized exactly as one run's are (``overhead.summarize``: pooled mean step over ``none``'s,
95% bootstrap interval resampling rounds). Runs are pooled only when their configuration is the
same but for the number of rounds, and they name the same commit with no modified files; a run
that does not record its commit (older results) is refused unless ``--assume-same-code`` says
that the caller checked it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import overhead  # noqa: E402  (the benchmark next to this file)


class PoolError(ValueError):
    """The runs cannot be pooled (the message says which one and why)."""


def _comparable(config: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in config.items() if k != "rounds"}


def check_poolable(docs: dict[str, dict[str, Any]], *, assume_same_code: bool = False) -> None:
    """Raise :class:`PoolError` unless every run has the first one's configuration (rounds
    aside) and modes, and all name one unmodified commit (or ``assume_same_code``)."""
    if len(docs) < 2:
        raise PoolError(f"pooling needs at least two runs, got {len(docs)}")
    (first_name, first), *rest = docs.items()
    for name, doc in docs.items():
        if doc.get("benchmark") != "overhead":
            raise PoolError(f"{name} is not an overhead benchmark result")
    for name, doc in rest:
        if _comparable(doc["config"]) != _comparable(first["config"]):
            raise PoolError(f"{name} was run with another configuration than {first_name}: "
                            f"{_comparable(doc['config'])} against {_comparable(first['config'])}")
        if list(doc["modes"]) != list(first["modes"]):
            raise PoolError(f"{name} compares modes {list(doc['modes'])}, {first_name} "
                            f"{list(first['modes'])}")
    if assume_same_code:
        return
    for name, doc in docs.items():
        code = doc.get("code") or {}
        if "commit" not in code:
            raise PoolError(f"{name} does not record the commit it ran from; check that the runs "
                            "measured the same code and pass --assume-same-code")
        if code["modified"]:
            raise PoolError(f"{name} ran from a modified checkout of {code['commit'][:12]}")
    commits = {doc["code"]["commit"] for doc in docs.values()}
    if len(commits) > 1:
        raise PoolError(f"the runs name different commits ({', '.join(sorted(commits))}); "
                        "check that they measured the same code and pass --assume-same-code")


def pool(docs: dict[str, dict[str, Any]], *, assume_same_code: bool = False) -> dict[str, Any]:
    """The pooled summary of ``docs`` (name -> overhead.json contents) and what went in."""
    check_poolable(docs, assume_same_code=assume_same_code)
    blocks: list[dict[str, Any]] = []
    offset = 0
    for doc in docs.values():
        for b in doc["blocks"]:
            # Warm-up blocks (round -1) stay out of every summary; the others are renumbered.
            blocks.append({**b, "round": b["round"] + offset if b["round"] >= 0 else -1})
        offset += doc["config"]["rounds"]
    modes = list(next(iter(docs.values()))["modes"])
    summary = overhead.summarize(blocks, modes)
    bubble = summary["bubble"]["overhead"]
    return {
        "benchmark": "overhead-pooled",
        "runs": [{"file": name, "rounds": doc["config"]["rounds"], "command": doc["command"],
                  "code": doc.get("code"),
                  "bubble_overhead": doc["modes"]["bubble"]["overhead"]["pooled_mean"],
                  "bubble_overhead_ci95": doc["modes"]["bubble"]["overhead"]["ci95"]}
                 for name, doc in docs.items()],
        "assumed_same_code": assume_same_code,
        "rounds": offset,
        "modes": summary,
        "bubble_overhead": bubble["pooled_mean"],
        "bubble_overhead_ci95": bubble["ci95"],
        "bubble_overhead_le_1pct": overhead.at_most(0.01, bubble["ci95"]),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", help="overhead.json files of runs to pool")
    parser.add_argument("--out", required=True, help="where to write the pooled summary (JSON)")
    parser.add_argument("--assume-same-code", action="store_true",
                        help="pool runs that name different commits or none (checked by hand)")
    args = parser.parse_args(argv)
    docs = {}
    for name in args.results:
        try:
            docs[name] = json.loads(Path(name).read_text())
        except FileNotFoundError:
            parser.error(f"no such result file: {name}")
        except json.JSONDecodeError as e:
            parser.error(f"{name} is not JSON: {e}")
    try:
        doc = pool(docs, assume_same_code=args.assume_same_code)
    except PoolError as e:
        parser.error(str(e))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=2))
    print("\n".join(overhead.mode_table(doc["modes"])))
    for run in doc["runs"]:
        lo, hi = run["bubble_overhead_ci95"]
        print(f"  {run['file']}: {run['rounds']} rounds, bubble {run['bubble_overhead']:+.2%} "
              f"[{lo:+.2%}, {hi:+.2%}]")
    lo, hi = doc["bubble_overhead_ci95"]
    print(f"pooled, {doc['rounds']} rounds: bubble overhead {doc['bubble_overhead']:+.2%} "
          f"(95% CI [{lo:+.2%}, {hi:+.2%}]; <= 1%: {doc['bubble_overhead_le_1pct']})")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
