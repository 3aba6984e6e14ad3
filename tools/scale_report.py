"""The report of ``tools/bench_scale.py``: a point's one-line summary, the Markdown tables
of every point (cost against size, and the cache's levels) and the plot of cost against
size."""

from __future__ import annotations

from pathlib import Path


def line(p: dict) -> str:
    return (
        f"{p['items']:,} items / {p['users']:,} users: Redis {p['redis_bytes_per_row']} B/row, "
        f"worker {p['worker_rss_mb']} MB, vector recall {p['vector_recall_ms']} ms "
        f"({p['vector_index']}), request p99 {p['request_p99_ms']} ms, "
        f"parameter server {p['param_server_rows_per_s']:,} rows/s; {levels_line(p)}"
    )


def levels_line(p: dict) -> str:
    c = p["cache_levels"]
    return f"user lookups (device {c['device_rows']:,} rows): " + "; ".join(
        f"host RAM {x['host_rows']:,}: Redis {x['redis_share'] + x['new_share']:.1%} of ids, "
        f"{x['redis_trips_per_batch']} trips and {x['lookup_mean_ms']} ms a batch"
        for x in c["configs"]
    )


def table(results: dict) -> str:
    rows = [
        "| items | users | Redis bytes/row | worker memory (MB) | vector recall, 32 users (ms) "
        "| request p50 / p99 (ms) | parameter server (rows/s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in results["points"]:
        rows.append(
            f"| {p['items']:,} | {p['users']:,} | {p['redis_bytes_per_row']} | "
            f"{p['worker_rss_mb']} | {p['vector_recall_ms']} ({p['vector_index']}) | "
            f"{p['request_p50_ms']} / {p['request_p99_ms']} | {p['param_server_rows_per_s']:,} |"
        )
    rows += [
        "",
        "| items | users | device / host RAM rows | hit rate device / host / Redis+new "
        "| Redis round trips a batch | lookup of 32 users, mean / p99 (ms) |",
        "|---|---|---|---|---|---|",
    ]
    for p in results["points"]:
        c = p["cache_levels"]
        for x in c["configs"]:
            rows.append(
                f"| {p['items']:,} | {p['users']:,} | {c['device_rows']:,} / {x['host_rows']:,} | "
                f"{x['device_share']:.1%} / {x['host_share']:.1%} / "
                f"{x['redis_share'] + x['new_share']:.1%} | {x['redis_trips_per_batch']} | "
                f"{x['lookup_mean_ms']} / {x['lookup_p99_ms']} |"
            )
    return "\n".join(rows)


def plot(results: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = results["points"]
    x = [p["items"] for p in pts]
    panels = [
        ("worker memory (MB)", "worker_rss_mb"),
        ("vector recall, 32 users (ms)", "vector_recall_ms"),
        ("request p99 (ms)", "request_p99_ms"),
        ("parameter server (rows/s)", "param_server_rows_per_s"),
        ("Redis bytes per row", "redis_bytes_per_row"),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.4))
    for ax, (title, key) in zip(axes, panels, strict=True):
        ax.plot(x, [p[key] for p in pts], marker="o")
        ax.set_xscale("log")
        ax.set_ylim(bottom=0)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("items (users ×10)")
        ax.grid(alpha=0.3)
    fig.suptitle("FreshRec: cost against catalogue and user-table size", fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
