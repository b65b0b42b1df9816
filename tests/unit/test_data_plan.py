"""The batch plan: a pure function of (manifest, layout, seed, step); every micro-batch inside
one bucket on every rank; each epoch reshuffled; a resume continues the saved order exactly, even
after the dataset changed."""

from __future__ import annotations

from collections import Counter

import pytest

from dpipe.data.manifest import Bucket, Manifest, Sample, describe_changes
from dpipe.data.plan import BatchPlan, load_history
from dpipe.errors import DataError


def _manifest(sizes: dict[str, int], mbs: dict[str, int] | None = None, extra: str = "",
              repeats: int = 1) -> Manifest:
    buckets = []
    for name, n in sizes.items():
        w, h = map(int, name.split("x"))
        samples = [Sample(f"{name}/{i}{extra}.png", 0, f"{name}-{i}{extra}", (f"t{i}",),
                          repeats=repeats) for i in range(n)]
        buckets.append(Bucket(name, w, h, 1, 64, (mbs or {}).get(name, 1), samples))
    return Manifest(buckets)


def _plan(manifest, mbs=1, micro=2, dp=2, seed=0, **kw):
    return BatchPlan(manifest, mbs, micro, dp, seed, **kw)


def _epoch(plan, epoch):
    spe = plan.steps_per_epoch
    out = []
    for step in range(epoch * spe, (epoch + 1) * spe):
        for micro in range(plan.micro_batches):
            out.append([plan.micro_batch(step, micro, r) for r in range(plan.data_parallel)])
    return out


def test_every_micro_batch_stays_in_one_bucket_on_every_rank():
    m = _manifest({"64x64": 10, "88x48": 7, "48x88": 5}, mbs={"64x64": 2})
    plan = _plan(m, micro=2, dp=2)
    # Batches: 64x64 -> 10 // (2*2) = 2; 88x48 -> 3; 48x88 -> 2: 7 batches -> 3 steps.
    assert plan.steps_per_epoch == 3
    for ranks in _epoch(plan, 0):
        assert len({mb.bucket.name for mb in ranks}) == 1  # DP ranks agree on the bucket
        for mb in ranks:
            assert len(mb.samples) == mb.bucket.micro_batch_size
            assert all(s.source.startswith(mb.bucket.name) for s in mb.samples)


def test_an_epoch_uses_each_sample_at_most_once_and_reshuffles():
    m = _manifest({"64x64": 12, "88x48": 8}, repeats=2)
    plan = _plan(m, micro=2, dp=2)
    first = [s.source for ranks in _epoch(plan, 0) for mb in ranks for s in mb.samples]
    assert max(Counter(first).values()) <= 2  # repeats: twice per epoch
    assert len(first) == plan.steps_per_epoch * plan.global_batch == 40
    second = [s.source for ranks in _epoch(plan, 1) for mb in ranks for s in mb.samples]
    assert first != second and sorted(first) == sorted(second)


def test_the_plan_is_a_function_of_its_inputs():
    m = _manifest({"64x64": 9, "88x48": 6})
    a, b = _plan(m, seed=3), _plan(_manifest({"64x64": 9, "88x48": 6}), seed=3)
    assert [[mb.samples for mb in r] for r in _epoch(a, 4)] == \
        [[mb.samples for mb in r] for r in _epoch(b, 4)]
    assert _epoch(a, 0) != _epoch(_plan(m, seed=4), 0)


def test_noise_slots_are_distinct_within_a_step():
    plan = _plan(_manifest({"64x64": 16, "88x48": 16}, mbs={"64x64": 2}), micro=4, dp=2)
    slots = [i for r in range(2) for micro in range(4) for i in plan.micro_batch(0, micro, r).slots]
    assert len(slots) == len(set(slots))


def test_too_little_data_for_one_step_is_an_error():
    with pytest.raises(DataError, match="no bucket fills one step"):
        _plan(_manifest({"64x64": 3}), micro=2, dp=2)


def _order(plan, steps):
    return [[s.source for r in range(plan.data_parallel) for micro in range(plan.micro_batches)
             for s in plan.micro_batch(step, micro, r).samples] for step in steps]


