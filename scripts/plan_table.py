"""Prints the plan table of docs/performance.md: dpipe's plan (dpipe.plan) for each emulated
machine and real-size model of dpipe/plan/table.py, built on the meta device (no weights, no GPU).

    HF_HUB_OFFLINE=1 .venv/bin/python scripts/plan_table.py
"""

from dpipe.plan.table import markdown

if __name__ == "__main__":
    print(markdown())
