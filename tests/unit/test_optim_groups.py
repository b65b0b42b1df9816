"""The built optimizers' parameter groups: no weight decay on 1-D parameters unless asked, Muon
on the matrices only, each optimizer's own keys refused where they cannot work, and
apply_optim_config giving every group its current hyperparameters after a load."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from dpipe.config.compose import compose_run
from dpipe.errors import ConfigError
from dpipe.train.engine_setup import apply_optim_config
from dpipe.train.optim import build_optimizer, evaluation_weights, lr_factor

OPTIMIZERS = ["adamw", "adamw8bit", "adafactor", "came", "prodigy", "schedulefree_adamw", "muon"]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 2))


def _decay_by_shape(optimizer) -> dict[tuple, float]:
    return {tuple(p.shape): group["weight_decay"]
            for group in optimizer.param_groups for p in group["params"]}


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_one_dimensional_parameters_get_no_weight_decay_by_default(name):
    run = compose_run([f"optim={name}", "optim.weight_decay=0.05"])
    optimizer = build_optimizer(list(_model().named_parameters()), run.optim)
    decay = _decay_by_shape(optimizer)
    assert decay[(8, 8)] == decay[(2, 8)] == 0.05  # the matrices
    assert decay[(8,)] == decay[(2,)] == 0.0  # biases and the norm's scale and shift
    assert sum(len(g["params"]) for g in optimizer.param_groups) == 6


def test_weight_decay_1d_decays_every_parameter():
    run = compose_run(["optim.weight_decay=0.05", "optim.weight_decay_1d=true"])
    optimizer = build_optimizer(list(_model().named_parameters()), run.optim)
    assert set(_decay_by_shape(optimizer).values()) == {0.05}
    assert len(optimizer.param_groups) == 1


def test_muon_takes_the_matrices_and_adamw_the_rest():
    run = compose_run(["optim=muon", "optim.lr=0.03", "optim.muon_adamw_lr=2e-4"])
    optimizer = build_optimizer(list(_model().named_parameters()), run.optim)
    muon, adamw = optimizer.param_groups
    assert muon["use_muon"] and not adamw["use_muon"]
    assert {p.ndim for p in muon["params"]} == {2} and {p.ndim for p in adamw["params"]} == {1}
    assert (muon["lr"], adamw["lr"]) == (0.03, 2e-4)


def test_a_resume_gives_each_group_the_current_settings():
    """Loading restores the saved hyperparameters; apply_optim_config replaces them per group
    (Muon's AdamW group keeps its own learning rate) and leaves Prodigy's estimate alone."""
    for name, changed in [("muon", ["optim.muon_adamw_lr=1e-3", "optim.momentum=0.9"]),
                          ("prodigy", ["optim.d_coef=2.0", "optim.weight_decay=0.2"])]:
        saved_run = compose_run([f"optim={name}"])
        model = _model()
        optimizer = build_optimizer(list(model.named_parameters()), saved_run.optim)
        model(torch.randn(4, 8)).square().mean().backward()
        optimizer.step()
        saved = optimizer.state_dict()
        saved_d = [g.get("d") for g in optimizer.param_groups]

        run = compose_run([f"optim={name}", *changed])
        optimizer = build_optimizer(list(model.named_parameters()), run.optim)
        optimizer.load_state_dict(saved)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer,
                                                      lr_factor(run.optim, run.train.max_steps))
        apply_optim_config(SimpleNamespace(lr_scheduler=scheduler, optimizer=optimizer), run)
        groups = optimizer.param_groups
        if name == "muon":
            assert groups[0]["momentum"] == 0.9 and groups[0]["lr"] == run.optim.lr
            assert groups[1]["lr"] == 1e-3 and scheduler.base_lrs == [run.optim.lr, 1e-3]
        else:
            assert [g["d_coef"] for g in groups] == [2.0, 2.0]
            assert [g["weight_decay"] for g in groups] == [0.2, 0.0]  # 1-D: still none
            assert [g["d"] for g in groups] == saved_d  # the estimate is the checkpoint's


def test_schedulefree_evaluates_its_averaged_weights_and_trains_on_exactly_its_own():
    run = compose_run(["optim=schedulefree_adamw"])
    model = _model()
    optimizer = build_optimizer(list(model.named_parameters()), run.optim)
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(4, 8)).square().mean().backward()
        optimizer.step()
    training = [p.detach().clone() for p in model.parameters()]
    with evaluation_weights(optimizer):
        averaged = [p.detach().clone() for p in model.parameters()]
    assert not all(torch.equal(a, b) for a, b in zip(averaged, training))
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), training))  # bit for bit
    assert optimizer.param_groups[0]["train_mode"]


@pytest.mark.parametrize("overrides, message", [
    (["optim=came", "optim.betas=[0.9,0.999]"], "optim.betas must be 3 numbers"),
    (["optim=schedulefree_adamw", "optim.schedule=cosine"], "replaces the learning-rate"),
    (["optim=muon", "pipeline.zero_stage=1"], "optim=muon needs the model's own tensors"),
    (["optim=adafactor", "model.mode=full", "train.precision=bf16", "pipeline.zero_stage=1"],
     "DeepSpeed's bf16 master-weights optimizer"),
    (["optim=prodigy", "optim.d0=0"], "optim.d0 must be a number > 0"),
])
def test_combinations_an_optimizer_cannot_do_are_refused_before_training(overrides, message):
    with pytest.raises(ConfigError, match=message):
        compose_run(overrides)


def test_param_groups_give_matching_parameters_their_own_rate_and_decay():
    """LoRA+-style: the second Linear at 10x the rate and its own decay; its bias keeps no
    decay; the rest keep optim.lr. The first pattern that matches takes a parameter."""
    run = compose_run(["optim.lr=1e-4", "optim.weight_decay=0.01",
                       "optim.param_groups=[{match: '^2\\.', lr: 1e-3, weight_decay: 0.1},"
                       "{match: weight, lr: 5e-4}]"])
    optimizer = build_optimizer(list(_model().named_parameters()), run.optim)
    by_shape = {(tuple(p.shape), g["lr"], g["weight_decay"])
                for g in optimizer.param_groups for p in g["params"]}
    assert by_shape == {((8, 8), 5e-4, 0.01),  # 0.weight: the second group
                        ((8,), 1e-4, 0.0),  # 0.bias and 1.bias: no group
                        ((8,), 5e-4, 0.0),  # 1.weight (the norm's scale): 1-D, no decay
                        ((2, 8), 1e-3, 0.1), ((2,), 1e-3, 0.0)}  # 2.*: the first group


def test_a_resume_follows_a_groups_changed_rate():
    saved_run = compose_run(["optim.param_groups=[{match: '^2\\.', lr: 1e-3}]"])
    model = _model()
    optimizer = build_optimizer(list(model.named_parameters()), saved_run.optim)
    model(torch.randn(4, 8)).square().mean().backward()
    optimizer.step()
    saved = optimizer.state_dict()
    run = compose_run(["optim.param_groups=[{match: '^2\\.', lr: 2e-3}]"])
    optimizer = build_optimizer(list(model.named_parameters()), run.optim)
    optimizer.load_state_dict(saved)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer,
                                                  lr_factor(run.optim, run.train.max_steps))
    apply_optim_config(SimpleNamespace(lr_scheduler=scheduler, optimizer=optimizer), run)
    assert sorted({g["lr"] for g in optimizer.param_groups}) == [1e-4, 2e-3]


@pytest.mark.parametrize("groups, message", [
    ("[{match: 'lora_(B'}]", "is not a regular expression"),
    ("[{match: lora_B, lr: 0}]", r"optim.param_groups\[0\].lr must be a number > 0"),
    ("[{match: lora_B, weight_decay: -1}]", r"optim.param_groups\[0\].weight_decay must be"),
])
def test_bad_param_groups_are_refused(groups, message):
    with pytest.raises(ConfigError, match=message):
        compose_run([f"optim.param_groups={groups}"])
