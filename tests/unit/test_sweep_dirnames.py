"""Sweep points' folder names: any overrides give a valid, distinct folder name."""

from dpipe.launch.dirnames import MAX_NAME, exclude_fixed_keys, sweep_dirname


def test_short_names_keep_every_value():
    assert sweep_dirname("model=tiny_flux,optim.lr=0.001") == "model=tiny_flux,lr=0.001"


def test_paths_and_long_overrides_become_one_short_distinct_name():
    prompts = "sample.prompts=[{prompt: a cat, control: /data/control/cat.png}]," + "x" * 300
    a, b = sweep_dirname(prompts + "1"), sweep_dirname(prompts + "2")
    assert "/" not in a and len(a.encode()) <= MAX_NAME
    assert a != b and a.startswith("prompts=[{prompt: a cat, control: _data_control_")


def test_keys_are_shortened_to_their_shortest_distinct_suffix():
    assert sweep_dirname("model.lora.rank=16,optim.lr=0.0001") == "rank=16,lr=0.0001"
    assert sweep_dirname("model.lora.rank=16,other.rank=2") == "lora.rank=16,other.rank=2"
    assert sweep_dirname("model=tiny_wan,sample.prompts=[a, b=c]") == "model=tiny_wan,prompts=[a, b=c]"


def test_only_swept_keys_name_the_folders():
    task = ["optim.lr=1e-4,5e-5", "model.lora.rank=16,32", "model=tiny_wan",
            "dataset.path=/data/a/very/long/path/of/photos", "train.max_steps=1"]
    assert exclude_fixed_keys(task, ["name"]) == ["name", "model", "dataset.path",
                                                  "train.max_steps"]
    assert exclude_fixed_keys(["model=flux", "optim.lr=1e-4"], ["name"]) is None  # nothing swept
    assert exclude_fixed_keys(["optim.lr=1e-3", "optim.lr=1e-3,5e-4"], ["name"]) == ["name"]
