"""A simulation's figures as a table and a plot: hit rate and goodput against KV memory, one line per mode (and
routing policy)."""

from __future__ import annotations

from collections import defaultdict

COLUMNS = (("mode", "mode", "{}"), ("policy", "policy", "{}"), ("kv_gib", "KV GiB/rank", "{:g}"),
           ("blocks", "blocks", "{:,}"), ("hit_rate", "hit rate", "{:.3f}"),
           ("prefill_saved", "prefill saved", "{:.1%}"), ("preemptions", "preemptions", "{:,}"),
           ("ttft_p50_s", "TTFT p50 s", "{:.3g}"), ("ttft_p99_s", "TTFT p99 s", "{:.3g}"),
           ("requests_per_s", "req/s", "{:.3g}"), ("goodput_rps", "goodput req/s", "{:.3g}"))


def table(runs: list[dict]) -> str:
    rows = [[title for _, title, _ in COLUMNS]]
    for run in runs:
        rows.append([("-" if run.get(key) is None else fmt.format(run[key])) for key, _, fmt in COLUMNS])
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                     for r in rows)


def trace_summary(trace: dict) -> str:
    """What was read of a trace: its format, requests, types and turns, and the notes the figures need."""
    lines = [f"trace: {trace['format']}, {trace['requests']:,} requests"
             + (f", blocks of {trace['hash_block_size']} tokens hashed" if trace["hash_block_size"] else "")]
    for key in ("types", "turns"):
        if trace[key]:
            lines.append(f"  {key}: " + ", ".join(f"{k} {v:,}" for k, v in trace[key].items()))
    lines += [f"  note: {note}" for note in trace["notes"]]
    return "\n".join(lines)


def groups(runs: list[dict]) -> str:
    """Hit rates per request type and turn of the trace, a line per run (where the trace has them)."""
    lines = []
    for run in runs:
        for key in ("by_type", "by_turn"):
            if run.get(key):
                lines.append(f"{run['mode']}, {run['policy']}, {run['blocks']:,} blocks: hit rate "
                             f"{key.replace('_', ' ')}: " + ", ".join(f"{k} {g['hit_rate']:.3f}"
                                                                       for k, g in run[key].items()))
    return "\n".join(lines)


def plot(runs: list[dict], path: str, title: str) -> None:
    """Hit rate and goodput against KV memory per rank (or blocks, when memory was not given), a line per mode and
    policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x_key = "kv_gib" if all(r.get("kv_gib") is not None for r in runs) else "blocks"
    lines: dict[str, list[dict]] = defaultdict(list)
    for run in runs:
        lines[f"{run['mode']} ({run['policy']})" if len({r['policy'] for r in runs}) > 1 else run["mode"]].append(run)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, (key, label) in zip(axes, (("hit_rate", "prefix-cache hit rate"), ("goodput_rps", "goodput (requests/s)"))):
        for name, points in lines.items():
            points = sorted(points, key=lambda r: r[x_key])
            ax.plot([p[x_key] for p in points], [p[key] for p in points], marker="o", label=name)
        ax.set_xlabel("KV memory per rank (GiB)" if x_key == "kv_gib" else "KV blocks per engine")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        if key == "hit_rate":
            ax.set_ylim(0, 1.02)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
