"""Prints the plan tables of docs/performance.md: dpipe's plan (dpipe.plan) for each emulated
machine and real-size model of dpipe/plan/table.py, and (`--presets`) for each experiment preset
on the machine it names, built on the meta device (no weights, no GPU).

    HF_HUB_OFFLINE=1 .venv/bin/python scripts/plan_table.py
    HF_HUB_OFFLINE=1 .venv/bin/python scripts/plan_table.py --presets
"""

import sys

from dpipe.plan.table import markdown, preset_markdown

if __name__ == "__main__":
    print(preset_markdown() if "--presets" in sys.argv[1:] else markdown())
