"""Sweep points' folder names: any overrides give a valid, distinct folder name."""

from dpipe.launch.dirnames import MAX_NAME, sweep_dirname


def test_short_names_stay_as_they_are():
    assert sweep_dirname("model=tiny_flux,optim.lr=0.001") == "model=tiny_flux,optim.lr=0.001"


def test_paths_and_long_overrides_become_one_short_distinct_name():
    prompts = "sample.prompts=[{prompt: a cat, control: /data/control/cat.png}]," + "x" * 300
    a, b = sweep_dirname(prompts + "1"), sweep_dirname(prompts + "2")
    assert "/" not in a and len(a.encode()) <= MAX_NAME
    assert a != b and a.startswith("sample.prompts=[{prompt: a cat, control: _data_control_")
