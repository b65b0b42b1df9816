"""Every model family, on its tiny flavor, through the same checks.

All runs are points of two sweeps (`dpipe-train -m model=...`, LoRA and full), so the workers of
every family's run are forked from one fork server that imported the libraries once.

1. A 2-stage LoRA run in 2 processes, on a folder of images captioned in 1 to 9 words: its
   first loss equals the 1-stage loss of the same micro-batches (for the families that cut text
   padding, micro-batches whose text differs in length); its exported LoRA, loaded the way users
   load it, reproduces the trained model.
2. A full fine-tune, in this process on the same micro-batches: gradients reach every pipeline
   layer, and the weights written as per-stage shards by the trainer's own shard writer, turned
   into the family's folder by its `export_full` and loaded with `from_pretrained`, reproduce the
   updated layers.
3. For a few families whose layers differ most (FLUX.1, the SDXL UNet with skips across stages,
   Wan i2v video, the HiDream MoE): a real 3-stage, 2-step full fine-tune in 3 processes whose
   first loss is the 1-stage loss and whose export reproduces the denoiser. Full and LoRA runs
   share all engine code (the mode only decides which parameters train), so one real full run
   per kind of layer is enough; step 2 covers the rest. Three stages give these runs a middle
   stage, which receives activations and gradients both: HiDream's pass int64 ids and masks
   between float tensors, and DeepSpeed's shared receive buffers once failed there in step 2.

4. Every run samples before training and at its end through its stages (`sample.save_latents`):
   the final latents equal those of the family's diffusers pipeline from the exported weights
   (the LoRA, loaded the way users load it; the full fine-tune's folder), with the same prompt,
   seed and steps, and differ from the first round's (the base model's).

Add a family by adding its tiny config name to the list of its sample group.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.cli import Sweep, metrics
from tests.integration.trained import (
    cached_dataset, exported_lora_and_trained, one_process_first_loss, run_config, run_layers,
    trained_layers)

# By what their samples need: text-to-image, text-to-video (a clip and an image each), and
# families that sample from a control image (an edit, a first frame).
IMAGE_FAMILIES = ["tiny_flux", "tiny_auraflow", "tiny_sdxl", "tiny_hunyuan_image", "tiny_hidream",
                  "tiny_sd3", "tiny_chroma", "tiny_z_image", "tiny_cosmos_predict2",
                  "tiny_lumina2", "tiny_flux2", "tiny_qwen_image", "tiny_krea2",
                  "tiny_ernie_image", "tiny_ideogram4", "tiny_anima", "tiny_omnigen2"]
VIDEO_FAMILIES = ["tiny_hunyuan_video", "tiny_ltx_video", "tiny_hunyuan_video15", "tiny_ltx2",
                  "tiny_wan", "tiny_wan22_ti2v", "tiny_wan22_a14b", "tiny_ltx23",
                  "tiny_cosmos1"]
EDIT_FAMILIES = ["tiny_flux_kontext"]
FIRST_FRAME_FAMILIES = ["tiny_wan_i2v", "tiny_cosmos_predict2_v2w"]
# Video with its soundtrack, sampled as their pipelines make it: MiniMax H3 (5 s at the least).
AUDIO_VIDEO_FAMILIES = ["tiny_minimax_h3"]
FAMILIES = (IMAGE_FAMILIES + VIDEO_FAMILIES + EDIT_FAMILIES + FIRST_FRAME_FAMILIES
            + AUDIO_VIDEO_FAMILIES)
FULL_RUN_FAMILIES = ["tiny_flux", "tiny_sdxl", "tiny_wan_i2v", "tiny_hidream"]
# Families that cut each micro-batch's text to its longest prompt (dpipe.models.attention_mask):
# their stages pass text of another length with each micro-batch (inputs[2]).
TEXT_TRIMMED = ["tiny_hunyuan_video", "tiny_qwen_image", "tiny_chroma", "tiny_z_image",
                "tiny_lumina2", "tiny_hunyuan_image", "tiny_ltx_video", "tiny_hunyuan_video15"]
# The runs' dataset: captions of 1 to 9 words (within the tiny Ideogram 4's 32 text tokens), so
# that any two micro-batches differ in length.
CAPTIONS = ["red", "a small blue circle drawn on a green background", "two stars",
            "an orange triangle on grey"]
SWEEP = ["dataset=folder", "dataset.resolutions=[64]", "pipeline.micro_batches=2", "optim.lr=1e-3",
         "train.checkpoint_every_steps=0", "train.progress_bar=false",
         "sample.save_latents=true", "sample.at_start=true"]
PROMPT = "a red circle on a blue background"


def sample_args(model: str, control: Path) -> list[str]:
    """The sample.prompts (and steps) of a family's group; the samples are made before training
    and at the end of its run, through its 2 (LoRA) or 3 (full) stages, with the family's
    default guidance."""
    if model in VIDEO_FAMILIES:  # a 9-frame clip and an image, pipelined together. 3 steps:
        # Wan 2.2 A14B's trained (low-noise) expert takes the third, the frozen one the first two
        return [f"sample.prompts=[{{prompt: {PROMPT}, frames: 9}}, {{prompt: a cat, seed: 5}}]",
                "sample.steps=3"]
    if model in EDIT_FAMILIES:
        return [f"sample.prompts=[{{prompt: {PROMPT}, control: {control}}}]", "sample.steps=2"]
    if model in FIRST_FRAME_FAMILIES:
        return [f"sample.prompts=[{{prompt: {PROMPT}, control: {control}, frames: 9}}]",
                "sample.steps=2"]
    if model in AUDIO_VIDEO_FAMILIES:  # 124 frames (17k+5, 5 s at 24 fps) and their audio
        return [f"sample.prompts=[{{prompt: {PROMPT}, frames: 124}}]", "sample.steps=2"]
    return [f"sample.prompts=[{PROMPT}]", "sample.steps=2"]


def _group(model: str) -> list[str]:
    return next(g for g in (IMAGE_FAMILIES, VIDEO_FAMILIES, EDIT_FAMILIES, FIRST_FRAME_FAMILIES,
                             AUDIO_VIDEO_FAMILIES) if model in g)


@pytest.fixture(scope="module")
def captioned(tmp_path_factory) -> Path:
    """The runs' dataset folder: 4 images, their captions of CAPTIONS' lengths."""
    from dpipe.data.synthetic import draw_shape

    folder = tmp_path_factory.mktemp("captioned")
    for i, caption in enumerate(CAPTIONS):
        draw_shape(i, 64)[0].save(folder / f"image{i}.png")
        (folder / f"image{i}.txt").write_text(caption)
    return folder


@pytest.fixture(scope="module")
def control_image(tmp_path_factory) -> Path:
    from dpipe.data.synthetic import draw_shape

    path = tmp_path_factory.mktemp("control") / "control.png"
    draw_shape(3, 64)[0].save(path)
    return path


class SweepsByGroup:
    """One sweep per sample group (their sample.prompts differ), made when first needed."""

    def __init__(self, root: Path, control: Path, folder: Path, families: list[str], *args: str):
        self.root, self.control, self.families = root, control, families
        self.args = (f"dataset.path={folder}", *args)
        self.sweeps: dict[str, Sweep] = {}

    def run_dir(self, model: str) -> Path:
        group = [m for m in _group(model) if m in self.families]
        key = group[0]
        if key not in self.sweeps:
            self.sweeps[key] = Sweep(self.root / key, f"model={','.join(group)}", *SWEEP,
                                     *sample_args(key, self.control), *self.args)
        return self.sweeps[key].run_dir(f"model={model}")


@pytest.fixture(scope="module")
def lora_sweep(tmp_path_factory, control_image, captioned) -> SweepsByGroup:
    return SweepsByGroup(tmp_path_factory.mktemp("lora"), control_image, captioned, FAMILIES,
                         "pipeline.stages=2", "train.max_steps=2")


@pytest.fixture(scope="module")
def full_sweep(tmp_path_factory, control_image, captioned) -> SweepsByGroup:
    # A middle stage (3 stages) and a second step: see point 3 of the module docstring.
    return SweepsByGroup(tmp_path_factory.mktemp("full"), control_image, captioned,
                         FULL_RUN_FAMILIES,
                         "pipeline.stages=3", "train.max_steps=2", "model.mode=full")


@pytest.fixture(params=FAMILIES)
def lora_run(request, lora_sweep) -> Path:
    return lora_sweep.run_dir(request.param)


@pytest.mark.slow
@pytest.mark.parametrize("model", FULL_RUN_FAMILIES)
def test_layers_reproduce_the_denoiser(model, full_sweep):
    run_dir = full_sweep.run_dir(model)
    spec, layers = trained_layers(run_dir)
    dataset, plan = cached_dataset(run_dir)
    from dpipe.data.batches import step_micro_batches

    inputs, _ = next(step_micro_batches(spec, dataset, plan, run_config(run_dir).train.timesteps,
                                        0, 0, 0))
    denoiser = spec.load_exported_full(run_dir / "model")
    with torch.no_grad():
        expected = spec.denoiser_forward(denoiser, inputs)
    torch.testing.assert_close(run_layers(layers, inputs), expected, rtol=1e-5, atol=1e-6)
    base = spec.load_denoiser(torch.float32)
    changed = sum(not torch.equal(p, q) for p, q in zip(base.parameters(), denoiser.parameters()))
    assert changed > 10, "a full fine-tune should update weights throughout the model"


@pytest.mark.slow
@pytest.mark.parametrize("model", FULL_RUN_FAMILIES)
def test_three_stage_full_run_trains_two_steps_from_the_one_stage_loss(model, full_sweep):
    run_dir = full_sweep.run_dir(model)
    steps = metrics(run_dir)
    assert [m["step"] for m in steps] == [1, 2]
    assert steps[0]["loss"] == pytest.approx(one_process_first_loss(run_dir), rel=1e-5, abs=1e-7)


# fp32 through the stages (gloo) against diffusers in one process: the same operations, split
# and ordered differently (diffusers batches the negative prompt with the prompt).
SAMPLE_TOLERANCE = dict(rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_staged_samples_equal_the_diffusers_pipeline(lora_run):
    _check_samples(lora_run, lora_run / "lora", full=False)


@pytest.mark.slow
@pytest.mark.parametrize("model", FULL_RUN_FAMILIES)
def test_staged_samples_of_a_full_fine_tune_equal_the_diffusers_pipeline(model, full_sweep):
    run_dir = full_sweep.run_dir(model)
    _check_samples(run_dir, run_dir / "model", full=True)


def _check_samples(run_dir: Path, weights: Path, full: bool) -> None:
    from tests.integration.sampled import diffusers_latents, saved_latents

    expected = diffusers_latents(run_dir, weights, full)
    for k, latents in enumerate(expected):
        got = saved_latents(run_dir / "samples" / "step_2", k)
        torch.testing.assert_close(got, latents, **SAMPLE_TOLERANCE, msg=f"sample {k}")
        before = saved_latents(run_dir / "samples" / "step_0", k)  # the base model's
        assert (got - before).abs().max() > 10 * SAMPLE_TOLERANCE["atol"], \
            "training left the sample unchanged: the check could not tell the weights apart"


@pytest.mark.slow
def test_two_stage_loss_equals_one_stage_loss(lora_run, request):
    """Also where the stages pass text of another length with each micro-batch (TEXT_TRIMMED)."""
    one_stage = one_process_first_loss(lora_run)
    two_stage = metrics(lora_run)[0]["loss"]
    assert two_stage == pytest.approx(one_stage, rel=1e-5, abs=1e-7)
    if request.node.callspec.params["lora_run"] in TEXT_TRIMMED:
        from dpipe.data.batches import step_micro_batches
        from dpipe.models.registry import build_spec

        run = run_config(lora_run)
        dataset, plan = cached_dataset(lora_run)
        lengths = {inputs[2].shape[1] for inputs, _ in step_micro_batches(
            build_spec(run.model), dataset, plan, run.train.timesteps, run.train.seed, 0, 0)}
        assert len(lengths) > 1, "the micro-batches' text should differ in length"


def test_training_counts_its_flops(lora_run):
    """The step's FLOPs are counted on the meta device from the family's denoiser (TFLOP/s in
    the log and the metrics): Anima's, made of two diffusers models, was not."""
    assert "TFLOP/s not reported" not in (lora_run / "train.log").read_text()
    assert any(m.get("tflops_per_gpu", 0) > 0 for m in metrics(lora_run))


