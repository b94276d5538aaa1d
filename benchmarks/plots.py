"""The benchmarks' figures: what they share (a headless matplotlib, log2 x axes, concurrency ticks, a PNG saved beside
the JSON under a title naming the GPU, date and commit) and one function per result kind, each drawing a result JSON
into a PNG beside it.

    python -m benchmarks.plots RESULT.json [RESULT.json ...]        # the kind from the file name (KIND_<date>...)
    python -m benchmarks.plots --serving-ab --out AB.png SERVING_VS_ENGINE.json [...]   # one A/B call's variants

A benchmark whose device may lack matplotlib imports this module only where it plots (`plot_result` in
benchmarks/results.py), so its JSON is written either way."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Callable, Optional

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402


def finish_axis(ax: Any, xlabel: str, ylabel: str, title: str, title_size: Optional[float] = None) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=title_size)
    ax.legend(fontsize=7)


def save_beside(fig: Any, json_path: Path) -> Path:
    fig.tight_layout()
    out = json_path.with_suffix(".png")
    fig.savefig(out, dpi=110)
    return out


def concurrency_ticks(axes: Any, rows: list[dict[str, Any]]) -> None:
    """x ticks at the closed-loop concurrency levels of `rows` (a Poisson row's "poisson" is no level)."""
    ticks = sorted({r["concurrency"] for r in rows if r["concurrency"] != "poisson"})
    for ax in axes:
        ax.set_xticks(ticks, [str(t) for t in ticks])


def batch_size_ticks(ax: Any, rows: list[dict[str, Any]]) -> None:
    """x ticks at the batch sizes of `rows` (their "bs")."""
    sizes = sorted({r["bs"] for r in rows})
    ax.set_xticks(sizes, [str(bs) for bs in sizes])


def save_titled(fig: Any, report: dict[str, Any], json_path: Path, prefix: str = "") -> Path:
    """Titles the figure with the report's GPU, date and commit, saves it beside the JSON and closes it."""
    fig.suptitle(f"{prefix}{report['gpu']} · {report['date']} · commit {report['commit']}", fontsize=10)
    out = save_beside(fig, json_path)
    plt.close(fig)
    return out


def plot_step_latency(path: Path) -> Path:
    report = json.loads(path.read_text())
    backends = report.get("backends", ["triton"])
    rows = [r for r in report["rows"] if r.get("backend", "triton") == backends[0] and r.get("tp", 1) == 1]
    others = backends[1:]
    contexts = sorted({r["context"] for r in rows})
    fig, axes = plt.subplots(1, len(contexts), figsize=(6 * len(contexts), 4.5), squeeze=False)
    for ax, context in zip(axes[0], contexts):
        for spec, graphs, style in [(True, True, "o-"), (True, False, "o--"), (False, True, "s-"),
                                    (False, False, "s--")]:
            sel = sorted((r for r in rows if r["context"] == context and r["spec"] == spec and r["graphs"] == graphs),
                         key=lambda r: r["bs"])
            label = f"{'DFlash cycle' if spec else 'target decode'}, graphs {'on' if graphs else 'off'}, {backends[0]}"
            ax.plot([r["bs"] for r in sel], [r["cycle_ms"] for r in sel], style, label=label)
        for backend in others:
            sel = sorted((r for r in report["rows"] if r.get("backend") == backend and r["context"] == context
                          and r["spec"] and r["graphs"] and r.get("tp", 1) == 1), key=lambda r: r["bs"])
            ax.plot([r["bs"] for r in sel], [r["cycle_ms"] for r in sel], "^-",
                    label=f"DFlash cycle, graphs on, {backend}")
        floor = sorted((r for r in rows if r["context"] == context and r["spec"] and r["graphs"]),
                       key=lambda r: r["bs"])
        sustained = [r for r in floor if "sustained_greedy_cycle_ms" in r]
        if sustained:
            ax.plot([r["bs"] for r in sustained], [r["sustained_greedy_cycle_ms"] for r in sustained], "x-.",
                    label="DFlash cycle graph, sustained (power settled)")
        ax.plot([r["bs"] for r in floor], [r["floor_ms"] for r in floor], "k:", label="DFlash floor (bytes / BW)")
        for ref in report.get("dflash_reference", []):
            if ref.get("context") == context:
                ax.axhline(ref["cycle_ms"], color="gray", alpha=0.5, label="z-lab dflash_generate (bs 1)")
        finish_axis(ax, "batch size", "ms per step", f"Llama-3.1-8B shapes, context {context}")
    fig.suptitle(f"{report['gpu']} · {report['date']} · commit {report['commit']} · "
                 f"simulated accept len {report['accept_len']}")
    return save_beside(fig, path)


def plot_prefill_latency(path: Path) -> Path:
    report = json.loads(path.read_text())
    rows = report["rows"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for spec in (False, True):
        for bs, color in ((1, "tab:blue"), (8, "tab:orange")):
            sel = sorted((r for r in rows if r["spec"] == spec and r["bs"] == bs), key=lambda r: r["tokens"])
            if not sel:
                continue
            tag = f"bs {bs}{', DFlash (aux capture)' if spec else ''}"
            style = "-" if spec else ":"
            tokens = [r["tokens"] for r in sel]
            ax.plot(tokens, [r["eager_ms"] for r in sel], "x" + style, color=color, alpha=0.5, label=f"eager, {tag}")
            ax.plot(tokens, [r["piecewise_ms"] for r in sel], "o" + style, color=color, label=f"piecewise, {tag}")
    title = f"Prefill, Llama-3.1-8B shapes · {report['gpu']} · {report['date']} · {report['commit']}"
    finish_axis(ax, "tokens in the extend batch", "ms per forward", title, title_size=9)
    return save_beside(fig, path)


def plot_adaptive_verify(path: Path) -> Path:
    report = json.loads(path.read_text())
    rows = report["rows"]
    profiles = sorted({r["profile"] for r in rows})
    contexts = sorted({r["context"] for r in rows})
    fig, axes = plt.subplots(len(profiles), len(contexts), figsize=(6 * len(contexts), 4.2 * len(profiles)),
                             squeeze=False)
    for i, profile in enumerate(profiles):
        for j, context in enumerate(contexts):
            ax = axes[i][j]
            sel = sorted((r for r in rows if r["profile"] == profile and r["context"] == context),
                         key=lambda r: r["bs"])
            sizes = [r["bs"] for r in sel]
            for key, style, label in (("target_tok_s", "s-", "target-only"),
                                      ("fixed_tok_s", "o--", "DFlash, full block"),
                                      ("adaptive_tok_s", "^-", "DFlash, adaptive verify")):
                ax.plot(sizes, [r[key] for r in sel], style, label=label)
            for r in sel:
                ax.annotate(f"n={r['adaptive_num_draft_tokens']}", (r["bs"], r["adaptive_tok_s"]), fontsize=7,
                            textcoords="offset points", xytext=(3, 4))
            ax.set_yscale("log")
            finish_axis(ax, "batch size", "tokens/s (all requests)", f"profile {profile}, context {context}", 10)
    fig.suptitle(f"adaptive verify · {report['gpu']} · {report['date']} · commit {report['commit']} · "
                 f"{report['shapes']}")
    return save_beside(fig, path)


def plot_deterministic_cost(path: Path) -> Path:
    report = json.loads(path.read_text())
    rows, cost = report["rows"], report["cost"]
    contexts = sorted({r["context"] for r in rows})
    fig, axes = plt.subplots(2, len(contexts), figsize=(6 * len(contexts), 8), squeeze=False)
    for column, context in enumerate(contexts):
        ax = axes[0][column]
        for spec in (True, False):
            for deterministic, style in ((False, "--"), (True, "-")):
                sel = sorted((r for r in rows if r["context"] == context and r["spec"] == spec
                              and r["deterministic"] == deterministic), key=lambda r: r["bs"])
                label = (f"{'DFlash cycle' if spec else 'target decode'}, "
                         f"deterministic {'on' if deterministic else 'off'}")
                ax.plot([r["bs"] for r in sel], [r["cycle_ms"] for r in sel], ("o" if spec else "s") + style,
                        label=label)
        finish_axis(ax, "batch size", "ms per step", f"context {context}")
        ax = axes[1][column]
        for spec, key, style in ((True, "cycle_on_over_off", "o-"), (True, "verify_on_over_off", "^-"),
                                 (True, "propose_on_over_off", "v-"), (False, "cycle_on_over_off", "s-")):
            sel = sorted((r for r in cost if r["context"] == context and r["spec"] == spec and key in r),
                         key=lambda r: r["bs"])
            name = key.replace("_on_over_off", "")
            ax.plot([r["bs"] for r in sel], [r[key] for r in sel], style,
                    label=f"{'DFlash' if spec else 'target'} {name if spec else 'decode'}")
        ax.axhline(1.0, color="gray", lw=0.8)
        finish_axis(ax, "batch size", "deterministic on ÷ off", f"cost, context {context}")
    prefill = {r["deterministic"]: r["prefill_ms"] for r in rows if not r["spec"]}
    note = f" · prefill {rows[0]['prefill_tokens']} tok: {prefill.get(False, 0):.1f} → {prefill.get(True, 0):.1f} ms"
    fig.suptitle(f"--enable-deterministic-inference cost · {report['gpu']} · {report['date']} · commit "
                 f"{report['commit']}\n{report['shapes']}{note}", fontsize=9)
    return save_beside(fig, path)


def greedy_drift_baseline_pair(summary: dict[str, Any]) -> str:
    """The target-only pair (target_bs1 vs target_bsB) of a result with one baseline pair: the one without dflash."""
    return next(pair for pair in summary if "dflash" not in pair)


def plot_greedy_drift(path: Path) -> Path:
    report = json.loads(path.read_text())
    summary: dict[str, Any] = report["summary"]
    margins = {pair: [r["fp32_margin"] for r in report["rows"] if r["pair"] == pair and r["fp32_margin"] is not None]
               for pair in summary}
    every = [m for values in margins.values() for m in values]
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    labels = [f"{pair}: {len(values)}/{sum(r['pair'] == pair for r in report['rows'])} diverge"
              for pair, values in margins.items()]
    if every:
        top = max(every) or 1.0
        ax.hist(list(margins.values()), bins=[top * i / 12 for i in range(13)], label=labels)
    else:
        ax.text(0.5, 0.5, "no divergence in any pair", ha="center", transform=ax.transAxes)
        for label in labels:
            ax.plot([], [], label=label)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    # NOTE: results since --baseline-batch-sizes name their baseline's largest margin; older ones have one baseline pair
    baseline_max = report["baseline_max_margin"] if "baseline_max_margin" in report else \
        summary[greedy_drift_baseline_pair(summary)]["max_margin"]
    if baseline_max is not None:
        ax.axvline(baseline_max, color="k", linestyle=":", label=f"baseline max margin {baseline_max:.3f}")
    ax.set_xlabel("fp32 top-1 − top-2 logit margin at the first divergence")
    ax.set_ylabel("prompts")
    ax.set_title(f"greedy drift · {report['gpu']} · {report['date']} · commit {report['commit']}", fontsize=9)
    ax.legend(fontsize=7)
    return save_beside(fig, path)


PREFIX_CACHE_PANELS = (("tok_s", "output tokens/s", False), ("ttft_p50_ms", "TTFT p50 (ms)", True),
                       ("accept_len", "accept length", False))


def plot_prefix_cache(path: Path) -> Path:
    report = json.loads(path.read_text())
    rows: list[dict[str, Any]] = report["rows"]
    groups = sorted({(r["shape"], r["workload"]) for r in rows})
    fig, axes = plt.subplots(1, len(PREFIX_CACHE_PANELS), figsize=(15, 4.5))
    width = 0.38
    for ax, (key, label, log) in zip(axes, PREFIX_CACHE_PANELS):
        for offset, cache, color in ((-width / 2, "off", "C7"), (width / 2, "on", "C0")):
            values = []
            for group in groups:
                match = [r for r in rows if (r["shape"], r["workload"]) == group and r["cache"] == cache]
                values.append(float(match[0][key] or 0.0) if match else 0.0)
            ax.bar([i + offset for i in range(len(groups))], values, width, color=color, label=f"cache {cache}")
        ax.set_xticks(range(len(groups)), [f"{w}\n{s}" for s, w in groups], fontsize=8)
        ax.set_ylabel(label)
        if log:
            ax.set_yscale("log")
        ax.set_title(label)
        ax.legend(fontsize=7)
    return save_titled(fig, report, path, prefix="radix prefix cache · ")


def serving_vs_engine_line(row: dict[str, Any]) -> tuple[str, str, str, str]:
    """A serving_vs_engine row's line in the plot: shape, weights, mode, client (rows before issue 49 name no
    client: they were streaming /generate)."""
    return row["shape"], row.get("weights", "dummy"), row["mode"], row.get("client", "generate_stream")


def plot_serving_vs_engine(path: Path) -> Path:
    """server ÷ engine per concurrency (left; Poisson runs as crosses at their mean in-flight requests) and both
    throughputs (right), a line per shape, weights, mode and client."""
    report = json.loads(path.read_text())
    rows: list[dict[str, Any]] = report["rows"]
    fig, (ratio_ax, tok_ax) = plt.subplots(1, 2, figsize=(13, 5))
    engines_drawn: set[tuple[str, str, str]] = set()  # NOTE: the clients of a shape and mode share one engine line
    for index, key in enumerate(sorted({serving_vs_engine_line(r) for r in rows})):
        color = f"C{index % 10}"
        style = "--" if key[3] == "chat_stream" else "-"
        label = f"{key[0]}{' (real weights)' if key[1] == 'real' else ''} {key[2]} {key[3]}"
        closed = sorted((r for r in rows if serving_vs_engine_line(r) == key and r["concurrency"] != "poisson"),
                        key=lambda r: r["concurrency"])
        x = [r["concurrency"] for r in closed]
        ratio_ax.plot(x, [r["server_over_engine"] for r in closed], "o" + style, color=color, label=label)
        tok_ax.plot(x, [r["server_tok_s"] for r in closed], "o" + style, color=color, label=f"{label} server")
        if key[:3] not in engines_drawn:
            engines_drawn.add(key[:3])
            tok_ax.plot(x, [r["engine_tok_s"] for r in closed], "s:", color=color, alpha=0.5,
                        label=f"{' '.join(key[:3])} engine")
        for r in rows:
            if serving_vs_engine_line(r) == key and r["concurrency"] == "poisson":
                ratio_ax.plot([max(1.0, r["mean_in_flight"])], [r["server_over_engine"]], "x", color=color, ms=9,
                              label=f"{label} Poisson {r['rate']:.1f} req/s")
    ratio_ax.axhline(0.9, color="gray", ls="--", alpha=0.6, label="goal 0.90")
    baselines = sorted({r.get("engine_baseline", "waves") for r in rows})
    flags = sorted({r.get("serve_flags", "?") for r in rows})
    finish_axis(ratio_ax, "concurrent clients", "server tok/s ÷ engine tok/s",
                f"server ÷ engine ({'/'.join(baselines)} engine; serve flags {'; '.join(flags)})", title_size=9)
    finish_axis(tok_ax, "concurrent clients", "output tokens/s",
                "throughput (dotted: offline engine, same concurrency)")
    concurrency_ticks((ratio_ax, tok_ax), rows)
    return save_titled(fig, report, path)


def serving_ab_variant_name(path: Path, report: dict[str, Any]) -> str:
    """`<commit> <tag>` from a serving_vs_engine_<date>_<commit>_ab_<tag>.json name."""
    tag = path.stem.split("_ab_", 1)[1] if "_ab_" in path.stem else path.stem
    return f"{report['commit']}\n{tag}"


def plot_serving_ab(paths: list[Path], out: Path) -> Path:
    reports = [json.loads(p.read_text()) for p in paths]
    rows = [(serving_ab_variant_name(p, r), row) for p, r in zip(paths, reports) for row in r["rows"]]
    if not rows:
        raise SystemExit("no rows in the given JSONs")
    fig, (tok_ax, ttft_ax) = plt.subplots(1, 2, figsize=(max(8.0, 2.2 * len(rows) + 4), 4.5))
    x = list(range(len(rows)))
    labels = [f"{name}\n{row['shape']} {row['mode']} @{row['concurrency']}" for name, row in rows]
    width = 0.38
    tok_ax.bar([i - width / 2 for i in x], [row["engine_tok_s"] for _, row in rows], width, label="offline engine")
    bars = tok_ax.bar([i + width / 2 for i in x], [row["server_tok_s"] for _, row in rows], width, label="server")
    for bar, (_, row) in zip(bars, rows):
        ratio = row.get("server_over_engine")
        if ratio is not None:
            tok_ax.annotate(f"{ratio:.2f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                            va="bottom", fontsize=8)
    tok_ax.set_ylabel("output tok/s (bar label: server ÷ engine)")
    ttft_ax.bar([i - width / 2 for i in x], [row["ttft_p50_ms"] for _, row in rows], width, label="TTFT p50")
    ttft_ax.bar([i + width / 2 for i in x], [row["ttft_p99_ms"] for _, row in rows], width, label="TTFT p99")
    ttft_ax.set_ylabel("ms")
    for ax in (tok_ax, ttft_ax):
        ax.set_xticks(x, labels, fontsize=7)
        ax.legend(fontsize=7)
    gpus = sorted({r["gpu"] for r in reports})
    dates = sorted({r["date"] for r in reports})
    commits = sorted({r["commit"] for r in reports})
    fig.suptitle(f"serving A/B · {', '.join(gpus)} · {', '.join(dates)} · commits {', '.join(commits)}", fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


# NOTE: the last set has no goal
DRAFT_V2_SETS = (("gsm8k_heldout", 4.0), ("general_heldout", 3.0), ("gsm8k_long_heldout", None))


def draft_v2_set_values(record: dict) -> dict:
    """A draft's accept length per held-out set, from its newest eval run (`accept` holds the goal sets' copies)."""
    return {name: run["accept_length"] for name, run in (record.get("eval") or {}).items()}


def plot_draft_v2(json_path: Path) -> Path:
    data = json.loads(json_path.read_text())
    details = data["details"]
    drafts = {"shipped": draft_v2_set_values(details["shipped"])}
    drafts.update({name: draft_v2_set_values(run) for name, run in data["runs"].items()})
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    width = 0.8 / max(1, len(drafts))
    for i, (name, accept) in enumerate(drafts.items()):
        xs = [j + (i - (len(drafts) - 1) / 2) * width for j in range(len(DRAFT_V2_SETS))]
        values = [accept.get(s) or 0.0 for s, _ in DRAFT_V2_SETS]
        bars = left.bar(xs, values, width, label=name)
        left.bar_label(bars, fmt="%.2f", fontsize=7)
    for j, (_, goal) in enumerate(DRAFT_V2_SETS):
        if goal is not None:
            left.hlines(goal, j - 0.45, j + 0.45, colors="k", linestyles="dashed", linewidth=1)
    left.set_xticks(range(len(DRAFT_V2_SETS)), [s for s, _ in DRAFT_V2_SETS])
    left.set_ylabel("accept length (tokens per verify, block 16)")
    left.set_title("held-out prompts (dashed: goal)")
    left.legend(fontsize=7)
    rows = [r for r in details["server_rows"] if "error" not in r]
    if rows:
        bars = right.bar([r["label"] for r in rows], [r["server_tok_s"] for r in rows], color="tab:gray")
        labels = []
        target = next((r["server_tok_s"] for r in rows if r["label"] == "target_only"), None)
        for row in rows:
            ratio = f"{row['server_tok_s'] / target:.2f}x" if target else ""
            accept = row.get("server_accept_length")
            labels.append(ratio + (f", τ {accept:.2f}" if accept else ""))
        right.bar_label(bars, labels=labels, fontsize=7)
    right.set_ylabel("tokens/s, 1 streaming client")
    right.set_title(f"demo pair through the server ({data['gpu']})")
    fig.suptitle(f"draft v2 (#24), {data['date']}, commit {data['commit']}", fontsize=10)
    return save_beside(fig, json_path)


def plot_step_latency_ab(summary: dict[str, Any], path: Path) -> Path:
    """A same-run A/B summary (step_latency.py --ab-summary): every round's cycle time per row, parent beside new."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    labels = [f"{'DFlash' if r['spec'] else 'target'} bs {r['bs']}" for r in summary["rows"]]
    for offset, side in ((-0.18, "parent"), (0.18, "new")):
        for i, row in enumerate(summary["rows"]):
            values = row[f"{side}_cycle_ms"]
            ax.scatter([i + offset] * len(values), values, color="tab:gray" if side == "parent" else "tab:blue",
                       label=f"{side} {summary[side + '_commit']}" if i == 0 else None)
    finish_axis(ax, "row (ctx 512)", "ms per step (each round)", "same-run A/B, step_latency")
    ax.set_xscale("linear")
    ax.set_xticks(range(len(labels)), labels)
    fig.suptitle(f"{summary['gpu']} · {summary['date']} · {summary['new_commit']} vs {summary['parent_commit']}")
    return save_beside(fig, path)


def _from_file(draw: Callable[[dict[str, Any], Path], Path]) -> Callable[[Path], Path]:
    return lambda path: draw(json.loads(path.read_text()), path)


def plot_generation_rate(report: dict[str, Any], json_path: Path) -> Path:
    rows = report["rows"]
    fig, (rate, step) = plt.subplots(1, 2, figsize=(11, 4))
    names = [r["variant"] for r in rows]
    rate.barh(names, [r["tokens_per_s"] or 0 for r in rows])
    rate.set_xlabel("output tokens / s")
    step.barh(names, [r["decode_step_ms"] or 0 for r in rows], label="decode step")
    step.barh(names, [r["between_steps_ms"] or 0 for r in rows], left=[r["decode_step_ms"] or 0 for r in rows],
              label="between steps")
    step.set_xlabel("ms")
    step.legend(fontsize=7)
    return save_titled(fig, report, json_path, f"generation rate ({report['shape']}) · ")


def plot_radix_evict(report: dict[str, Any], json_path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["cached_sequences"] for r in report["rows"]], [r["us_per_step_median"] for r in report["rows"]], "o-")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("finished sequences in the tree")
    ax.set_ylabel(f"µs a step (evict {report['settings']['rows']} pages, insert one)")
    return save_titled(fig, report, json_path, "radix eviction · ")


def plot_tree_verify(report: dict[str, Any], json_path: Path) -> Path:
    """Per workload: each policy's tokens/s over the chain's at the same batch size (the 0.97 floor dotted), and the
    accept lengths."""
    rows = report["rows"]
    workloads = sorted({r["workload"] for r in rows})
    fig, axes = plt.subplots(2, len(workloads), figsize=(6 * len(workloads), 8), squeeze=False)
    variants = sorted({(r["policy"], r["budget"]) for r in rows}, key=lambda v: (v[0] != "chain", v[0], v[1]))
    for j, workload in enumerate(workloads):
        speed, accept = axes[0][j], axes[1][j]
        for policy, budget in variants:
            sel = sorted((r for r in rows if (r["workload"], r["policy"], r["budget"]) == (workload, policy, budget)),
                         key=lambda r: r["bs"])
            if not sel:
                continue
            label = "chain" if policy == "chain" else f"{policy}, B = {budget}"
            style = "s-" if policy == "chain" else ("^-" if policy == "adaptive" else "o--")
            sizes = [r["bs"] for r in sel]
            speed.plot(sizes, [r["tok_s"] / r["chain_tok_s"] for r in sel], style, label=label)
            accept.plot(sizes, [r["accept_length"] for r in sel], style, label=label)
        speed.axhline(0.97, color="grey", linestyle=":", linewidth=1)
        batch_size_ticks(speed, rows)
        batch_size_ticks(accept, rows)
        finish_axis(speed, "batch size", "tokens/s ÷ the chain's", f"{workload}: speed against the chain", 10)
        finish_axis(accept, "batch size", "accept length (tokens a verify)", f"{workload}: accept length", 10)
    return save_titled(fig, report, json_path, "DDTree tree verify · ")


def plot_tree_serving(report: dict[str, Any], json_path: Path) -> Path:
    """Per workload: each tree server's tokens/s over the chain server's (the issue's 1.25 dotted), and every
    server's accept length."""
    rows = report["rows"]
    workloads = sorted({r["workload"] for r in rows})
    budgets = sorted({r["budget"] for r in rows})
    fig, (speed, accept) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / max(len(budgets), 1)
    for i, budget in enumerate(budgets):
        sel = {r["workload"]: r for r in rows if r["budget"] == budget}
        xs = [j + i * width for j in range(len(workloads))]
        label = "chain" if budget == 0 else f"tree, B = {budget}"
        speed.bar(xs, [sel[w]["over_chain"] if w in sel else 0 for w in workloads], width, label=label)
        accept.bar(xs, [(sel[w]["accept_length"] or 0) if w in sel else 0 for w in workloads], width, label=label)
    speed.axhline(1.25, color="grey", linestyle=":", linewidth=1)
    clients = rows[0]["clients"] if rows else 1
    titles = (f"{clients} client(s): speed against the chain", "accept length")
    for ax, ylabel, title in zip((speed, accept), ("tokens/s ÷ the chain server's", "accept length (tokens a verify)"),
                                 titles):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(workloads))], workloads)
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=7)
    return save_titled(fig, report, json_path, "DDTree through blockspec serve · ")


def plot_tree_build(report: dict[str, Any], json_path: Path) -> Path:
    """Per vocabulary: ms per tree build against the batch size, the torch form and the fused kernel per budget (the
    shared top-B over the vocabulary dotted; the fused top-B then the fused tree dash-dotted, where measured)."""
    rows = report["rows"]
    vocabs = sorted({r["vocab"] for r in rows})
    fig, axes = plt.subplots(1, len(vocabs), figsize=(6 * len(vocabs), 4.5), squeeze=False)
    for ax, vocab in zip(axes[0], vocabs):
        for budget in sorted({r["budget"] for r in rows if r["vocab"] == vocab}):
            sel = sorted((r for r in rows if (r["vocab"], r["budget"]) == (vocab, budget)), key=lambda r: r["bs"])
            sizes = [r["bs"] for r in sel]
            line, = ax.plot(sizes, [r["torch_ms"] for r in sel], "o--", label=f"torch, B = {budget}")
            ax.plot(sizes, [r["fused_ms"] for r in sel], "s-", color=line.get_color(), label=f"fused, B = {budget}")
            ax.plot(sizes, [r["topk_ms"] for r in sel], ":", color=line.get_color(), label=f"top-B alone, B = {budget}")
            if all("all_fused_ms" in r for r in sel):  # NOTE: results before the fused top-B lack it
                ax.plot(sizes, [r["all_fused_ms"] for r in sel], "^-.", color=line.get_color(),
                        label=f"fused top-B + fused tree, B = {budget}")
        batch_size_ticks(ax, [r for r in rows if r["vocab"] == vocab])
        finish_axis(ax, "batch size", "ms per tree build (CUDA graph replay)", f"vocabulary {vocab:,}", 10)
    return save_titled(fig, report, json_path, "DDTree tree build · ")


def plot_verify_attention(report: dict[str, Any], json_path: Path) -> Path:
    """A panel per verify block (chain, each tree budget) at the first batch size: µs per layer against the context,
    a line per variant (split count x tiles); the variant the engine serves drawn thick and black."""
    rows = report["rows"]
    bs = min(r["bs"] for r in rows) if rows else 1
    blocks = sorted({(r["budget"], r["query_tokens"]) for r in rows if r["bs"] == bs})
    fig, axes = plt.subplots(1, max(len(blocks), 1), figsize=(6 * max(len(blocks), 1), 4.5), squeeze=False)
    for ax, (budget, tokens) in zip(axes[0], blocks):
        sel = [r for r in rows if (r["bs"], r["budget"]) == (bs, budget)]
        # NOTE: a colour per split count, a line style per tile set
        split_counts = sorted({r["splits"] for r in sel})
        tile_sets = sorted({(r["tiles"], r["mask_edges_only"]) for r in sel})
        for splits, tiles, edges in sorted({(r["splits"], r["tiles"], r["mask_edges_only"]) for r in sel}):
            line = sorted((r for r in sel if (r["splits"], r["tiles"], r["mask_edges_only"]) == (splits, tiles, edges)),
                          key=lambda r: r["context"])
            served = all(r["served"] for r in line)
            label = f"{splits} split{'s' if splits > 1 else ''}, tiles {tiles}{' edges' if edges else ''}"
            style = ("-", "--", ":", "-.")[tile_sets.index((tiles, edges)) % 4]
            ax.plot([r["context"] for r in line], [r["us_per_layer"] for r in line], linestyle=style, marker=".",
                    color="black" if served else f"C{split_counts.index(splits) % 10}",
                    linewidth=2.5 if served else 0.9, label=label + (" (served)" if served else ""))
        kind = "chain" if budget == 0 else f"tree, B = {budget}"
        finish_axis(ax, "context (cached tokens)", "µs per layer (attention + merge, CUDA graph)",
                    f"{kind}: {tokens} query tokens, bs {bs}", 10)
        ax.legend(fontsize=5)
    settings = report.get("settings", {})
    return save_titled(fig, report, json_path, f"Verify attention ({settings.get('shape', '?')}) · ")


def plot_moe(report: dict[str, Any], json_path: Path) -> Path:
    """A panel each for the parts the result holds: the MoE layer's time against its touched-expert floor, the
    engine's tokens/s per step mode, the tile sweep (the fastest tile set against choose_tiles's pick), and the
    serving table (DFlash ÷ target-only per concurrency, served and offline)."""
    rows, sweep, serving = report["rows"], report.get("tile_sweep", []), report.get("serving_summary", [])
    layer_modes = (("layer_decode", "o-"), ("layer_verify", "s-"))
    step_modes = (("target_decode", "s-"), ("dflash_cycle", "o--"), ("dflash_adaptive", "^-"))
    parts = [part for part, modes in (("layer", layer_modes), ("step", step_modes))
             if any(r["mode"] == mode for r in rows for mode, _ in modes)] + (["tiles"] if sweep else [])
    parts += ["serving"] if any(level["dflash_over_target"] is not None for level in serving) else []
    fig, axes = plt.subplots(1, max(len(parts), 1), figsize=(6 * max(len(parts), 1), 4.5), squeeze=False)
    for axis, part in zip(axes[0], parts):
        if part == "layer":
            for mode, style in layer_modes:
                sel = sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["bs"])
                if sel:
                    sizes = [r["bs"] for r in sel]
                    line = axis.plot(sizes, [r["step_ms"] for r in sel], style, label=mode.replace("_", " "))[0]
                    axis.plot(sizes, [r["floor_ms"] for r in sel], ":", color=line.get_color(), label=f"{mode} floor")
            axis.set_yscale("log")
            batch_size_ticks(axis, rows)
            finish_axis(axis, "batch size (verify: blocks)", "ms (CUDA graph replay)", "one MoE layer", 10)
        elif part == "step":
            for mode, style in step_modes:
                sel = sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["bs"])
                if sel:
                    axis.plot([r["bs"] for r in sel], [r["tokens_per_step"] / r["step_ms"] * 1e3 for r in sel],
                              style, label=mode.replace("_", " "))
            axis.set_yscale("log")
            batch_size_ticks(axis, rows)
            finish_axis(axis, "batch size", "tokens/s (all requests)",
                        f"engine steps, context {report['args']['context']}", 10)
        elif part == "serving":
            for client in dict.fromkeys(level["client"] for level in serving):
                sel = [level for level in serving if level["client"] == client]
                levels = [level["concurrency"] for level in sel]
                line = axis.plot(levels, [level["dflash_over_target"] or float("nan") for level in sel], "o-",
                                 label=f"{client}: served")[0]
                axis.plot(levels, [level["engine_dflash_over_target"] or float("nan") for level in sel], "s--",
                          color=line.get_color(), label=f"{client}: offline engine")
            axis.axhline(1.0, color="grey", lw=0.8)
            finish_axis(axis, "clients", "DFlash ÷ target-only tokens/s",
                        f"served, simulated accept length {report['args']['accept_len']}", 10)
            sizes = sorted({level["concurrency"] for level in serving})
            axis.set_xticks(sizes, [str(size) for size in sizes])  # NOTE: after finish_axis's log scale resets them
        else:
            for mode, style in layer_modes:
                sizes = sorted({r["bs"] for r in sweep if r["mode"] == mode})
                if not sizes:
                    continue
                best = [min(r["over_floor"] for r in sweep if r["mode"] == mode and r["bs"] == bs) for bs in sizes]
                chosen = [next((r["over_floor"] for r in sweep if r["mode"] == mode and r["bs"] == bs and r["chosen"]),
                               float("nan")) for bs in sizes]
                line = axis.plot(sizes, best, style, label=f"{mode.replace('_', ' ')}: fastest set")[0]
                axis.plot(sizes, chosen, "--", color=line.get_color(), label=f"{mode.replace('_', ' ')}: chosen")
            batch_size_ticks(axis, sweep)
            finish_axis(axis, "batch size (verify: blocks)", "× the touched-expert floor", "fused experts' tiles", 10)
    return save_titled(fig, report, json_path, f"MoE {report['shape']} · ")


