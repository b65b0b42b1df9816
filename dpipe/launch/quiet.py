"""Keeps library chatter (per-file progress bars, optional-dependency notices) off the console."""

from __future__ import annotations

import os


def quiet_libraries() -> None:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def disable_library_progress_bars() -> None:
    import diffusers
    import transformers

    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()


def thread_locks_for_progress_bars() -> None:
    """A rank's progress bars (caching, training) are written by one process: a thread lock
    does. tqdm's default adds a multiprocessing lock, a semaphore that the resource tracker
    reports as leaked when the launcher kills the worker after a user error (dpipe.launch.local)."""
    import threading

    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())
