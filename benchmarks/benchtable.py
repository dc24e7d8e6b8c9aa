"""The tables benchmarks/training.py prints, from its rows (pure functions, unit-tested).

Rows: ``{"model", "phases": {...}}`` once per model (F, B, the step with communication off, the
gradient bytes, the link rate, ...) and ``{"model", "config", "round", "img_s", "engine_cpu",
"rss_mb": [per rank]}`` per column and round. Every figure over rounds is printed as
min / median / max, so a bimodal result shows as one.
"""
from __future__ import annotations

import statistics

# bytes on the wire per gradient byte, per compressor (TopK/PowerSGD: depends on the bucket)
WIRE_FACTOR = {"none": 1.0, "fp16": 0.5, "bf16": 0.5, "fp8": 0.25}
GLOO = ("ddp", "fsdp")                      # frameworks that are baselines, not lightcc
ENGINE_CONFIGS = ("lightcc", "ddp-lcc", "cross_barrier")


def split(config: str) -> tuple[str, str, float | None]:
    """``framework[:option][@bucket_mb][+observe]`` -> (framework, option, bucket MB or None)
    (``+watch``/``+bare``: what a lightcc column observes, training.py)."""
    base, _, bucket = config.partition("+")[0].partition("@")
    framework, _, option = base.partition(":")
    return framework, option, float(bucket) if bucket else None


def num(v: float) -> str:
    """A throughput figure to about three digits (real-size models on two cores train a few
    samples per second, or less)."""
    return f"{v:.0f}" if abs(v) >= 100 else f"{v:.1f}" if abs(v) >= 10 else f"{v:.2f}"


def spread(values: list[float]) -> str:
    """``min / median / max`` of a column over rounds ("-" when it did not run)."""
    if not values:
        return "-"
    return " / ".join(num(v) for v in (min(values), statistics.median(values), max(values)))


def ratio_cell(ratios: list[float]) -> str:
    """Median of per-round ratios, with their range: ``1.02x (0.95-1.10)``."""
    if not ratios:
        return "-"
    return f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"


def _by_round(rows: list[dict], model: str, config: str) -> dict[int, dict]:
    return {r["round"]: r for r in rows if r.get("model") == model and r.get("config") == config}


def ratios(rows: list[dict], model: str, config: str, base: str) -> list[float]:
    """Per-round img/s ratios of ``config`` to ``base`` (rounds both ran)."""
    a, b = _by_round(rows, model, config), _by_round(rows, model, base)
    return [a[k]["img_s"] / b[k]["img_s"] for k in sorted(a) if k in b]


def best_of(rows: list[dict], model: str, family: str, configs: list[str]) -> str | None:
    """The column of ``family`` (``ddp`` or ``ddp:fp16``: DDP's default 25 MB buckets and every
    ``@bucket`` variant in ``configs``) with the highest median img/s."""
    members = [c for c in configs if c.partition("@")[0] == family]
    scored = [(statistics.median([r["img_s"] for r in _by_round(rows, model, c).values()]), c)
              for c in members if _by_round(rows, model, c)]
    return max(scored)[1] if scored else None


def families(configs: list[str]) -> list[str]:
    """DDP-on-gloo families that have a bucket sweep in ``configs`` (best-of columns)."""
    return [f for f in dict.fromkeys(c.partition("@")[0] for c in configs if "@" in c)
            if split(f)[0] in GLOO]