def plot_dflash2(report: dict[str, Any], json_path: Path) -> Path:
    """DFlash2's greedy cycle against DFlash's per batch size and the demo drafts' held-out accept lengths: a panel
    each, for the parts the result holds (`--part cycle` / `heldout`)."""
    rows, heldout = report.get("rows", []), report.get("heldout", [])
    panels = len([part for part in (rows, heldout) if part])
    fig, axes = plt.subplots(1, max(panels, 1), figsize=(6 * max(panels, 1), 4.5), squeeze=False)
    if rows:
        cycle = axes[0][0]
        for arch, style in (("dflash", "s-"), ("dflash2", "o-")):
            sel = sorted((r for r in rows if r["draft_arch"] == arch), key=lambda r: r["bs"])
            cycle.plot([r["bs"] for r in sel], [r["cycle_ms"] for r in sel], style, label=arch)
        batch_size_ticks(cycle, rows)
        finish_axis(cycle, "batch size", "greedy cycle ms", rows[0]["shape"], 10)
    if heldout:
        bars, names, width = axes[0][panels - 1], [r["draft"] for r in heldout], 0.4
        for offset, key in ((-width / 2, "gsm8k_accept"), (width / 2, "general_accept")):
            bars.bar([i + offset for i in range(len(names))], [r[key] or 0 for r in heldout], width, label=key)
        bars.set_xticks(range(len(names)), names)
        bars.set_ylabel("held-out accept length (0: not measured)")
        bars.set_title("demo drafts", fontsize=10)
        bars.legend(fontsize=7)
    return save_titled(fig, report, json_path, "DFlash2 vs DFlash · ")


