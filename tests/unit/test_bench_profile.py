"""`dpipe-bench --profile`'s step (dpipe.bench.profile): the time of one step by kind, and a step
that still runs where the profiler cannot (every pipeline stage must take part in it)."""

from __future__ import annotations

import torch

from dpipe.bench.profile import profiled_step


def test_a_step_s_op_time_is_summed_by_kind(tmp_path):
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    by_kind = profiled_step(lambda: (a @ b).relu().sum(), tmp_path / "p.txt", cuda=False)
    assert by_kind["matmul"] > 0
    text = (tmp_path / "p.txt").read_text()
    assert text.startswith("one step, CPU op time by kind") and "matmul | aten::mm" in text


def test_a_failing_profiler_still_runs_the_step(tmp_path, monkeypatch):
    def no_profiler(self):
        raise RuntimeError("CUPTI is not available")

    monkeypatch.setattr(torch.profiler.profile, "start", no_profiler)
    ran = []
    assert profiled_step(lambda: ran.append(1), tmp_path / "p.txt", cuda=False) == {}
    assert ran == [1]
    assert (tmp_path / "p.txt").read_text() == (
        "profile failed: RuntimeError: CUPTI is not available\n")
