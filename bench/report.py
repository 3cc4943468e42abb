#!/usr/bin/env python3
"""Turns the JSON of a bench/compare.sh run into docs/benchmarks.md and an SVG chart.

    bench/report.py --results bench/results/<time> --out docs/benchmarks.md --chart bench/benchmarks.svg
    bench/report.py --summarize bench/results/<time>/s1-A-1.json     # one line per run, for the log

Standard library only.
"""

import argparse
import glob
import html
import json
import os
import statistics
import sys

SCENARIOS = {
    "s6": "6. {idle_queues:,} idle queues: broker memory per queue, declare rate",
    "s7": "7. {idle_connections:,} idle connections (one channel each): broker memory per connection",
    "s1": "1. 1 producer -> 1 queue -> 1 consumer, 16 B transient, manual ack, prefetch 200, unthrottled",
    "s1r": "1 at a fixed 5,000 msg/s: broker CPU per message",
    "s2": "2. 1 -> 1, 1 KiB persistent, durable queue, confirms (window 1000), unthrottled",
    "s2r": "2 at a fixed 5,000 msg/s: broker CPU per message",
    "s3": "3. Fan-out: 1 producer -> fanout exchange -> 10 queues -> 10 consumers, 16 B",
    "s4": "4. 10 producers -> 10 queues -> 10 consumers, 1 KiB",
    "s5": "5. Latency at a fixed 10,000 msg/s, 1 KiB, 1 -> 1",
    "s8": "8. Backlog: publish {backlog:,} x 1 KiB with no consumer, then drain",
    "s9": "9. 1 at a fixed 5,000 msg/s with a worker-style consumer (each ack written before the next "
          "message): broker CPU per message",
    "s10": "10. Producer faster than the consumer: unthrottled 1 KiB publishes, a worker-style consumer "
           "limited to 5,000 msg/s, no in-flight cap (the queue grows for the whole run)",
    "s11": "11. Scenario 1 on a queue with x-message-ttl (60 s) and a dead-letter exchange",
    "s11r": "11 at a fixed 5,000 msg/s: broker CPU per message",
    "s12": "12. 1,000 connections, 100 of them workers as in 9 (each ack written before the next message) "
           "fed by 100 producers at 50 msg/s each (5,000 msg/s in all) on 100 queues, 800 idle: broker "
           "CPU per message",
}


def describe(scen, meta):
    counts = {k: meta.get(k) or 0 for k in ("idle_queues", "idle_connections", "backlog")}
    return SCENARIOS[scen].format(**counts)


# Targets of issue 3, as "times better than RabbitMQ" (>= this).
TARGETS = {
    ("s1", "consume_rate"): 3,
    ("s1r", "cpu_us"): 5,
    ("s2r", "cpu_us"): 5,
    ("s3", "consume_rate"): 2,
    ("s4", "consume_rate"): 2,
    ("s5", "cpu_us"): 5,
    ("s5", "p99"): 3,
    ("s6", "per_item"): 10,
    ("s7", "per_item"): 10,
}


def get(d, *path):
    for p in path:
        if d is None:
            return None
        d = d.get(p) if isinstance(d, dict) else None
    return d


def ms(us):
    return None if us is None else us / 1000.0


def kb(b):
    return None if b is None else b / 1000.0


