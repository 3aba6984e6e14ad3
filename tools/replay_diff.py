"""Two replays of the same log compared on the same interactions: an arm of replay A minus an
arm of replay B, HR@k and NDCG@k, with 95% intervals clustered by user
(``evaluation.metrics.paired_difference``). For settings that ``freshrec replay`` cannot put
in one run's arms (a storage dtype, a code change): run the replay once per setting, with the
same log, ``--sample`` and ``--seed``, then

    python -m tools.replay_diff .freshrec/replay/A .freshrec/replay/B --arm full

Each folder is a replay's ``--out`` (its ``replay_interactions.csv.gz``). The replays must
have scored the same interactions in the same order (same log, sample and seed), or it says
so. Results are printed and written to ``artifacts/replay_diff.json``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from evaluation.metrics import paired_difference
from freshrec.app.replay.report import INTERACTIONS, read_interactions
from tools.benchlib import save


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a", type=Path, help="replay A's output folder")
    ap.add_argument("b", type=Path, help="replay B's output folder")
    ap.add_argument("--arm", default="full", help="A's arm (default: full)")
    ap.add_argument("--against", default=None, help="B's arm (default: --arm)")
    ap.add_argument("--out", type=Path, default=Path("artifacts"))
    args = ap.parse_args(argv)
    against = args.against or args.arm
    try:
        a = read_interactions(args.a / INTERACTIONS, args.arm)
        b = read_interactions(args.b / INTERACTIONS, against)
        a.name, b.name = f"A:{args.arm}", f"B:{against}"
        result = {m: paired_difference(a, b, m) for m in ("hr", "ndcg")}
    except (OSError, KeyError, ValueError) as exc:
        print(f"replay_diff: {exc}", file=sys.stderr)
        return 2
    mean = {m: round(sum(a.per_interaction[m]) / len(a.users), 4) for m in result}
    mean_b = {m: round(sum(b.per_interaction[m]) / len(b.users), 4) for m in result}
    for m, d in result.items():
        print(
            f"{m.upper()}: A {mean[m]:.4f}, B {mean_b[m]:.4f}, A − B {d['diff']:+.4f} "
            f"({d['low']:+.4f}..{d['high']:+.4f}) over {d['interactions']:,} interactions "
            f"of {d['users']:,} users"
        )
    save(
        "replay_diff",
        {
            "a": str(args.a),
            "b": str(args.b),
            "arm": args.arm,
            "against": against,
            "a_mean": mean,
            "b_mean": mean_b,
            "diff": result,
        },
        args.out,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
