"""The step loader: worker processes yield exactly the micro-batches (and batch log) that the
training process makes itself, from any starting step (a resumed run), in order."""

from __future__ import annotations

import io

import pytest
import torch

from dpipe.config.schema import TimestepConfig
from dpipe.data.batches import step_micro_batches
from dpipe.data.loader import StepLoader
from dpipe.data.prepare import Layout, prepare
from dpipe.errors import DataError
from tests.unit.test_data_support import dataset_config, tiny_flux_spec, write_image

STEPS = 6
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def flux_data(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("loader")
    for i in range(6):  # two aspect buckets, three files each
        write_image(tmp / "data" / f"{i}.png", (64, 32) if i % 2 else (32, 64), seed=i,
                    caption=f"tag{i}, red, a photo")
    # Caption dropout and tag shuffling: every random choice of the step is exercised.
    cfg = dataset_config(path=str(tmp / "data"), cache_dir=str(tmp / "cache"), resolutions=[32],
                         aspect_ratios=[0.5, 2.0], caption_dropout=0.3, shuffle_tags=True)
    spec = tiny_flux_spec()
    dataset = prepare(spec, cfg, CPU, torch.float32, Layout(1, 2, 1, 0))
    return spec, dataset


def _maker(spec, dataset):
    def make_step(step, records):
        return step_micro_batches(spec, dataset, dataset.plan, TimestepConfig(), 7, step, 0,
                                  records)
    return make_step


def _in_process(spec, dataset, first):
    dataset.log = io.StringIO()
    batches = [list(step_micro_batches(spec, dataset, dataset.plan, TimestepConfig(), 7, s, 0))
               for s in range(first, STEPS)]
    return batches, dataset.log.getvalue()


def _from_workers(spec, dataset, first, workers=2):
    dataset.log = io.StringIO()
    loader = StepLoader(_maker(spec, dataset), first, STEPS, workers, CPU, dataset.write_record)
    try:
        batches = [list(loader.next(s)) for s in range(first, STEPS)]
    finally:
        loader.close()
    return batches, dataset.log.getvalue()


def _assert_same(a, b, atol=0.0):
    assert len(a) == len(b)
    for step_a, step_b in zip(a, b):
        assert len(step_a) == len(step_b) == 2  # micro-batches
        for (in_a, lab_a), (in_b, lab_b) in zip(step_a, step_b):
            for x, y in zip(in_a + lab_a, in_b + lab_b, strict=True):
                assert x.dtype == y.dtype and torch.allclose(x, y, rtol=0, atol=atol)


@pytest.mark.parametrize("first", [0, 3], ids=["from-start", "resumed-at-3"])
def test_workers_yield_exactly_the_in_process_batches(flux_data, first):
    spec, dataset = flux_data
    expected, expected_log = _in_process(spec, dataset, first)
    got, log = _from_workers(spec, dataset, first)
    _assert_same(got, expected)
    assert log == expected_log and log.count("\n") == 2 * (STEPS - first)
    # The steps differ from each other: equality above is not of constants.
    assert not torch.equal(expected[0][0][0][0], expected[1][0][0][0])


def test_in_process_loader_is_the_plain_path(flux_data):
    spec, dataset = flux_data
    expected, _ = _in_process(spec, dataset, 0)
    got, _ = _from_workers(spec, dataset, 0, workers=0)
    _assert_same(got, expected)


def test_a_data_error_in_a_worker_reaches_the_user_unchanged(flux_data):
    def make_step(step, records):
        if step == 1:
            raise DataError("the cache entry for a.png vanished")
        return iter([((torch.zeros(1),), (torch.zeros(1),))])

    loader = StepLoader(make_step, 0, 3, 1, CPU)
    try:
        assert len(list(loader.next(0))) == 1
        with pytest.raises(DataError, match="the cache entry for a.png vanished"):
            loader.next(1)
    finally:
        loader.close()


def test_steps_must_be_asked_for_in_order(flux_data):
    loader = StepLoader(lambda step, records: iter([]), 2, 5, 0, CPU)
    with pytest.raises(RuntimeError, match="asked for step 3, expected 2"):
        loader.next(3)


def test_a_damaged_entry_met_in_a_worker_is_re_made_by_the_main_process(flux_data, caplog):
    # A worker cannot encode (the encoders belong on the rank's device): it hands the step to
    # the main process, which re-makes the entry and makes the same batches (to float rounding:
    # the VAE encodes the file alone now, in a batch of 3 before).
    spec, dataset = flux_data
    expected, _ = _in_process(spec, dataset, 0)
    sample = dataset.plan.micro_batch(0, 0, 0).samples[0]
    path = dataset.store.path_for(sample.latent)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # an exponent bit of the last value: times 4 or a quarter
    path.write_bytes(bytes(data))
    with caplog.at_level("WARNING", logger="dpipe.data.batches"):
        got, _ = _from_workers(spec, dataset, 0)
    _assert_same(got, expected, atol=1e-5)
    assert dataset.store.verify(sample.latent) is True
    said = [r.getMessage() for r in _remade(caplog) if str(path) in r.getMessage()]
    assert len(said) == 1 and said[0].startswith(
        f"the cache entry of {sample.source} (latents, {path}) was damaged (its tensors do not "
        "match their checksum): re-made it"), said


def test_an_entry_removed_while_training_is_re_made(flux_data, caplog):
    # E.g. `dpipe-cache verify --remove` or a prune while the run trains: made again, not fatal.
    spec, dataset = flux_data
    expected, _ = _in_process(spec, dataset, 0)
    sample = dataset.plan.micro_batch(0, 1, 0).samples[0]
    text = _text_of(dataset, 0, 1)
    dataset.store.remove(text)
    with caplog.at_level("WARNING", logger="dpipe.data.batches"):
        got, _ = _from_workers(spec, dataset, 0, workers=0)
    _assert_same(got, expected, atol=1e-5)
    assert dataset.store.verify(text) is True
    assert [r.getMessage().split(": re-made it")[0] for r in _remade(caplog)] == [
        f"the cache entry of {sample.source} (caption embedding, "
        f"{dataset.store.path_for(text)}) was missing"]


def _text_of(dataset, step, micro):
    """The text key that micro-batch `micro` of `step` trains its first sample on."""
    from dpipe.data.batches import choose_texts

    batch = dataset.plan.micro_batch(step, micro, 0)
    return choose_texts(batch.samples, batch.empty_text, 7, step, batch.slots)[0]


def test_a_damaged_sample_prompt_entry_is_re_made(tmp_path, caplog):
    # Samples made while training read their prompts' embeddings from the same cache.
    from dpipe.models.sampling import SampleRequest

    write_image(tmp_path / "data" / "0.png", (32, 32), seed=0, caption="a photo")
    cfg = dataset_config(path=str(tmp_path / "data"), cache_dir=str(tmp_path / "cache"),
                         resolutions=[32])
    request = SampleRequest(index=0, prompt="a red cube", negative_prompt="", seed=0, width=32,
                            height=32)
    dataset = prepare(tiny_flux_spec(), cfg, CPU, torch.float32, Layout(),
                      sample_requests=[request])
    prompt = dataset.request_keys[0][0]
    # Copies: the store's tensors map the file, which the test then rewrites in place.
    before = {k: v.clone() for k, v in dataset.store.get(prompt).items()}
    path = dataset.store.path_for(prompt)
    path.write_bytes(path.read_bytes()[:-8])
    with caplog.at_level("WARNING", logger="dpipe.data.batches"):
        after = dataset.entry(prompt, "sample.prompts[0]", "prompt embedding")
    assert before.keys() == after.keys()
    assert all(torch.allclose(before[k], after[k], rtol=0, atol=1e-5) for k in before)
    assert [r.getMessage().split(" (unreadable")[0] for r in _remade(caplog)] == [
        f"the cache entry of sample.prompts[0] (prompt embedding, {path}) was damaged"]


def _remade(caplog):
    """The log records of entries re-made (not those of preparing the data)."""
    return [r for r in caplog.records if r.name == "dpipe.data.batches"]