def metrics_of(scen, run, drain=None):
    """(key, label, unit, better, value) for one run of a scenario."""
    m = []

    def add(key, label, unit, better, value):
        m.append((key, label, unit, better, value))

    cpu = get(run, "broker", "cpu_us_per_msg")
    if scen in ("s1", "s2", "s3", "s4", "s11"):
        add("consume_rate", "consume rate", "msg/s", "higher", run.get("consume_rate"))
        add("publish_rate", "publish rate", "msg/s", "higher", run.get("publish_rate"))
        if scen == "s2":
            add("confirm_p99", "confirm latency p99", "ms", "lower", ms(get(run, "confirm_latency", "p99_us")))
        add("cpu_us", "broker CPU per message", "us", "lower", cpu)
    elif scen in ("s1r", "s2r", "s5", "s9", "s11r", "s12"):
        add("cpu_us", "broker CPU per message", "us", "lower", cpu)
        add("consume_rate", "consume rate", "msg/s", "higher", run.get("consume_rate"))
        add("p50", "latency p50", "ms", "lower", ms(get(run, "latency", "p50_us")))
        if scen == "s5":
            add("p95", "latency p95", "ms", "lower", ms(get(run, "latency", "p95_us")))
        add("p99", "latency p99", "ms", "lower", ms(get(run, "latency", "p99_us")))
        if scen == "s5":
            add("max", "latency max", "ms", "lower", ms(get(run, "latency", "max_us")))
        if scen == "s2r":
            add("confirm_p99", "confirm latency p99", "ms", "lower", ms(get(run, "confirm_latency", "p99_us")))
    elif scen == "s10":
        b = get(run, "broker") or {}
        backlog = run.get("backlog_end")
        add("publish_rate", "publish rate", "msg/s", "higher", run.get("publish_rate"))
        add("consume_rate", "consume rate, of the 5,000 the worker asks for", "msg/s", "higher", run.get("consume_rate"))
        # How fast the queue grew and what it held at the end follow from the two rates: context,
        # not a score.
        add("growth", "queue growth", "msg/s", None, run.get("backlog_growth_rate"))
        add("backlog", "messages queued at the end", "msg", None, backlog)
        add("cpu_us", "broker CPU per message published", "us", "lower", b.get("cpu_us_per_published"))
        add("rss_end", "broker RSS at the end", "MiB", None,
            b["rss_end_kb"] / 1024 if "rss_end_kb" in b else None)
        grown = b.get("rss_end_kb", 0) - b.get("rss_start_kb", 0) if b else None
        add("per_queued", "broker memory growth per queued message", "B", "lower",
            grown * 1024 / backlog if grown is not None and backlog and backlog > 0 else None)
    elif scen in ("s6", "s7"):
        what = "queue" if scen == "s6" else "connection"
        # The second half's growth is the steadier figure (the first half soaks up memory the
        # allocator kept from earlier runs); older results only have the overall one.
        add("per_item", f"broker memory per {what}", "KB", "lower", kb(run.get("bytes_per_item")))
        if "bytes_per_item_second_half" in run:
            add("per_item_2nd", f"broker memory per {what}, second half only", "KB", "lower",
                kb(run.get("bytes_per_item_second_half")))
        add("create_rate", "declare rate" if scen == "s6" else "connection open rate", f"{what}s/s", "higher", run.get("create_rate"))
    elif scen == "s8":
        add("publish_rate", "publish rate", "msg/s", "higher", run.get("publish_rate"))
        if drain is not None:
            add("drain_rate", "drain rate", "msg/s", "higher", drain.get("consume_rate"))
        peaks = [get(r, "broker", "rss_peak_kb") for r in (run, drain) if r is not None]
        peaks = [p for p in peaks if p is not None]
        add("peak_rss", "broker peak RSS", "MiB", "lower", max(peaks) / 1024 if peaks else None)
        pub_cpu = get(run, "broker", "cpu_us_per_msg")
        add("cpu_us", "broker CPU per message (publish)", "us", "lower", pub_cpu)
    return m


def load(path):
    try:
        with open(path) as f:
            txt = f.read().strip()
        return json.loads(txt) if txt else None
    except (OSError, ValueError):
        return None


