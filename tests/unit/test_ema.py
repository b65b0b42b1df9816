"""The EMA of the trainable weights (dpipe.train.ema): its update against a hand computation,
an exact swap in and out, its checkpoint file, and the config checks that guard it."""

from __future__ import annotations

import copy

import pytest
import torch
from omegaconf import OmegaConf

from dpipe.config.checks import validate
from dpipe.config.schema import EmaConfig
from dpipe.errors import ConfigError
from dpipe.train.checkpoint import CheckpointError, resume_changes
from dpipe.train.ema import WeightAverage, decay_at, file_name
from tests.unit.test_config import _compose
from tests.unit.test_resume_config import run_yaml


def _model(dtype=torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)).to(dtype)
    model[1].bias.requires_grad_(False)  # a frozen tensor: not averaged
    return model


def _train_step(model: torch.nn.Module, k: int) -> None:
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(k)))


def test_the_warmup_ramps_the_decay_up_to_its_value():
    assert decay_at(1, 0.999, True) == pytest.approx(2 / 11)
    assert decay_at(8, 0.5, True) == 0.5  # 9/18 = 0.5: reached
    assert decay_at(1000, 0.99, True) == 0.99
    assert decay_at(1, 0.9, False) == 0.9


@pytest.mark.parametrize("dtype,cpu", [(torch.float32, False), (torch.bfloat16, False),
                                       (torch.float32, True)])
def test_the_average_follows_the_hand_computed_formula(dtype, cpu):
    model = _model(dtype)
    ema = WeightAverage(model, EmaConfig(decay=0.5, cpu=cpu, warmup=True), 0, writes=True)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert [n for n, _ in ema.named] == names and "1.bias" not in names
    expected = {n: p.detach().double() for n, p in model.named_parameters() if p.requires_grad}
    for k in range(1, 5):
        _train_step(model, k)
        ema.update()
        d = min(0.5, (1 + k) / (10 + k))
        for n, p in model.named_parameters():
            if n in expected:
                expected[n] = d * expected[n] + (1 - d) * p.detach().double()
    for (n, _), average in zip(ema.named, ema.average):
        assert average.dtype == torch.float32
        assert average.device.type == "cpu"
        torch.testing.assert_close(average.double(), expected[n], rtol=1e-6, atol=1e-6)


def test_swapped_in_puts_the_average_in_and_the_weights_back_bit_for_bit():
    model = _model()
    ema = WeightAverage(model, EmaConfig(decay=0.9, warmup=False), 0, writes=True)
    for k in range(3):
        _train_step(model, k)
        ema.update()
    before = copy.deepcopy(model.state_dict())
    with ema.swapped_in():
        for (n, p), average in zip(ema.named, ema.average):
            assert torch.equal(p, average)
            assert not torch.equal(p, before[n])
    for n, t in model.state_dict().items():
        assert torch.equal(t, before[n]), n


def test_the_checkpoint_file_resumes_the_same_average(tmp_path):
    model = _model()
    ema = WeightAverage(model, EmaConfig(decay=0.9), 1, writes=True)
    for k in range(3):
        _train_step(model, k)
        ema.update()
    ema.write(tmp_path)
    assert (tmp_path / file_name(1)).is_file() and ema.nbytes > 0
    again = WeightAverage(model, EmaConfig(decay=0.9), 1, writes=True)
    again.resume(tmp_path, 3, logs=True)
    assert again.updates == 3  # the warmup continues where it was
    for a, b in zip(ema.average, again.average):
        assert torch.equal(a, b)
    # A replica that does not write leaves the file alone and counts no bytes.
    assert WeightAverage(model, EmaConfig(decay=0.9), 2, writes=False).nbytes == 0


def test_a_checkpoint_without_an_ema_starts_it_from_the_loaded_weights(tmp_path, caplog):
    model = _model()
    ema = WeightAverage(model, EmaConfig(decay=0.9), 0, writes=True)
    with caplog.at_level("INFO", logger="dpipe"):
        ema.resume(tmp_path, 7, logs=True)
    assert "holds no EMA" in caplog.text and "step 7" in caplog.text
    assert ema.updates == 0
    for (_, p), average in zip(ema.named, ema.average):
        assert torch.equal(p, average)


def test_an_ema_file_of_other_weights_is_a_damaged_checkpoint(tmp_path):
    WeightAverage(torch.nn.Linear(5, 5), EmaConfig(decay=0.9), 0, writes=True).write(tmp_path)
    ema = WeightAverage(_model(), EmaConfig(decay=0.9), 0, writes=True)
    with pytest.raises(CheckpointError, match=file_name(0)):
        ema.resume(tmp_path, 1, logs=True)


@pytest.fixture(scope="module")
def base():
    return _compose([])


def _with(base, **values):
    cfg = copy.deepcopy(base)
    for key, value in values.items():
        OmegaConf.update(cfg, key.replace("__", "."), value)
    return cfg


@pytest.mark.parametrize("values,message", [
    ({"train__ema__decay": 1.0}, "train.ema.decay must be in [0, 1)"),
    ({"train__ema__decay": float("nan")}, "train.ema.decay must be in [0, 1)"),
    ({"train__ema__every_steps": 0}, "train.ema.every_steps must be >= 1"),
    ({"sample__ema": True}, "sample.ema=true"),
    ({"train__ema__decay": 0.99, "optim__name": "schedulefree_adamw", "optim__schedule":
      "constant"}, "schedule-free AdamW already"),
])
def test_ema_mistakes_name_the_key(base, values, message):
    with pytest.raises(ConfigError) as err:
        validate(_with(base, **values))
    assert message in str(err.value)


def test_an_ema_with_samples_from_it_is_valid(base):
    run = validate(_with(base, train__ema__decay=0.999, train__ema__cpu=True, sample__ema=True))
    assert run.train.ema.decay == 0.999 and run.sample.ema


def test_a_checkpoint_from_before_the_ema_keys_resumes_with_no_change_logged():
    current = run_yaml()
    saved = OmegaConf.to_container(OmegaConf.create(current))
    del saved["train"]["ema"], saved["sample"]["ema"]
    assert resume_changes(OmegaConf.to_yaml(OmegaConf.create(saved)), current) == ({}, {})
    _, harmless = resume_changes(current, run_yaml("train.ema.decay=0.9"))
    assert harmless == {"train.ema.decay": (0.0, 0.9)}  # turning it on is allowed, and logged
