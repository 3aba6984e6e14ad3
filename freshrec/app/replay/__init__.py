"""``freshrec replay PATH``: prequential evaluation of FreshRec on an interaction log, arm by
arm through the live pipeline, beside reference baselines computed in-process on exactly the
same interactions (``docs/replay.md``).

1. Read the log (``inference/training/interactions.py``) and cut it at ``--train-share`` by time.
2. Train the starting models on the part before the cut (``freshrec train --log``; cached in
   ``OUT/models`` for the same log part and settings: ``models.py``).
3. For each live arm (``arms.py``): ``frozen`` (the whole pipeline, learning rates 0),
   ``local`` (no parameter server), ``full``; each on a fresh stack.
4. The baselines (``evaluation/baselines.py``), their settings chosen on the training part
   (``evaluation/prequential.tune``; ``baselines.py``).
5. The table, CSV files, a JSON report and the HR@k plot (``report.py``).

The command line is ``options.py``, the steps above ``command.py``; ``--tune`` is
``tuning.py``. A live arm's parts: what every arm replays (``data.py``), what it produces
(``feed.py``), the training part before its worker starts (``history.py``) and the replayed
steps (``steps.py``).
"""

from freshrec.app.replay.baselines import BASELINES
from freshrec.app.replay.command import cmd_replay
from freshrec.app.replay.options import add_parser

__all__ = ["BASELINES", "add_parser", "cmd_replay"]