def collect(results):
    """{scen: {side: [metrics list per pair]}}, {scen: {side: [errors]}}"""
    data, errors = {}, {}
    for path in sorted(glob.glob(os.path.join(results, "*.json"))):
        name = os.path.basename(path)[:-5]
        parts = name.split("-")
        if len(parts) != 3 or parts[1] not in ("A", "B"):
            continue
        scen, side, pair = parts
        if scen == "s8d":
            continue
        run = load(path)
        drain = None
        if scen == "s8p":
            scen = "s8"
            drain = load(os.path.join(results, f"s8d-{side}-{pair}.json"))
        errs = []
        if run is None:
            errs.append(f"{name}: no result")
            run = {}
        errs += [f"{name}: {e}" for e in run.get("errors", [])]
        if scen == "s8" and drain is not None:
            errs += [f"s8d-{side}-{pair}: {e}" for e in drain.get("errors", [])]
        data.setdefault(scen, {}).setdefault(side, []).append((int(pair), metrics_of(scen, run, drain)))
        errors.setdefault(scen, {}).setdefault(side, []).extend(errs)
    return data, errors


def median_table(data):
    """[(scen, key, label, unit, better, medA, medB, valsA, valsB)]"""
    rows = []
    order = [s for s in SCENARIOS if s in data]
    for scen in order:
        sides = data[scen]
        template = None
        for side in ("A", "B"):
            for _, ms_ in sides.get(side, []):
                template = template or ms_
        if not template:
            continue
        for i, (key, label, unit, better, _) in enumerate(template):
            vals = {}
            for side in ("A", "B"):
                vals[side] = [m[i][4] for _, m in sorted(sides.get(side, [])) if i < len(m) and m[i][4] is not None]
            med = {s: (statistics.median(v) if v else None) for s, v in vals.items()}
            rows.append((scen, key, label, unit, better, med["A"], med["B"], vals["A"], vals["B"]))
    return rows


def advantage(better, a, b):
    """How many times better B is than A (> 1 means B is better); None for context rows."""
    if a is None or b is None or better not in ("higher", "lower"):
        return None
    if better == "higher":
        return b / a if a > 0 else None
    return a / b if b > 0 else None


def fmt(v, unit=""):
    if v is None:
        return "n/a"
    if abs(v) >= 100:
        s = f"{v:,.0f}"
    elif abs(v) >= 10:
        s = f"{v:.1f}"
    else:
        s = f"{v:.2f}"
    return s


def fmt_short(v):
    """Compact number for chart labels: 15.3k, 1.2M."""
    if v is None:
        return "n/a"
    if abs(v) >= 1e6:
        return f"{v / 1e6:.1f}M"
    if abs(v) >= 1e4:
        return f"{v / 1e3:.1f}k"
    return fmt(v)


def summarize(path):
    r = load(path)
    if r is None:
        print(f"  {os.path.basename(path)}: no result")
        return
    name = os.path.basename(path)[:-5]
    scen = name.split("-")[0]
    scen = "s8" if scen in ("s8p", "s8d") else scen
    parts = []
    ms_ = metrics_of(scen, {}, r) if name.startswith("s8d") else metrics_of(scen, r)
    for _, label, unit, _, v in ms_:
        if v is not None:
            parts.append(f"{label} {fmt(v)} {unit}")
    errs = r.get("errors", [])
    print(f"  {name}: " + ", ".join(parts) + (f"  ERRORS: {errs}" if errs else ""))


# ------------------------------------------------------------------------------ SVG chart

PANELS = [
    ("Throughput (msg/s, higher is better)", [
        ("s1", "consume_rate", "1: 1->1 16 B"),
        ("s2", "consume_rate", "2: persistent+confirms"),
        ("s3", "consume_rate", "3: fan-out x10"),
        ("s4", "consume_rate", "4: 10x10 1 KiB"),
        ("s8", "publish_rate", "8: backlog publish"),
        ("s8", "drain_rate", "8: backlog drain"),
        ("s11", "consume_rate", "11: 1 with TTL+DLX"),
    ]),
    ("Broker CPU per message (us, lower is better)", [
        ("s1r", "cpu_us", "1 @ 5k msg/s"),
        ("s2r", "cpu_us", "2 @ 5k msg/s"),
        ("s5", "cpu_us", "5 @ 10k msg/s"),
        ("s9", "cpu_us", "9: 1 @ 5k, ack-wait worker"),
        ("s12", "cpu_us", "12: 100 workers of 1,000 conns"),
        ("s11r", "cpu_us", "11: TTL+DLX @ 5k"),
    ]),
    ("Latency at 10,000 msg/s, 1 KiB (ms, lower is better)", [
        ("s5", "p50", "p50"),
        ("s5", "p95", "p95"),
        ("s5", "p99", "p99"),
        ("s5", "max", "max"),
    ]),
    ("Broker memory (lower is better)", [
        ("s6", "per_item", "KB per idle queue"),
        ("s7", "per_item", "KB per idle connection"),
        ("s8", "peak_rss", "MiB peak, backlog"),
        ("s10", "per_queued", "B per queued msg, growing queue"),
    ]),
]

