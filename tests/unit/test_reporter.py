"""What rank 0 records per logged step (dpipe.train.metrics.Reporter): times per step, also when
train.log_every logs only every few steps, and the executed TFLOP/s per GPU."""

from __future__ import annotations

import json

import pytest

from dpipe.train import metrics


def test_times_are_per_step_across_the_steps_between_logs(tmp_path, monkeypatch):
    clock = iter([100.0, 110.0, 114.0])  # made at 100; logs at steps 5 and 6
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: next(clock))
    reporter = metrics.Reporter(tmp_path, start_step=0, max_steps=6, samples_per_step=8,
                                progress_bar=False)
    reporter.pause(2.0)  # e.g. counting FLOPs: not training time
    reporter.step(5, loss=0.5, lr=1e-4, grad_norm=None, flops_per_gpu=4e13)  # 5 steps in 8 s
    reporter.step(6, loss=0.4, lr=1e-4, grad_norm=1.0)
    reporter.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    first, second = (json.loads(line) for line in lines)
    assert first["step_time_s"] == pytest.approx(1.6)
    assert first["samples_per_s"] == pytest.approx(5.0)
    assert first["tflops_per_gpu"] == pytest.approx(4e13 / 8.0 / 1e12)
    assert second["step_time_s"] == pytest.approx(4.0) and "tflops_per_gpu" not in second


def test_a_resumed_run_drops_the_steps_logged_past_its_checkpoint(tmp_path):
    """A run killed at step 5 logged steps 1-5; its resume from step 3's checkpoint logs 4 and 5
    again. A line the kill cut short goes too."""
    jsonl = tmp_path / "metrics.jsonl"
    jsonl.write_text("".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in range(1, 6))
                     + '{"step": 6, "lo')
    reporter = metrics.Reporter(tmp_path, start_step=3, max_steps=5, samples_per_step=8,
                                progress_bar=False)
    for step in (4, 5):
        reporter.step(step, loss=0.5, lr=1e-4, grad_norm=None)
    reporter.close()
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert [r["loss"] for r in records] == [1.0, 0.5, 1.0 / 3, 0.5, 0.5]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp file left