def plot_cycle_profile(report: dict[str, Any], json_path: Path) -> Path:
    """Per row (cycle, budget, bs, graphs): wall ms and summed device ms per cycle, launches per cycle; and what the
    largest tree of the first diff's batch size adds over the chain per launch name (µs on CUDA, calls on the CPU)."""
    rows, diffs = report["rows"], report.get("diffs", [])
    fig, (times, launches, added) = plt.subplots(1, 3, figsize=(17, 4.5))
    labels = [("chain" if r["cycle"] == "chain" else f"B = {r['budget']}") + f"\nbs {r['bs']}"
              + ("" if r["graphs"] else "\neager") for r in rows]
    xs = range(len(rows))
    times.bar([x - 0.2 for x in xs], [r["wall_ms"] for r in rows], 0.4, label="wall (timed cycles)")
    times.bar([x + 0.2 for x in xs], [r["device_us_per_cycle"] / 1e3 for r in rows], 0.4, label="summed launches")
    launches.bar(xs, [r["ops_per_cycle"] for r in rows])
    for ax, ylabel in ((times, "ms per cycle"), (launches, "launches per cycle")):
        ax.set_xticks(list(xs), labels, fontsize=7)
        ax.set_ylabel(ylabel)
    times.legend(fontsize=7)
    times.set_title("cycle time", fontsize=10)
    launches.set_title(f"launches ({rows[0]['device'] if rows else '?'})", fontsize=10)
    if diffs:
        diff = max((d for d in diffs if (d["bs"], d["graphs"]) == (diffs[0]["bs"], diffs[0]["graphs"])),
                   key=lambda d: d["budget"])
        key = "added_calls" if diff["device"] == "cpu" else "added_us"
        entries = diff["kernels"][:12][::-1]
        added.barh([e["name"][:48] for e in entries], [e[key] for e in entries])
        added.tick_params(axis="y", labelsize=6)
        added.set_xlabel("added calls per cycle" if key == "added_calls" else "added device µs per cycle")
        added.set_title(f"tree B = {diff['budget']} minus chain, bs {diff['bs']}", fontsize=10)
    return save_titled(fig, report, json_path, f"DFlash cycle profile ({report['settings']['shape']}) · ")