def throughput_table(rows: list[dict], configs: list[str], baselines: list[str],
                     cpu: bool = False) -> str:
    """img/s min / median / max per model and column; ratios to each baseline and to the best
    bucket size of each swept DDP family (median of per-round ratios, with their range)."""
    models = list(dict.fromkeys(r["model"] for r in rows if "img_s" in r))
    fams = families(configs)
    ours = [c for c in configs if split(c)[0] not in GLOO]
    pairs = [(c, b) for b in baselines for c in ours]
    head = ["model"] + [f"{c} img/s" for c in configs] + [f"{c} / {b}" for c, b in pairs]
    head += [f"{c} / best {f}" for f in fams for c in ours] + [f"best {f}" for f in fams]
    if cpu:
        head += [f"{c} engine CPU" for c in configs if c.startswith(ENGINE_CONFIGS)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for model in models:
        cells = [model]
        for c in configs:
            cells.append(spread([r["img_s"] for r in _by_round(rows, model, c).values()]))
        for c, b in pairs:
            cells.append(ratio_cell(ratios(rows, model, c, b)))
        best = {f: best_of(rows, model, f, configs) for f in fams}
        for f in fams:
            for c in ours:
                cells.append(ratio_cell(ratios(rows, model, c, best[f])) if best[f] else "-")
        cells += [_bucket_name(best[f]) for f in fams]
        if cpu:
            for c in configs:
                if c.startswith(ENGINE_CONFIGS):
                    vals = [r.get("engine_cpu", 0.0) for r in _by_round(rows, model, c).values()]
                    cells.append(f"{100 * statistics.median(vals):.0f} %" if vals else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _bucket_name(config: str | None) -> str:
    if config is None:
        return "-"
    bucket = split(config)[2]
    return f"{bucket:g} MB" if bucket is not None else "25 MB (default)"


def rss_table(rows: list[dict], configs: list[str], base: str = "ddp") -> str:
    """Peak RSS per rank (MB; median over rounds of each rank's peak), and the largest rank's
    against ``base``'s."""
    head = ["model", "column", "peak RSS MB per rank (median over rounds)", f"max rank / {base}"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for model in dict.fromkeys(r["model"] for r in rows if "img_s" in r):
        ref = _rss(rows, model, base)
        for c in configs:
            per_rank = _rss(rows, model, c)
            if not per_rank:
                continue
            rel = f"{max(per_rank) / max(ref):.2f}x" if ref else "-"
            lines.append(f"| {model} | {c} | {' / '.join(f'{v:.0f}' for v in per_rank)} | {rel} |")
    return "\n".join(lines)


def _rss(rows: list[dict], model: str, config: str) -> list[float]:
    got = [r["rss_mb"] for r in _by_round(rows, model, config).values() if r.get("rss_mb")]
    return [statistics.median(col) for col in zip(*got)] if got else []


def wire_seconds(ph: dict, option: str) -> float | None:
    """W: bytes one link carries per step / the link rate: 2 (n-1)/n x the gradient bytes after
    compression (n = the hosts, or the ranks on one machine); None when unknown."""
    factor = WIRE_FACTOR.get(option or "none")
    if factor is None or not ph.get("link_Bps"):
        return None
    n = ph["hosts"] if ph.get("hosts", 1) > 1 else ph["world"]
    return 2 * (n - 1) / n * ph["grad_bytes"] * factor / ph["link_Bps"]


def bounds(ph: dict, w: float) -> tuple[float, float]:
    """(barrier ``F + max(B, W) + O``, cross-barrier ``max(F + B + O, W)``), seconds; O is the
    step with communication off minus F + B."""
    f, b, o = ph["F"], ph["B"], host_work(ph)
    return f + max(b, w) + o, max(f + b + o, w)



def plot_bounds(rows: list[dict]) -> dict[str, dict[str, float]]:
    """Per model, the uncompressed barrier and cross-barrier bounds as images/s (all ranks), for
    a throughput plot's marks: ``batch x world / bound`` (models without phases are left out)."""
    out: dict[str, dict[str, float]] = {}
    for r in rows:
        ph = r.get("phases")
        w = wire_seconds(ph, "") if ph else None
        if ph is None or w is None:
            continue
        bar, xbar = bounds(ph, w)
        n = ph["batch"] * ph["world"]
        out[r["model"]] = {"barrier bound": n / bar, "cross-barrier bound": n / xbar} \
            if bar != xbar else {"bound (barrier = cross-barrier)": n / bar}
    return out

def host_work(ph: dict) -> float:
    """O (s): the median step with communication off minus F and B (never below 0)."""
    return max(0.0, ph.get("step", ph["F"] + ph["B"]) - ph["F"] - ph["B"])


def bounds_table(rows: list[dict], configs: list[str]) -> str:
    """Per model and column: F, B, O, W, the median step and both bounds (ms), and the step's
    share of each bound (bound / step: 100 % = at the bound)."""
    head = ["model", "column", "F ms", "B ms", "O ms", "W ms", "step ms (median)",
            "barrier bound F+max(B,W)+O ms", "bound / step", "cross-barrier bound "
            "max(F+B+O,W) ms", "bound / step"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for model, ph in ((r["model"], r["phases"]) for r in rows if "phases" in r):
        for c in configs:
            framework, option, _ = split(c)
            if framework not in ("lightcc", "lightcc-tcp", "cross_barrier", "ddp", "ddp-lcc"):
                continue
            vals = [r["img_s"] for r in _by_round(rows, model, c).values()]
            w = wire_seconds(ph, option)
            if not vals or w is None:
                continue
            step = ph["batch"] * ph["world"] / statistics.median(vals)
            bar, xbar = bounds(ph, w)
            ms = lambda s: f"{1e3 * s:.0f}"  # noqa: E731
            lines.append(f"| {model} | {c} | {ms(ph['F'])} | {ms(ph['B'])} | "
                         f"{ms(host_work(ph))} | {ms(w)} | {ms(step)} | {ms(bar)} | "
                         f"{bar / step:.0%} | {ms(xbar)} | {xbar / step:.0%} |")
    return "\n".join(lines)


def phases_lines(rows: list[dict]) -> str:
    """One line per model: asked and achieved F and B (device time), O, the gradient bytes."""
    out = []
    for r in rows:
        if "phases" not in r:
            continue
        ph = r["phases"]
        asked = ""
        if ph.get("asked_F") is not None:
            asked = (f"asked F {1e3 * ph['asked_F']:.1f} ms, B {1e3 * ph['asked_B']:.1f} ms; "
                     f"achieved ")
        out.append(f"# {r['model']}: {ph.get('params', 0) / 1e6:.1f} M params, "
                   f"{ph['grad_bytes'] / 2**20:.0f} MiB of gradients; {asked}F "
                   f"{1e3 * ph['F']:.1f} ms, B {1e3 * ph['B']:.1f} ms, step without "
                   f"communication {1e3 * ph.get('step', 0):.1f} ms (O {1e3 * host_work(ph):.1f}"
                   f" ms); link {ph['link_Bps'] / 1e6:.0f} MB/s")
    return "\n".join(out)