@pytest.mark.slow
def test_a_training_step_makes_no_host_sync(lora_run):
    """The audited step (train.audit_step=2) of every family's 2-stage run: on the CPU the audit
    counts the operations that would sync on a GPU (a value read to the host, a shape that
    depends on values), in the family's layers and the trainer alike."""
    audited = [m for m in metrics(lora_run) if "audited_step" in m]
    assert [m["audited_step"] for m in audited] == [2]
    assert audited[0]["host_syncs"] == 0


@pytest.mark.slow
def test_exported_lora_reproduces_the_trained_model(lora_run):
    spec, layers = trained_layers(lora_run)
    inputs, with_lora, trained = exported_lora_and_trained(lora_run, spec, layers)
    with torch.no_grad():
        base = spec.denoiser_forward(spec.load_denoiser(torch.float32), inputs)
    assert (with_lora - base).abs().max() > 1e-5, "training left the LoRA without effect"
    torch.testing.assert_close(with_lora, trained, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_full_fine_tune_exports_what_it_trained(lora_run, tmp_path):
    from dpipe.config.schema import TrainMode
    from dpipe.data.batches import step_micro_batches
    from dpipe.models.registry import build_spec
    from dpipe.train.export import write_stage_shard
    from dpipe.train.trainable import trainable_layers

    run = run_config(lora_run)
    run.model.mode = TrainMode.full
    spec = build_spec(run.model)
    layers = trainable_layers(spec, run)
    dataset, plan = cached_dataset(lora_run)
    inputs, labels = next(step_micro_batches(spec, dataset, plan, run.train.timesteps, 0, 0, 0))
    x = inputs
    for layer in layers:
        x = layer(x)
    spec.loss(x, labels).backward()
    for i, layer in enumerate(layers):
        if not any(True for _ in layer.parameters()):
            continue  # a layer that only rearranges tensors (e.g. Z-Image's join of streams)
        grads = [p.grad for p in layer.parameters() if p.grad is not None]
        assert any(g.abs().sum() > 0 for g in grads), f"no gradient reaches layer {i} ({type(layer).__name__})"
    params = [p for layer in layers for p in layer.parameters()]
    torch.optim.AdamW(params, lr=1e-3).step()

    half = len(layers) // 2
    shards = [tmp_path / "stage-000.safetensors", tmp_path / "stage-001.safetensors"]
    write_stage_shard(layers[:half], False, shards[0])
    write_stage_shard(layers[half:], False, shards[1])
    spec.export_full(shards, tmp_path / "model")
    exported = spec.load_exported_full(tmp_path / "model")
    with torch.no_grad():
        base = spec.denoiser_forward(spec.load_denoiser(torch.float32), inputs)
        expected = spec.denoiser_forward(exported, inputs)
    trained = run_layers(layers, inputs)
    assert (trained - base).abs().max() > 1e-5, "the update left the model unchanged"
    torch.testing.assert_close(expected, trained, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_layers_run_on_the_meta_device(lora_run):
    """Forward and backward through every layer on the meta device, where tensors have no values:
    a layer that makes a tensor on another device (the CPU, by leaving out `device=`) or reads a
    tensor's values on the host (`.tolist()`, `int(t)`, indexing by a mask) fails here. On a GPU
    the first fails outright and the second is a host sync in every layer and micro-batch."""
    from dpipe.data.batches import step_micro_batches
    from dpipe.models.registry import build_spec
    from dpipe.train.trainable import trainable_layers

    run = run_config(lora_run)
    spec = build_spec(run.model)
    meta = torch.device("meta")
    layers = [layer.to(meta) for layer in trainable_layers(spec, run)]
    dataset, plan = cached_dataset(lora_run)
    inputs, labels = next(step_micro_batches(spec, dataset, plan, run.train.timesteps, 0, 0, 0))
    x = tuple(t.to(meta) for t in inputs)

    def train_step():
        y = x
        for i, layer in enumerate(layers):
            if i:  # as at a stage boundary: every float input takes a gradient
                y = tuple(t.detach().requires_grad_() if t.is_floating_point() else t for t in y)
            y = layer(y)
        spec.loss(y, tuple(t.to(meta) for t in labels)).backward()

    train_step()


# Families whose attention processors call PyTorch directly, not diffusers' attention dispatcher:
# `model.attention` cannot choose their kernel, and flex is refused with a message.
# (OmniGen2: diffusers' Lumina 2 blocks; Cosmos 1.0: the Cosmos attention processors.)
NOT_DISPATCHED = {"auraflow", "sdxl", "hidream", "sd3", "cosmos_predict2", "lumina2", "cosmos1",
                  "omnigen2"}


@pytest.mark.slow
def test_flex_attention_gives_sdpa_output_or_is_refused(lora_run, monkeypatch):
    """`model.attention=flex` routes each family's attention (under its masks: text padding,
    joint streams) through FlexAttention and gives sdpa's output. The CPU has no FlexAttention
    backward: the forward is compared here, training with it is tests/gpu's."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry
    from torch.nn.attention import flex_attention

    from dpipe.config.schema import AttentionKernel
    from dpipe.data.batches import step_micro_batches
    from dpipe.errors import ConfigError
    from dpipe.models.registry import build_spec
    from dpipe.pipeline.attention import use_attention_kernel
    from dpipe.train.trainable import trainable_layers

    run = run_config(lora_run)
    spec = build_spec(run.model)
    denoiser = spec.load_denoiser(torch.float32)
    layers = trainable_layers(spec, run, denoiser)
    dataset, plan = cached_dataset(lora_run)
    inputs, _ = next(step_micro_batches(spec, dataset, plan, run.train.timesteps, 0, 0, 0))
    run.model.attention = AttentionKernel.flex
    # set_attention_backend also sets diffusers' process-wide default, which later tests in this
    # process would inherit: restored after the test.
    monkeypatch.setattr(_AttentionBackendRegistry, "_active_backend",
                        _AttentionBackendRegistry._active_backend)
    if spec.family in NOT_DISPATCHED:
        with pytest.raises(ConfigError, match=f"model.family={spec.family}.*model.attention=sdpa"):
            use_attention_kernel(denoiser, run.model)
        return
    with torch.no_grad():
        sdpa = run_layers(layers, inputs)
        use_attention_kernel(denoiser, run.model)
        # Layers that build their own masks build them for the kernel (dpipe.models.attention_mask)
        assert spec.cfg.attention == AttentionKernel.flex
        layers = spec.pipeline_layers(denoiser)
        calls = []
        flex = flex_attention.flex_attention
        monkeypatch.setattr(flex_attention, "flex_attention",
                            lambda *args, **kw: calls.append(1) or flex(*args, **kw))
        flexed = run_layers(layers, inputs)
    assert calls, "no attention went through FlexAttention"
    torch.testing.assert_close(flexed, sdpa, rtol=1e-4, atol=1e-5)