# NOTE: longest prefix first: step_latency_ab_* is not a step_latency_* result
PLOTTERS: dict[str, Callable[[Path], Path]] = {
    "step_latency_ab": _from_file(plot_step_latency_ab),
    "step_latency": plot_step_latency,
    "prefill_latency": plot_prefill_latency,
    "adaptive_verify": plot_adaptive_verify,
    "deterministic_cost": plot_deterministic_cost,
    "greedy_drift": plot_greedy_drift,
    "prefix_cache": plot_prefix_cache,
    "serving_vs_engine": plot_serving_vs_engine,
    "draft_v2": plot_draft_v2,
    "generation_rate": _from_file(plot_generation_rate),
    "radix_evict": _from_file(plot_radix_evict),
    "tree_verify": _from_file(plot_tree_verify),
    "tree_serving": _from_file(plot_tree_serving),
    "tree_build": _from_file(plot_tree_build),
    "verify_attention": _from_file(plot_verify_attention),
    "moe": _from_file(plot_moe),
    "dflash2": _from_file(plot_dflash2),
    "cycle_profile": _from_file(plot_cycle_profile),
}


def plot_file(path: Path) -> Path:
    """Draws a result JSON by its kind, read from its file name (`<kind>_<date>...json`); the PNG's path."""
    for kind, draw in PLOTTERS.items():
        if path.name.startswith(kind + "_"):
            return draw(path)
    raise SystemExit(f"{path.name}: no plot for this kind; known kinds: {', '.join(PLOTTERS)}")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--serving-ab", action="store_true",
                        help="draw the JSONs (serving_vs_engine, one per variant, in plot order) as one A/B into --out")
    parser.add_argument("--out", type=Path, help="with --serving-ab: the PNG path")
    parser.add_argument("jsons", type=Path, nargs="+", help="result JSONs")
    args = parser.parse_args(argv)
    if args.serving_ab:
        if args.out is None:
            parser.error("--serving-ab needs --out")
        print(f"wrote {plot_serving_ab(args.jsons, args.out)}")
        return 0
    for path in args.jsons:
        print(plot_file(path))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
