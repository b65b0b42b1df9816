"""The run's log file (`train.log` in the run dir) holds what the console shows.

Hydra writes the launcher's own log records to `<run dir>/<job>.log`. The workers are other
processes (forked from the fork server, launch/local.py): their output reaches the terminal
directly, so without this the file held none of it. Each worker copies its stdout and stderr into
that file (`tee_console`), line by line; of a progress bar redrawn with carriage returns only the
state at the end of its line is kept, so the file reads as a log. Output written below Python
(C++ libraries writing to the file descriptors) reaches the console only.
"""

from __future__ import annotations

import io
import logging
import sys
from pathlib import Path

# The launcher names its log file to the workers in this variable.
LOG_FILE_ENV = "DPIPE_CONSOLE_LOG"


def run_log_file() -> Path | None:
    """The file the root logger writes to (Hydra's job log), or None."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            return Path(handler.baseFilename)
    return None


class _Tee(io.TextIOBase):
    """A text stream writing to `stream` and, by whole lines, to `file`."""

    def __init__(self, stream, file):
        super().__init__()
        self._stream, self._file, self._line = stream, file, ""

    def write(self, text: str) -> int:
        self._stream.write(text)
        *lines, self._line = (self._line + text).split("\n")
        for line in lines:  # a redrawn line (tqdm): what is left after the last carriage return
            self._file.write(line.rstrip("\r").rsplit("\r", 1)[-1] + "\n")
        if lines:
            self._file.flush()
        return len(text)

    def flush(self) -> None:
        self._stream.flush()

    def isatty(self) -> bool:
        return self._stream.isatty()

    def fileno(self) -> int:
        return self._stream.fileno()

    @property
    def encoding(self) -> str:
        return self._stream.encoding

    def writable(self) -> bool:
        return True


def tee_console(path: str | Path) -> None:
    """From now on, this process's stdout and stderr (and the log handlers already writing to
    them, e.g. DeepSpeed's, made when the fork server imported it) also go to `path`."""
    try:  # appended beside the launcher's records
        file = open(path, "a", encoding="utf-8", buffering=1)
    except OSError:  # the run dir gone or unwritable: the console still has it all
        return
    old = {id(sys.stdout): _Tee(sys.stdout, file), id(sys.stderr): _Tee(sys.stderr, file)}
    loggers = [logging.getLogger(), *(v for v in logging.Logger.manager.loggerDict.values()
                                      if isinstance(v, logging.Logger))]
    for logger in loggers:
        for handler in logger.handlers:
            if type(handler) is logging.StreamHandler and id(handler.stream) in old:
                handler.setStream(old[id(handler.stream)])
    sys.stdout, sys.stderr = old[id(sys.stdout)], old[id(sys.stderr)]
