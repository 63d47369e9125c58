"""Collect a GPU evidence run (verify/gpu_matrix.sh) into one JSON and a Markdown table.

    python3 -m verify.summary RUN_DIR [--json OUT.json] [--markdown OUT.md]

RUN_DIR holds one folder per matrix (llama-s8192, gpt-s2048, ...) of per-run JSON files written by
`memcalc verify --matrix --save`, and env.txt. Torch-free: it only reads what the runs wrote.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

COLUMNS = ["matrix", "tricks", "textbook", "exact", "measured", "reserved", "error", "step time", "predicted",
           "tokens/s", "MFU", "pass"]  # fmt: skip


def load(run_dir: Path) -> dict:
    """Every run's result, by matrix folder, plus the environment the script recorded."""
    runs = {}
    for folder in sorted(p for p in run_dir.iterdir() if p.is_dir()):
        runs[folder.name] = [json.loads(f.read_text()) for f in sorted(folder.glob("*.json"))]
    env = run_dir / "env.txt"
    return {"environment": env.read_text() if env.exists() else "", "matrices": runs}


def peak(result: dict) -> dict | None:
    return next((r for r in result["rows"] if r["quantity"] == "whole-step peak"), None)


def gb(x: float | None) -> str:
    return "-" if x is None else f"{x / 1e9:.2f} GB"


def row(matrix: str, r: dict) -> list[str]:
    p, t, ph = peak(r), r.get("timing"), r.get("phases")
    error = "-" if p is None or p.get("error") is None else f"{100 * p['error']:+.2f}%"
    return [
        matrix, r["tricks"], gb(p and p["textbook"]), gb(p and p["exact"]), gb(p and p["measured"]),
        gb(ph and ph["reserved_peak_bytes"]), error,
        "-" if not t else f"{t['step_seconds']:.3f} s",
        "-" if not t or t.get("predicted_seconds") is None else f"{t['predicted_seconds']:.3f} s",
        "-" if not t else f"{t['tokens_per_second']:,.0f}",
        "-" if not t or t["mfu"] is None else f"{100 * t['mfu']:.1f}%",
        "pass" if r["passed"] else ("FAIL: " + r["error"] if r.get("error") else "FAIL"),
    ]  # fmt: skip


def markdown(data: dict) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for matrix, results in data["matrices"].items():
        for r in results:
            cells = row(matrix, r)
            layers = f" ({r['layers_built']} of {r['layers_requested']} layers)" if r["layers_note"] else ""
            cells[1] += layers
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> None:
    if not argv:
        sys.exit("usage: python3 -m verify.summary RUN_DIR [--json OUT.json] [--markdown OUT.md]")
    data = load(Path(argv[0]))
    table = markdown(data)
    args = dict(zip(argv[1::2], argv[2::2]))
    if "--json" in args:
        Path(args["--json"]).write_text(json.dumps(data, indent=1) + "\n")
    if "--markdown" in args:
        Path(args["--markdown"]).write_text(table)
    print(table)


if __name__ == "__main__":
    main(sys.argv[1:])
