"""dpipe.io's atomic writes: the whole file or the old one, with the permissions of a file that
`open` makes (a shared run dir's exports and configs are readable by the team)."""

from __future__ import annotations

import os
import stat

import pytest

from dpipe.io import atomic_write_text


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_a_written_file_has_the_modes_of_the_umask(tmp_path, umask):
    previous = os.umask(umask)
    try:
        atomic_write_text(tmp_path / "a" / "config.yaml", "x: 1\n")
        with open(tmp_path / "plain.txt", "w") as file:
            file.write("x")
    finally:
        os.umask(previous)
    mode = stat.S_IMODE((tmp_path / "a" / "config.yaml").stat().st_mode)
    assert mode == 0o666 & ~umask == stat.S_IMODE((tmp_path / "plain.txt").stat().st_mode)


def test_a_rewrite_replaces_the_whole_file_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "run.yaml"
    atomic_write_text(target, "old\n")
    atomic_write_text(target, "new\n")
    assert target.read_text() == "new\n"
    assert [p.name for p in tmp_path.iterdir()] == ["run.yaml"]
