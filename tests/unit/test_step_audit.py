"""The step audit on the CPU (dpipe.train.audit): it counts what would make a GPU's host wait
(a value read to the host, shapes that depend on values) and names the line, but not the
batches made on the host by design, nor torch's optimizers reading their host-side step."""

from __future__ import annotations

import torch

from dpipe.train.audit import StepAudit


def _model_step(x: torch.Tensor) -> torch.Tensor:
    scale = float(x.abs().max())  # 1: a value read to the host
    kept = x[x > 0]  # 2: a boolean mask's nonzero
    ids = torch.nonzero(x)  # 3
    return x * scale + kept.sum() + ids.sum()


def _batches():
    for _ in range(2):
        x = torch.randn(8)
        int(x.argmax())  # made on the host: not counted
        yield x


def test_it_counts_what_would_sync_and_names_the_line():
    audit = StepAudit()
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.AdamW(model.parameters(), foreach=False)
    with audit.counting():
        for x in audit.made_on_host(_batches()):
            model(_model_step(x)).sum().backward()
        optimizer.step()  # its step counts are host tensors on a GPU too
    assert audit.host_syncs == 6
    assert audit.backward_passes == 2
    lines = " ".join(audit.where)
    assert "test_step_audit.py" in lines and "_local_scalar_dense" in lines
    assert "nonzero" in lines


def test_a_step_without_them_counts_none():
    audit = StepAudit()
    with audit.counting():
        x = torch.randn(8)
        (x * 2).relu().sum()
    assert audit.host_syncs == 0 and not audit.where


def test_one_hot_with_its_class_count_is_not_counted():
    """On the CPU `F.one_hot` checks its indices' range (a value read); on CUDA, given
    `num_classes`, it does not (HiDream's MoE gate calls it in every block)."""
    audit = StepAudit()
    with audit.counting():
        torch.nn.functional.one_hot(torch.tensor([0, 2, 1]), num_classes=3)
    assert audit.host_syncs == 0
    with audit.counting():
        torch.nn.functional.one_hot(torch.tensor([0, 2, 1]))  # its class count read from the max
    assert audit.host_syncs > 0