COLORS = ("#f28e2b", "#4e79a7")  # A (RabbitMQ orange), B (Warren blue)


def svg_chart(rows, a_name, b_name, title):
    by_key = {(r[0], r[1]): r for r in rows}
    pw, ph = 470, 300  # panel size
    cols = 2
    width = cols * pw + 20
    height = 70 + 2 * (ph + 30)
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="{width / 2}" y="22" text-anchor="middle" font-size="15" font-weight="bold">{html.escape(title)}</text>',
    ]
    # Legend.
    lx = width / 2 - 150
    for i, name in enumerate((a_name, b_name)):
        x = lx + i * 170
        out.append(f'<rect x="{x}" y="34" width="12" height="12" fill="{COLORS[i]}"/>')
        out.append(f'<text x="{x + 17}" y="44">{html.escape(name)}</text>')
    out.append(
        f'<text x="{width / 2}" y="62" text-anchor="middle" fill="#555">'
        "Medians. Each pair of bars is scaled to its larger value; the label above a group is how many "
        "times better the second broker is.</text>"
    )
    for p, (ptitle, groups) in enumerate(PANELS):
        px = 10 + (p % cols) * pw
        py = 75 + (p // cols) * (ph + 30)
        out.append(f'<rect x="{px}" y="{py}" width="{pw - 10}" height="{ph}" fill="#fafafa" stroke="#ddd"/>')
        out.append(f'<text x="{px + 10}" y="{py + 18}" font-weight="bold">{html.escape(ptitle)}</text>')
        n = len(groups)
        gw = (pw - 30) / n
        base = py + ph - 45
        top = py + 50
        for g, (scen, key, label) in enumerate(groups):
            gx = px + 10 + g * gw
            r = by_key.get((scen, key))
            a = r[5] if r else None
            b = r[6] if r else None
            vmax = max([v for v in (a, b) if v is not None] or [0])
            bw = min(34, gw / 3)
            for i, v in enumerate((a, b)):
                x = gx + gw / 2 - bw + i * bw
                if v is None or vmax <= 0:
                    out.append(f'<text x="{x + bw / 2}" y="{base - 4}" text-anchor="middle" fill="#999">n/a</text>')
                    continue
                h = (base - top) * (v / vmax)
                out.append(f'<rect x="{x:.1f}" y="{base - h:.1f}" width="{bw - 2:.1f}" height="{h:.1f}" fill="{COLORS[i]}"/>')
                out.append(
                    f'<text x="{x + bw / 2 - 1:.1f}" y="{base - h - 3:.1f}" text-anchor="middle" font-size="9">{fmt_short(v)}</text>'
                )
            if r:
                adv = advantage(r[4], a, b)
                if adv is not None:
                    out.append(
                        f'<text x="{gx + gw / 2:.1f}" y="{top - 14}" text-anchor="middle" font-weight="bold" '
                        f'fill="{"#2a7" if adv >= 1 else "#c33"}">{adv:.2f}x</text>'
                    )
            # Label, wrapped on two lines if long.
            words = label.split(" ")
            lines, cur = [], ""
            for w in words:
                if len(cur) + len(w) + 1 > max(8, int(gw / 6)) and cur:
                    lines.append(cur)
                    cur = w
                else:
                    cur = (cur + " " + w).strip()
            lines.append(cur)
            for li, text in enumerate(lines[:3]):
                out.append(
                    f'<text x="{gx + gw / 2:.1f}" y="{base + 14 + li * 12}" text-anchor="middle">{html.escape(text)}</text>'
                )
        out.append(f'<line x1="{px + 5}" y1="{base}" x2="{px + pw - 15}" y2="{base}" stroke="#888"/>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------------------ markdown


def fresh_note(meta):
    """How the idle scenarios avoided (or did not avoid) memory kept from earlier runs."""
    fresh = meta.get("fresh_for_idle", {})
    a, b = meta.get("a_name", "A"), meta.get("b_name", "B")
    restarted = [n for n, side in ((a, "A"), (b, "B")) if fresh.get(side)]
    kept = [n for n, side in ((a, "A"), (b, "B")) if not fresh.get(side)]
    text = ""
    if restarted:
        text += (
            f"{' and '.join(restarted)} {'was' if len(restarted) == 1 else 'were'} restarted before each "
            "idle-scenario run, so that memory the allocator kept from the previous run could not make an "
            "item look free. "
        )
    if kept:
        text += (
            f"{' and '.join(kept)} {'was' if len(kept) == 1 else 'were'} not restarted (shared with other "
            "users of this machine): memory freed by earlier scenarios may be reused, which tends to make "
            f"{'its' if len(kept) == 1 else 'their'} per-item figures lower than from a fresh start. "
        )
    return text


def load_notes(path):
    """Hand-written analysis kept outside the generated report (HTML comments dropped)."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return ""
    while "<!--" in text and "-->" in text:
        start = text.index("<!--")
        end = text.index("-->", start) + 3
        text = text[:start] + text[end:]
    return text.strip()


def latest_deep_summary(bench_dir, name="deep-queue.md"):
    """A hand-kept summary beside this script (bench/deep-queue.md from bench/deep-queue.sh,
    bench/delayed.md from bench/delayed.sh), without its title, if any."""
    path = os.path.join(bench_dir, name)
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None, ""
    # Its title becomes a section of this report.
    lines = text.splitlines()
    if lines and lines[0].startswith("# "):
        lines = lines[1:]
    return path, "\n".join(lines).strip()


def report(results, out_path, chart_path, notes_path=None):
    meta = load(os.path.join(results, "meta.json")) or {}
    data, errors = collect(results)
    rows = median_table(data)
    a_name = meta.get("a_name", "A")
    b_name = meta.get("b_name", "B")
    pairs = meta.get("pairs", "?")
    mach = meta.get("machine", {})

    title = f"{b_name} vs {a_name}"
    with open(chart_path, "w") as f:
        f.write(svg_chart(rows, a_name, b_name, title))

    L = []
    L.append(f"# Benchmarks: {b_name} vs {a_name}")
    L.append("")
    L.append(
        f"Generated by `bench/compare.sh` from {meta.get('start', '?')} to {meta.get('end', '?')}; "
        f"Warren at commit `{meta.get('git_rev', '?')}`. Every scenario ran {pairs} time(s) on each broker, "
        f"alternately ({a_name}, {b_name}, {a_name}, {b_name}, ...); the tables show medians."
    )
    L.append("")
    if meta.get("self_test"):
        L.append(
            "> **Pipeline self-test: both sides are the same RabbitMQ.** These figures only show that the "
            "scripts work; ratios should be close to 1."
        )
        L.append("")
    if meta.get("quick"):
        L.append(
            f"> **Quick mode** ({meta.get('duration_s')} s runs, {meta.get('backlog'):,} backlog messages, "
            f"{meta.get('idle_queues'):,} idle queues, {meta.get('idle_connections'):,} idle connections): "
            "a smoke test, not a measurement."
        )
        L.append("")
    for note in meta.get("notes", []):
        L.append(f"> **Note:** {note}")
        L.append("")
    busy = meta.get("max_busy", 0)
    if busy:
        L.append(
            f"> **Noisy run:** up to {busy} cargo/rustc processes were running during the measurements "
            f"(load average at the start {meta.get('load_at_start', '?')}). Treat throughput figures with care; "
            "CPU per message holds up better."
        )
        L.append("")

    L.append("## Machine")
    L.append("")
    L.append("| | |")
    L.append("|---|---|")
    broker_cpus, bench_cpus = meta.get("broker_cpus") or "", meta.get("bench_cpus") or ""
    if broker_cpus or bench_cpus:
        placement = (f"brokers on CPU {broker_cpus or 'any'}, load generator on CPU {bench_cpus or 'any'} "
                     "(taskset)")
    else:
        placement = "shared by both brokers and the load generator"
    L.append(f"| CPU | {mach.get('cpu', '?')}, {mach.get('nproc', '?')} cores ({placement}) |")
    L.append(f"| Memory | {mach.get('memory_gib', '?')} GiB |")
    L.append(f"| Kernel / OS | {mach.get('kernel', '?')} / {mach.get('os', '?')} |")
    L.append(f"| {a_name} | {meta.get('a_version', '?')} (Debian package, default configuration, classic queues) |")
    L.append(f"| {b_name} | {meta.get('b_version', '?')} {('`' + meta['warren_args'] + '`') if meta.get('warren_args') else ''} |")
    L.append(f"| Toolchain | {mach.get('rustc', '?')} |")
    L.append(f"| Load generator | `warren-bench` (lapin 4.12, one connection per producer and consumer, same process) |")
    L.append("")

    L.append("## Results")
    L.append("")
    L.append(
        f"The last column is how many times better {b_name} is (above 1: {b_name} is better, whichever "
        "direction is better for the metric); *target* is the goal set in issue 3. Broker CPU per message "
        "at a fixed rate is the headline: "
        + ("the brokers and the load generator were pinned to the CPUs the table above names"
           if (broker_cpus or bench_cpus) else "both brokers share 2 cores with the load generator")
        + ", so raw msg/s is partly the client's limit, while CPU per message is the broker's own cost."
    )
    L.append("")
    L.append(f"| Scenario | Metric | {a_name} | {b_name} | {b_name} advantage |")
    L.append("|---|---|---:|---:|---:|")
    for scen, key, label, unit, better, a, b, _, _ in rows:
        adv = advantage(better, a, b)
        t = TARGETS.get((scen, key))
        adv_s = "n/a" if adv is None else f"{adv:.2f}x"
        if better is None:
            adv_s = "(context)"
        if t is not None and adv is not None:
            adv_s += f" (target {t}x: {'met' if adv >= t else 'not met'})"
        elif t is not None:
            adv_s += f" (target {t}x)"
        arrow = {"higher": "higher is better", "lower": "lower is better"}.get(better, "context")
        L.append(f"| {scen} | {label} ({unit}, {arrow}) | {fmt(a)} | {fmt(b)} | {adv_s} |")
    L.append("")
    rel_chart = os.path.relpath(chart_path, os.path.dirname(os.path.abspath(out_path)) or ".")
    L.append(f"![{title}]({rel_chart})")
    L.append("")
    notes = load_notes(notes_path)
    if notes:
        L.append("## Notes")
        L.append("")
        L.append(notes)
        L.append("")
    deep_path, deep = latest_deep_summary(os.path.dirname(os.path.abspath(__file__)))
    if deep:
        rel = os.path.relpath(deep_path, os.path.dirname(os.path.abspath(out_path)) or ".")
        L.append(f"## Deep queues, start-up and flow control ({b_name} alone)")
        L.append("")
        L.append(f"From `bench/deep-queue.sh` (its last summary: [bench/deep-queue.md]({rel})):")
        L.append("")
        L.append(deep)
        L.append("")
    delayed_path, delayed = latest_deep_summary(os.path.dirname(os.path.abspath(__file__)), "delayed.md")
    if delayed:
        rel = os.path.relpath(delayed_path, os.path.dirname(os.path.abspath(out_path)) or ".")
        L.append(f"## Delayed messages ({b_name} alone)")
        L.append("")
        L.append(f"From `bench/delayed.sh` (kept in [bench/delayed.md]({rel})):")
        L.append("")
        L.append(delayed)
        L.append("")

    mgmt_path, mgmt = latest_deep_summary(os.path.dirname(os.path.abspath(__file__)), "management.md")
    if mgmt:
        rel = os.path.relpath(mgmt_path, os.path.dirname(os.path.abspath(out_path)) or ".")
        L.append("## Management API, metrics and access control")
        L.append("")
        L.append(f"From `bench/api.sh` and an A/B of the message path (kept in [bench/management.md]({rel})):")
        L.append("")
        L.append(mgmt)
        L.append("")
    cluster_path, cluster = latest_deep_summary(os.path.dirname(os.path.abspath(__file__)), "cluster.md")
    if cluster:
        rel = os.path.relpath(cluster_path, os.path.dirname(os.path.abspath(out_path)) or ".")
        L.append("## Replicated queues on a 3-node cluster")
        L.append("")
        L.append(f"From `bench/failover.py` and `bench/cluster.sh` (kept in [bench/cluster.md]({rel})):")
        L.append("")
        L.append(cluster)
        L.append("")
    sqs_path, sqs = latest_deep_summary(os.path.dirname(os.path.abspath(__file__)), "sqs.md")
    if sqs:
        rel = os.path.relpath(sqs_path, os.path.dirname(os.path.abspath(out_path)) or ".")
        L.append(f"## The SQS API ({b_name} alone, beside ElasticMQ's published figures)")
        L.append("")
        L.append(f"From `bench/sqs.sh` (kept in [bench/sqs.md]({rel})):")
        L.append("")
        L.append(sqs)
        L.append("")
    L.append(f"## What {b_name} persists in these runs")
    L.append("")
    if meta.get("self_test"):
        L.append("Not applicable (self-test).")
    else:
        L.append(f"- Scenario 2 and 2 @ 5k (persistent messages, durable queue, confirms): {meta.get('warren_storage', '?')}")
        L.append(f"- All other scenarios use transient messages on non-durable queues: in memory on both brokers.")
        L.append(
            f"- {a_name}: classic queues (version 1 index in 3.10); persistent messages are written to its message "
            "store and confirmed after the write is synced (fsync batched by the queue/store)."
        )
    L.append("")

    L.append("## Scenarios and exact commands")
    L.append("")
    L.append(
        "`$URL` is the broker's AMQP URL (`amqp://guest:guest@127.0.0.1:5672/%2f` for RabbitMQ, port "
        f"{meta.get('warren_port', 5690)} for Warren) and `$PID` its process id (RabbitMQ's `beam.smp`). Each run also gets `--label` and a queue "
        "pattern unique to the run; scenario 8 is two commands (publish, then drain the same queue). "
        f"This report: `{meta.get('invocation', 'bench/compare.sh')}`."
    )
    L.append("")
    for scen in SCENARIOS:
        if scen in data:
            L.append(f"- **{scen}**: {describe(scen, meta)}")
    L.append("")
    L.append("```sh")
    for c in meta.get("commands", []):
        L.append(c)
    L.append("```")
    L.append("")
    inflight = meta.get("inflight", 0)
    if inflight:
        L.append(
            f"The unthrottled scenarios (1, 2, 3, 4) hold the producers back while more than {inflight:,} "
            "messages per queue are published but not yet consumed (`--max-inflight`, counted over all "
            "queues). They measure the rate a broker sustains with a short queue; without the limit the "
            "producer outruns the consumer, the queue grows for the whole run and the consume rate "
            "depends on the backlog more than on the broker (`--inflight 0` runs them that way)."
        )
        L.append("")
    if "s9" in data or "s10" in data:
        L.append(
            "Scenarios 9 and 10 consume as a task-queue worker does (`--ack-wait`): each message is acked "
            "on its own and the consumer waits until the ack has been written to the socket before it takes "
            "the next one, so every ack is a write of its own, where the other scenarios let the client "
            "write many queued acks at once. Scenario 9 is scenario 1 @ 5k with that one change: the "
            "difference between the two is what a broker pays for unbatched acks. Scenario 10 has no "
            "in-flight cap on purpose: the producer publishes as fast as the broker takes its messages, "
            "the worker handles at most 5,000 msg/s (`--consume-rate`), and the queue grows for the whole "
            "run. Its CPU per message divides by the messages published (most are only stored), its memory "
            "growth per queued message divides the growth of `VmRSS` over the run by the messages left "
            "queued at the end (published minus consumed), and the rates tell whether the publish path "
            "and the deliveries to the worker hold up while the queue grows."
        )
        L.append("")
    if "s11" in data or "s11r" in data:
        L.append(
            "Scenario 11 is scenario 1 (11r: 1 @ 5k) on a queue declared with `x-message-ttl` 60000 and "
            "`x-dead-letter-exchange`: no message expires, so the difference from scenario 1 is what the "
            "expiry bookkeeping costs every message (Warren's target: at most 10% more CPU per message)."
        )
        L.append("")
    if "s12" in data:
        L.append(
            "Scenario 12 is scenario 9's load spread over many clients, as a fleet of workers connects: "
            "100 worker connections (each ack awaited), 100 producer connections at 50 msg/s each, 100 "
            "queues, and 800 more connections opened before the timed part and left idle through it "
            "(`--hold-connections`; they answer heartbeats). Its CPU per message beside scenario 9's is "
            "what many connections cost a broker that carries the same messages (issue 25's target: "
            "within 20%), and idle connections should cost nothing."
        )
        L.append("")
    L.append(
        "Options worth knowing: `--rate` is per producer; CPU per message divides the broker's CPU time "
        "(utime + stime from `/proc/<pid>/stat`, over the run, setup excluded) by the messages consumed "
        "(each one published, delivered and acknowledged), or by the messages published when nothing "
        "consumes. Memory per idle item is the growth of `VmRSS` divided by the item count, from a reading taken "
        "once the broker's RSS has stopped moving to one taken 3 s after the last item; the *second half "
        "only* row divides the growth between a reading after the first half (and 3 s) and the end by the "
        "second half's count, which leaves out fixed start-up costs. "
        + fresh_note(meta)
        + " Peak RSS is `VmHWM` after resetting it "
        "through `/proc/<pid>/clear_refs` at the start of the scenario, or the highest sampled `VmRSS`."
    )
    L.append("")

    L.append("## Every run")
    L.append("")
    L.append(f"| Scenario | Metric | {a_name} runs | {b_name} runs |")
    L.append("|---|---|---|---|")
    for scen, key, label, unit, better, a, b, va, vb in rows:
        L.append(f"| {scen} | {label} ({unit}) | {', '.join(fmt(v) for v in va)} | {', '.join(fmt(v) for v in vb)} |")
    L.append("")
    errs = [(scen, side, e) for scen, sides in errors.items() for side, es in sides.items() for e in es]
    if errs:
        L.append("Errors reported by the load generator:")
        L.append("")
        for scen, side, e in errs:
            L.append(f"- {a_name if side == 'A' else b_name}: {e}")
        L.append("")

    with open(out_path, "w") as f:
        f.write("\n".join(L))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results")
    ap.add_argument("--out", default="docs/benchmarks.md")
    ap.add_argument("--chart", default="bench/benchmarks.svg")
    ap.add_argument("--summarize", metavar="JSON")
    ap.add_argument("--notes", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "notes.md"),
                    help="hand-written analysis appended to the report (default bench/notes.md)")
    args = ap.parse_args()
    if args.summarize:
        summarize(args.summarize)
        return
    if not args.results:
        ap.error("--results is required")
    report(args.results, args.out, args.chart, args.notes)


if __name__ == "__main__":
    sys.exit(main())
