"""A worker for tests/unit/test_console_log.py: writes to its console the ways a rank does."""

import logging
import os
import sys
import warnings


def main() -> int:
    rank = os.environ["RANK"]
    print(f"printed by rank {rank}")
    for done in range(0, 101, 50):  # a progress bar redrawn in place, as tqdm draws it
        sys.stderr.write(f"\rcaching rank {rank}: {done}%")
    sys.stderr.write("\n")
    logging.getLogger("early").warning("logged by rank %s", rank)
    warnings.warn(f"warned by rank {rank}")
    return 0
