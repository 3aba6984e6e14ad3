"""Generates the Grafana dashboard (``deploy/grafana/dashboards/freshrec.json``) from one list
of panels (``tools/grafana_panels.py``), so every query is in one reviewable place and a test
can check each metric it names against what the code exports.

    .venv/bin/python -m tools.grafana_dashboard      # rewrites the JSON
"""

from __future__ import annotations

import json
from pathlib import Path

from tools.grafana_panels import ROWS

OUT = Path(__file__).parents[1] / "deploy" / "grafana" / "dashboards" / "freshrec.json"
DS = {"type": "prometheus", "uid": "prometheus"}


def build() -> dict:
    panels = []
    y = 0
    pid = 1
    for row_title, row in ROWS:
        panels.append(
            {
                "type": "row",
                "title": row_title,
                "id": pid,
                "collapsed": False,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
            }
        )
        pid += 1
        y += 1
        x = 0
        for title, unit, targets, width in row:
            if x + width > 24:
                x, y = 0, y + 8
            panels.append(
                {
                    "type": "timeseries",
                    "title": title,
                    "id": pid,
                    "datasource": DS,
                    "gridPos": {"h": 8, "w": width, "x": x, "y": y},
                    "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                    "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
                    "targets": [
                        {
                            "datasource": DS,
                            "expr": expr,
                            "legendFormat": legend,
                            "refId": chr(65 + i),
                        }
                        for i, (expr, legend) in enumerate(targets)
                    ],
                }
            )
            pid += 1
            x += width
        y += 8
    return {
        "uid": "freshrec",
        "title": "FreshRec",
        "schemaVersion": 39,
        "version": 1,
        "refresh": "5s",
        "time": {"from": "now-15m", "to": "now"},
        "tags": ["freshrec"],
        "panels": panels,
        "templating": {"list": []},
        "annotations": {"list": []},
    }


def render() -> str:
    return json.dumps(build(), indent=2) + "\n"


if __name__ == "__main__":
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(render())
    print(f"wrote {OUT}")
