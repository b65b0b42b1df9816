"""The sweep summary: one row per sweep point (status, final loss, eval loss, run dir).

Written as `sweep_summary.json` and `sweep_summary.md` in the sweep dir and printed at the end of
every sweep, whichever launcher ran it. The numbers come from each run dir's `metrics.jsonl`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dpipe.io import atomic_write_text

SUMMARY_JSON = "sweep_summary.json"
SUMMARY_MD = "sweep_summary.md"


@dataclass
class PointResult:
    num: int
    overrides: list[str]
    run_dir: str
    status: str = "completed"  # completed | failed | cancelled | timed out | not started
    message: str = ""  # why it did not complete
    job_id: str | None = None
    metrics: dict = field(default_factory=dict)  # step, loss, eval_loss (when the run logs one)

    @property
    def ok(self) -> bool:
        return self.status == "completed"


def final_metrics(run_dir: Path) -> dict:
    """The last logged step and loss, and the newest value of every eval metric (eval_*)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return {}
    out: dict = {}
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut off by a kill
            continue
        for key, value in record.items():
            if key in ("step", "loss") or key.startswith("eval"):
                out[key] = value
    return out


def write_summary(sweep_dir: Path, results: list[PointResult]) -> str:
    """Writes both files (merged with the points of earlier batches of this sweep); returns the
    Markdown."""
    sweep_dir = Path(sweep_dir)
    for r in results:
        if not r.metrics:
            r.metrics = final_metrics(Path(r.run_dir))
    merged = {r["num"]: r for r in _load(sweep_dir)}
    merged.update({r.num: asdict(r) for r in results})
    rows = [merged[k] for k in sorted(merged)]
    atomic_write_text(sweep_dir / SUMMARY_JSON, json.dumps({"points": rows}, indent=2) + "\n")
    md = to_markdown(sweep_dir, rows)
    atomic_write_text(sweep_dir / SUMMARY_MD, md)
    return md


def to_markdown(sweep_dir: Path, rows: list[dict]) -> str:
    eval_keys = sorted({k for r in rows for k in r["metrics"] if k.startswith("eval")})
    # Show what tells the points apart: overrides that all points share go in the heading.
    shared = set.intersection(*(set(r["overrides"]) for r in rows)) if len(rows) > 1 else set()
    head = ["#", "overrides", "status", "step", "final loss", *eval_keys, "run dir"]
    common = [o for o in rows[0]["overrides"] if o in shared] if rows else []
    lines = [f"# Sweep {sweep_dir}", "", *([f"All points: {' '.join(common)}", ""] if common else []),
             "| " + " | ".join(head) + " |",
             "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        m = r["metrics"]
        own = [o for o in r["overrides"] if o not in shared]
        cells = [str(r["num"]), " ".join(own) or "(none)", r["status"],
                 str(m.get("step", "")), _number(m.get("loss")),
                 *(_number(m.get(k)) for k in eval_keys), _relative(r["run_dir"], sweep_dir)]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    failed = [r for r in rows if r["status"] != "completed"]
    if failed:
        lines += ["", "## Not completed", ""]
        for r in failed:
            job = f" (job {r['job_id']})" if r.get("job_id") else ""
            lines.append(f"- #{r['num']}{job}: {r['status']}: {r['message'] or 'no message'}")
    return "\n".join(lines) + "\n"


def _number(value) -> str:
    return "" if value is None else f"{value:.6g}" if isinstance(value, (int, float)) else str(value)


def _relative(run_dir: str, sweep_dir: Path) -> str:
    try:
        return str(Path(run_dir).resolve().relative_to(Path(sweep_dir).resolve()))
    except ValueError:
        return run_dir


def _load(sweep_dir: Path) -> list[dict]:
    path = sweep_dir / SUMMARY_JSON
    try:
        return json.loads(path.read_text())["points"]
    except (OSError, ValueError, KeyError):
        return []
