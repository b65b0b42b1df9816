"""Each stage's peak GPU memory, and the hint for a pipeline whose stages would fit on one GPU."""

from dpipe.train.gpu_memory import one_gpu_hint, stage_peaks


def test_each_stage_takes_its_highest_data_parallel_rank():
    # ranks 0-3: stages 0, 1, 0, 1 (2 stages x 2 data-parallel)
    assert stage_peaks([0, 1, 0, 1], [30.0, 20.0, 31.5, 19.0]) == [31.5, 20.0]
    assert stage_peaks([0], [54.2]) == [54.2]


def test_hint_only_for_several_stages_that_fit_together():
    hint = one_gpu_hint([33.1, 31.5], 128.6)
    assert hint is not None and "64.6 GiB" in hint and "pipeline=data_parallel" in hint
    # FLUX.1-dev's full fine-tune on 2 H200s (docs/performance.md): 117 GiB on one GPU, in fact.
    assert one_gpu_hint([65.1, 62.1], 128.6) is not None
    assert one_gpu_hint([70.0, 70.0], 128.6) is None  # does not fit
    assert one_gpu_hint([54.2], 128.6) is None  # one stage: nothing to say
