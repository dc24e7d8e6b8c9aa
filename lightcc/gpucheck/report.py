"""gpucheck's report: one JSON document and the same as Markdown tables.

The JSON holds ``env`` (what the machine has), ``steps`` (each with ``status`` ok / FAIL /
not run, seconds, a one-line ``detail`` and the step's parsed ``data``) and ``verdict``.
Markdown: the summary table, the benchmark figures next to the issue's targets, the engine
cases of each run side by side, and what a single GPU cannot show.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TARGET_NOTE = ("Targets on an H100: casts >= 0.9x torch's cast, TopK >= 5x torch.topk at 1 %, "
               "engine allreduce overhead <= 5 % against a raw CuPy NCCL call at >= 64 MB.")
LIMITS = ("One GPU cannot show: NCCL with several ranks (NCCL refuses two ranks on one GPU; the "
          "two-rank runs use MPI through pinned host memory instead), the hierarchical and 2D "
          "algorithms over NCCL between nodes, and the engine's overhead against NCCL when "
          "data really moves (with one rank the engine column is its fixed cost per call). "
          "Run `mpirun -np N python benchmarks/gpu.py --skip-kernels` and "
          "`mpirun -np N python -m lightcc.gpucheck.engine_check` on N GPUs for those.")


def verdict(steps: list[dict[str, Any]], gpu: bool = True) -> str:
    """``pass`` when every step ran and passed; ``fail`` when a step that ran failed;
    ``incomplete (N not run)`` when none failed but some did not run (out of time, no
    source checkout), since an unrun check proves nothing; ``no GPU`` without a GPU."""
    if not gpu:
        return "no GPU"
    ran = [s for s in steps if s["status"] != "not run"]
    if any(s["status"] != "ok" for s in ran):
        return "fail"
    missing = len(steps) - len(ran)
    if not ran or missing:
        return f"incomplete ({missing} not run)" if steps else "incomplete (nothing ran)"
    return "pass"


def _table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _num(v: Any, fmt: str) -> str:
    return "-" if v is None or v != v else format(v, fmt)


def _bench(data: dict[str, Any]) -> list[str]:
    out = []
    kernels = data.get("kernels") or []
    if kernels:
        out += ["", f"### Kernels ({data.get('size_mb')} MiB fp32, read GB/s, median of "
                    f"{data.get('reps')})", "",
                _table(["kernel", "lightcc", "torch", "ratio", "target", "verdict"],
                       [[k["kernel"], _num(k["lightcc_gbs"], ".0f"), _num(k["torch_gbs"], ".0f"),
                         _num(k["ratio"], ".2f"),
                         "" if k["target"] is None else f">= {k['target']:g}x",
                         k["verdict"] or ""] for k in kernels])]
    rows = data.get("allreduce") or []
    if rows:
        one = data.get("ranks", 1) == 1
        out += ["", f"### Allreduce fp32 ({data.get('ranks', 1)} rank(s), ms)", "",
                _table(["MB", "raw NCCL", "lightcc comm", "comm overhead", "engine",
                        "engine overhead", "target (>= 64 MB)"],
                       [[r["mb"], _num(r["raw_ms"], ".3f"), _num(r["comm_ms"], ".3f"),
                         _num(r["comm_overhead_pct"], ".1f") + " %",
                         _num(r["engine_ms"], ".3f"),
                         _num(r["engine_overhead_pct"], ".1f") + " %",
                         "" if r["mb"] < 64 else ("n/a: 1 rank" if one else
                                                  ("ok" if (r["engine_overhead_pct"] or 1e9)
                                                   <= 5 else "MISS"))] for r in rows])]
    return out


def _cases(steps: list[dict[str, Any]]) -> list[str]:
    runs = [(s["title"], {c["case"]: c for c in s["data"]["cases"]}) for s in steps
            if isinstance(s.get("data"), dict) and "cases" in s["data"]]
    if not runs:
        return []
    names: list[str] = []
    for _, cases in runs:
        names += [n for n in cases if n not in names]

    def cell(c: dict[str, Any] | None) -> str:
        if c is None:
            return "-"
        return "ok" if c["ok"] else "FAIL: " + c["note"].replace("|", "/")[:80]

    return ["", "## Engine cases", "",
            _table(["case", *[t for t, _ in runs]],
                   [[n, *[cell(cases.get(n)) for _, cases in runs]] for n in names])]


def _timing(steps: list[dict[str, Any]]) -> list[str]:
    """DDP per-step time on the lightcc backend against the native backend (ddp_check)."""
    rows = [[s["name"], t["hook"], f"{t['native']}: {_num(t['native_ms'], '.2f')}",
             _num(t["lightcc_ms"], ".2f"), _num(t["overhead_pct"], "+.1f") + " %",
             _num(t["ratio"], ".2f")]
            for s in steps if isinstance(s.get("data"), dict)
            for t in s["data"].get("timing", [])]
    if not rows:
        return []
    return ["", "## DDP per step, lightcc backend vs native (ms, median, slowest rank)", "",
            "Targets: 1 rank, overhead over DDP on NCCL <= 5 %; 2 ranks sharing the GPU, "
            "native (gloo) / lightcc >= 1.0.", "",
            _table(["step", "hook", "native ms", "lightcc ms", "overhead", "native / lightcc"],
                   rows)]


def _training(steps: list[dict[str, Any]]) -> list[str]:
    """training.py's columns (median img/s over rounds) per simulated-hosts run."""
    out = []
    for s in steps:
        med = s.get("data", {}).get("median_img_s") if isinstance(s.get("data"), dict) else None
        if med:
            out += ["", f"## {s['title']}: img/s, median over rounds", "",
                    _table(["model column", "img/s"], [[k, f"{v:.0f}"] for k, v in med.items()]),
                    "", "(the bounds table is in logs/" + s["name"] + ".log)"]
    return out


def markdown(doc: dict[str, Any]) -> str:
    env = doc["env"]
    lines = ["# lightcc GPU check", "",
             f"Verdict: **{doc['verdict']}**. Machine: {env.get('summary', '?')}.", "",
             _table(["step", "result", "seconds", "details"],
                    [[s["title"], s["status"], _num(s.get("seconds"), ".0f"),
                      s.get("detail", "").replace("|", "/")] for s in doc["steps"]])]
    for s in doc["steps"]:
        if s["name"] == "benchmarks" and isinstance(s.get("data"), dict):
            lines += ["", "## Benchmarks", "", TARGET_NOTE] + _bench(s["data"])
    lines += _timing(doc["steps"]) + _training(doc["steps"])
    lines += _cases(doc["steps"])
    lines += ["", "## Limits", "", LIMITS, ""]
    return "\n".join(lines)


def write(out: Path, env: dict[str, Any], steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Write ``report.json`` and ``report.md`` under ``out``; returns the document."""
    doc = {"env": env, "steps": steps, "verdict": verdict(steps, env.get("gpu", True))}
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(doc, indent=1, default=str), encoding="utf-8")
    (out / "report.md").write_text(markdown(doc), encoding="utf-8")
    return doc