def test_resume_after_the_dataset_changed_finishes_the_epoch_in_its_saved_order(tmp_path):
    old = _manifest({"64x64": 8, "88x48": 8})
    straight = _plan(old)
    assert straight.steps_per_epoch == 4
    straight.resume(0)
    straight.save_history(tmp_path)

    new = _manifest({"64x64": 10, "88x48": 8})  # two files added
    history, saved = load_history(tmp_path)
    resumed = _plan(new, history=history, saved=saved)
    note = resumed.resume(2, lambda keys: keys <= old.keys() | new.keys())
    assert "2 sample(s) added" in note and "continues in its saved order until step 4" in note
    assert _order(resumed, [2, 3]) == _order(straight, [2, 3])
    # From the next epoch on, the new data (and its own epoch length) applies.
    segment, epoch, position = resumed.locate(4)
    assert (segment.manifest, epoch, position) == (new.digest, 1, 0)
    assert resumed.locate(4 + resumed.steps_per_epoch)[1:] == (2, 0)
    # And a second resume reads the same history back.
    resumed.save_history(tmp_path)
    again = _plan(new, history=load_history(tmp_path)[0], saved=load_history(tmp_path)[1])
    assert again.resume(3) is None
    assert _order(again, [3, 4, 5]) == _order(resumed, [3, 4, 5])


def test_resume_at_an_epoch_boundary_uses_the_new_data_at_once(tmp_path):
    old, new = _manifest({"64x64": 8}), _manifest({"64x64": 8}, extra="-edited")
    first = _plan(old)
    first.resume(0)
    first.save_history(tmp_path)
    resumed = _plan(new, history=load_history(tmp_path)[0], saved=load_history(tmp_path)[1])
    note = resumed.resume(4)
    assert "Epoch 2 uses the new data" in note
    assert resumed.locate(4)[0].manifest == new.digest


@pytest.mark.parametrize("why", ["layout", "pruned"])
def test_resume_that_cannot_replay_starts_a_new_epoch_and_says_why(tmp_path, why):
    old, new = _manifest({"64x64": 8}), _manifest({"64x64": 9}, extra="-edited")
    first = _plan(old)
    first.resume(0)
    first.save_history(tmp_path)
    history, saved = load_history(tmp_path)
    if why == "layout":
        resumed = _plan(new, micro=1, history=history, saved=saved)
        note = resumed.resume(1, lambda keys: keys <= old.keys())
        assert "batch layout changed" in note
    else:
        resumed = _plan(new, history=history, saved=saved)
        note = resumed.resume(1, lambda keys: keys <= new.keys())  # the old entries are gone
        assert "were pruned" in note
    assert "epoch 1 starts now, at step 1" in note
    assert resumed.locate(1)[1:] == (1, 0)


def test_unchanged_data_resumes_silently(tmp_path):
    m = _manifest({"64x64": 8})
    first = _plan(m)
    first.resume(0)
    first.save_history(tmp_path)
    again = _plan(_manifest({"64x64": 8}), history=load_history(tmp_path)[0],
                  saved=load_history(tmp_path)[1])
    assert again.resume(3) is None and again.segments == first.segments


def test_describe_changes_lists_files():
    old = _manifest({"64x64": 3})
    new = Manifest([Bucket("64x64", 64, 64, 1, 64, 1, [
        old.buckets[0].samples[0],
        Sample("64x64/1.png", 0, "other-key", ("t1",)),
        Sample("new.png", 0, "k", ("t",))])])
    text = describe_changes(old, new)
    assert "1 sample(s) added (new.png)" in text and "1 sample(s) removed (64x64/2.png)" in text
    assert "1 sample(s) changed (64x64/1.png)" in text


def test_manifests_keep_what_the_models_are_conditioned_on():
    import json

    plain = Sample("a.png", 0, "k", ("t",))
    rich = Sample("b.mp4", 4, "v", ("t",), None, "c", 1, 0.1, "e", (480, 640), (0, 80), 24.0)
    manifest = Manifest([Bucket("64x64", 64, 64, 1, 64, 1, [plain, rich])])
    again = Manifest.from_json(manifest.to_json())
    assert again.buckets[0].samples == [plain, rich] and again.digest == manifest.digest
    assert "e" in manifest.keys()
    # A manifest saved before these fields existed loads unchanged (same digest: resumable).
    rows = json.loads(manifest.to_json())["buckets"][0]["samples"]
    assert len(rows[0]) == 8 and len(rows[1]) == 9
