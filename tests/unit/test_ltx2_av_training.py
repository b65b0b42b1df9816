"""LTX-2 and LTX-2.3 with model.audio=true: the pipeline layers run both streams and both
cross-modal attentions and equal the transformer's joint forward (`isolate_modalities=False`, as
LTX2Pipeline samples) on both outputs in fp32; gradients reach the audio path's LoRA; the loss
adds the weighted audio loss; a micro-batch without sound runs the video path alone with the same
tuple layout; the exported LoRA files reproduce both outputs in diffusers."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")


import pytest
import torch
from safetensors.torch import load_file

from dpipe.data.batches import DataBatch
from dpipe.errors import DataError
from dpipe.models.ltx_video.ltx2.audio import pack_audio, unpack_audio
from dpipe.models.ltx_video.ltx2.av_layers import LTX2AVBlock
from dpipe.models.ltx_video.ltx2.ltx23_tiny import make_tiny_ltx23
from dpipe.models.ltx_video.ltx2.spec import AUDIO_TEXT_KEY
from dpipe.models.ltx_video.ltx2.tiny import make_tiny_ltx2
from dpipe.models.ltx_video.spec import DIFFUSERS_LORA
from dpipe.models.tiny_parts import seeded
from tests.unit.video_checks import (
    CAPTIONS, assert_checkpointing_matches, lora_denoiser, lora_state_dict, run, tiny_spec)
from tests.exports import export_lora

AUDIO_CHANNELS, MEL_BINS = 2, 2  # the tiny audio VAE's latents: 4 features per audio token


@pytest.fixture(scope="module", params=["ltx2", "ltx23"])
def spec(request, tmp_path_factory):
    make = make_tiny_ltx2 if request.param == "ltx2" else make_tiny_ltx23
    path = make(tmp_path_factory.mktemp("models") / request.param)
    return tiny_spec(path, request.param, audio=True)


@pytest.fixture(scope="module")
def encoders(spec):
    return spec.load_encoders(torch.device("cpu"), torch.float32)


def audio_batch(spec, encoders, frames=9, audio_tokens=5, sound=True, t=(0.3, 0.8), seed=0,
                weights=None):
    """make_inputs' (inputs, labels) for random clips with (or without) audio latents; `weights`:
    one loss weight per sample (as a directory's loss_weight gives)."""
    with seeded(seed):
        pixels = torch.rand(2, 3, frames, 64, 64) * 2 - 1
        latents = spec.encode_videos(encoders, pixels).float()
        noise = torch.randn_like(latents)
        audio = torch.randn(2, AUDIO_CHANNELS, audio_tokens, MEL_BINS)
        audio_noise = torch.randn_like(audio)
    text = {k: v.float() for k, v in spec.encode_prompts(encoders, CAPTIONS).items()}
    t = torch.tensor(t)
    noisy, target = spec.noise(latents, noise, t)
    fields = {}
    if sound:
        audio_noisy, audio_target = spec.noise(audio, audio_noise, t)
        fields = {"audio": audio, "audio_noise": audio_noise, "audio_noisy": audio_noisy,
                  "audio_target": audio_target}
    if weights is not None:
        b, _, _, h, w = latents.shape
        fields["loss_weight"] = torch.tensor(weights).view(-1, 1, 1, 1, 1).expand(b, 1, 1, h, w)
    return spec.make_inputs(DataBatch(latents=latents, noise=noise, timesteps=t, noisy=noisy,
                                      target=target, text=text, **fields))


def test_audio_prompt_tokens_are_the_connectors(spec, encoders):
    text = spec.encode_prompts(encoders, CAPTIONS)
    embeds, mask, _, _ = encoders.encode_prompt(CAPTIONS, do_classifier_free_guidance=False,
                                                max_sequence_length=16)
    video, audio, _ = encoders.connectors(embeds, mask, padding_side="left")
    torch.testing.assert_close(text[AUDIO_TEXT_KEY], audio)
    torch.testing.assert_close(text["video_text"], video)


@pytest.mark.parametrize("frames,audio_tokens", [(9, 5), (1, 3)])
def test_layers_match_the_joint_forward(spec, encoders, frames, audio_tokens):
    inputs, labels = audio_batch(spec, encoders, frames, audio_tokens)
    assert inputs[6].shape == (2, audio_tokens, AUDIO_CHANNELS * MEL_BINS)
    denoiser = lora_denoiser(spec)
    with torch.no_grad():
        video, audio = spec.denoiser_forward(denoiser, inputs)
        got_video, got_audio = run(spec.pipeline_layers(denoiser), inputs)
        # The audio stream reaches the video (the cross-modal attention runs): other audio
        # latents give another video prediction.
        other = (*inputs[:6], torch.randn_like(inputs[6]), inputs[7])
        moved = spec.denoiser_forward(denoiser, other)[0]
    torch.testing.assert_close(got_video, video, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_audio, audio, rtol=1e-5, atol=1e-5)
    assert audio.shape == labels[-1].shape
    assert (moved - video).abs().max() > 1e-4


def test_gradients_reach_the_audio_lora_and_the_loss_weighs_audio(spec, encoders):
    inputs, labels = audio_batch(spec, encoders)
    denoiser = lora_denoiser(spec)
    names = {n.split(".lora_A")[0] for n, _ in denoiser.named_parameters() if "lora_A" in n}
    for module in ("audio_attn1.to_q", "audio_attn2.to_k", "audio_to_video_attn.to_v",
                   "video_to_audio_attn.to_out.0", "audio_ff.net.2", "attn1.to_q"):
        assert f"transformer_blocks.1.{module}" in names, module
    if spec.family == "ltx23":
        assert "transformer_blocks.0.video_to_audio_attn.to_gate_logits" in names
    layers = spec.pipeline_layers(denoiser)
    outputs = run(layers, inputs)
    loss = spec.loss(outputs, labels)
    loss.backward()
    for name, p in denoiser.named_parameters():
        if "lora_B" in name and ("audio" in name or "attn1" in name):
            assert p.grad is not None and p.grad.abs().max() > 0, name
    with torch.no_grad():
        video_loss = ((outputs[0] - labels[0]) ** 2).mean()
        audio_loss = ((outputs[1] - labels[-1]) ** 2).mean()
    torch.testing.assert_close(loss.detach(), video_loss + spec.cfg.audio_loss_weight * audio_loss)


def test_a_samples_loss_weight_weighs_its_sound_too(spec, encoders):
    """Per-sample weights (a directory's loss_weight, timestep weighting; here 2 and 0.5) weigh
    both streams of their sample."""
    inputs, labels = audio_batch(spec, encoders, weights=(2.0, 0.5))
    assert len(labels) == 4  # video target, its weights, the tokens trained; audio target
    outputs = (torch.randn_like(labels[0]), torch.randn_like(labels[-1]))
    w = torch.tensor([2.0, 0.5])
    video = ((outputs[0] - labels[0]) ** 2).flatten(1).mean(1)
    audio = ((outputs[1] - labels[-1]) ** 2).flatten(1).mean(1)
    torch.testing.assert_close(spec.loss(outputs, labels), (w * video).mean()
                               + spec.cfg.audio_loss_weight * (w * audio).mean())


def test_activation_checkpointing_gives_the_same_gradients(spec, encoders):
    inputs, labels = audio_batch(spec, encoders)
    assert_checkpointing_matches(spec, lora_denoiser(spec), inputs, labels)


def test_a_micro_batch_without_sound(spec, encoders):
    """An image or a silent clip in an audio run: zero audio tokens, the tuple's layout kept, the
    video path alone (equal to the isolated forward) and an audio loss of 0."""
    denoiser = lora_denoiser(spec)
    layers = spec.pipeline_layers(denoiser)
    with_sound = [tuple(x.shape[0] for x in run(layers[:2], audio_batch(spec, encoders)[0]))]
    for frames in (1, 9):
        inputs, labels = audio_batch(spec, encoders, frames, sound=False)
        assert inputs[6].shape == (2, 0, 4) and labels[-1].shape == (2, 0, 4)
        assert len(run(layers[:2], inputs)) == len(with_sound[0])
        with torch.no_grad():
            video, audio = spec.denoiser_forward(denoiser, inputs)
            got_video, got_audio = run(layers, inputs)
        torch.testing.assert_close(got_video, video, rtol=1e-5, atol=1e-5)
        assert got_audio.shape == (2, 0, 4)
        denoiser.zero_grad(set_to_none=True)
        loss = spec.loss(run(layers, inputs), labels)
        torch.testing.assert_close(loss.detach(), ((got_video - labels[0]) ** 2).mean())
        loss.backward()
        grads = {n: p.grad for n, p in denoiser.named_parameters() if "lora_B" in n}
        assert all(g is not None and g.abs().max() > 0 for n, g in grads.items()
                   if ".attn1." in n)
        assert all(g is None for n, g in grads.items() if "audio" in n)  # not run


def test_prior_preservation_targets_both_streams(spec, encoders):
    """Prior preservation with sound: the base model's video and audio predictions become the
    targets of the chosen rows (loss 0 on them), the other rows keep their data targets; a
    micro-batch without sound keeps its empty audio target."""
    with torch.no_grad():
        inputs, labels = audio_batch(spec, encoders)
        outputs = run(spec.pipeline_layers(lora_denoiser(spec)), inputs)
    assert spec.loss(outputs, spec.prior_labels(outputs, labels, [0, 1])) == 0
    video, audio = outputs
    prior = spec.prior_labels(outputs, labels, [1])
    torch.testing.assert_close(prior[0], torch.stack([labels[0][0], video[1]]))
    torch.testing.assert_close(prior[-1], torch.stack([labels[-1][0], audio[1]]))
    silent_inputs, silent_labels = audio_batch(spec, encoders, sound=False)
    with torch.no_grad():
        silent = run(spec.pipeline_layers(lora_denoiser(spec)), silent_inputs)
    prior = spec.prior_labels(silent, silent_labels, [0, 1])
    assert prior[-1].shape == (2, 0, 4) and spec.loss(silent, prior) == 0


def test_audio_false_keeps_the_video_only_layers(spec):
    video_only = tiny_spec(spec.path, spec.family)
    layers = video_only.pipeline_layers(video_only.load_denoiser(torch.float32))
    assert not any(isinstance(layer, LTX2AVBlock) for layer in layers)
    assert "audio" not in video_only.lora_targets()


def test_prompts_without_audio_tokens_are_refused(spec, encoders):
    inputs, _ = audio_batch(spec, encoders)
    text = {k: v for k, v in spec.encode_prompts(encoders, CAPTIONS).items()
            if k != AUDIO_TEXT_KEY}
    latents = torch.zeros(2, 8, 2, 8, 8)
    batch = DataBatch(latents=latents, noise=latents, timesteps=torch.tensor([0.5, 0.5]),
                      noisy=latents, target=latents, text=text)
    with pytest.raises(DataError, match="encode them with model.audio=true"):
        spec.make_inputs(batch)
    # Cached prompts of the two settings differ in their entries' keys.
    video_only = tiny_spec(spec.path, spec.family)
    assert spec.encoder_fingerprint("text") != video_only.encoder_fingerprint("text")
    assert "audio_prompts" not in video_only.encoder_fingerprint("text")  # old caches stay valid


def test_audio_packing_is_the_pipelines():
    from diffusers import LTX2Pipeline

    audio = torch.randn(2, 3, 5, 4)
    torch.testing.assert_close(pack_audio(audio), LTX2Pipeline._pack_audio_latents(audio))
    torch.testing.assert_close(unpack_audio(pack_audio(audio), 4), audio)


def test_exported_lora_reproduces_both_outputs(spec, encoders, tmp_path):
    denoiser = lora_denoiser(spec)
    files = export_lora(spec, lora_state_dict(denoiser), tmp_path)
    comfy = load_file(files[1])
    assert "diffusion_model.transformer_blocks.0.audio_to_video_attn.to_q.lora_A.weight" in comfy
    assert "diffusion_model.transformer_blocks.0.audio_ff.net.2.lora_B.weight" in comfy
    inputs, _ = audio_batch(spec, encoders)
    with torch.no_grad():
        expected = spec.denoiser_forward(denoiser, inputs)
        for weight_name in (DIFFUSERS_LORA, files[1].name):
            loaded = spec.denoiser_forward(spec.load_denoiser_with_lora(tmp_path, weight_name),
                                           inputs)
            for got, want in zip(loaded, expected):
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("sound", [True, False])
def test_two_stages_give_the_one_stage_gradients(spec, encoders, sound):
    """Stages as DeepSpeed's engine runs them: the second receives the first's tensors as leaves,
    and every float it received needs a gradient to send back (the head alone on the last stage
    reads few of them); the first runs its backward from those gradients. The LoRA gradients
    equal the 1-stage ones, with sound and without."""
    inputs, labels = audio_batch(spec, encoders, sound=sound)
    denoiser = lora_denoiser(spec)
    layers = spec.pipeline_layers(denoiser)

    def lora_grads():
        out = {n: p.grad.clone() for n, p in denoiser.named_parameters()
               if "lora_" in n and p.grad is not None}
        denoiser.zero_grad(set_to_none=True)
        return out

    spec.loss(run(layers, inputs), labels).backward()
    whole = lora_grads()
    for cut in (3, len(layers) - 1):
        sent = run(layers[:cut], inputs)
        received = tuple(x.detach().requires_grad_() if x.is_floating_point() else x
                         for x in sent)
        spec.loss(run(layers[cut:], received), labels).backward()
        floats = [(s, r) for s, r in zip(sent, received) if r.is_floating_point()]
        assert all(r.grad is not None for _, r in floats), "a received float has no gradient"
        torch.autograd.backward([s for s, _ in floats], [r.grad for _, r in floats])
        split = lora_grads()
        assert split.keys() == whole.keys() and any("audio" in n for n in whole) == sound
        for name in whole:
            torch.testing.assert_close(split[name], whole[name], rtol=1e-5, atol=1e-7)


def test_full_export_of_both_streams_loads(spec, tmp_path):
    from diffusers import LTX2VideoTransformer3DModel
    from safetensors.torch import save_file

    denoiser = spec.load_denoiser(torch.float32)
    with torch.no_grad():  # trained weights of both streams' embedders and heads
        for module in (denoiser.audio_proj_in, denoiser.audio_proj_out, denoiser.proj_in):
            module.weight.add_(1.0)
    layers = spec.pipeline_layers(denoiser)
    shards = []
    for i, part in enumerate((layers[:3], layers[3:])):
        state = {}
        for layer in part:
            state.update(layer.denoiser_state_dict(trainable_only=False))
        shards.append(tmp_path / f"stage-{i}.safetensors")
        save_file({k: v.contiguous() for k, v in state.items()}, shards[-1])
    loaded = LTX2VideoTransformer3DModel.from_pretrained(spec.export_full(shards, tmp_path / "o"))
    want = denoiser.state_dict()
    assert loaded.state_dict().keys() == want.keys()
    for k, v in loaded.state_dict().items():
        torch.testing.assert_close(v, want[k], msg=k)


def test_layer_costs_and_flops_count_the_audio_stream(spec, encoders):
    denoiser = spec.load_denoiser(torch.float32)
    layers = spec.pipeline_layers(denoiser)
    costs = spec.layer_costs(layers)
    blocks = [c for layer, c in zip(layers, costs) if isinstance(layer, LTX2AVBlock)]
    assert len(blocks) == 4 and len(set(blocks)) == 1  # every block runs both streams
    if spec.family != "ltx23":  # the FLOP model is LTX-2.3's (dpipe-bench)
        return
    with_sound, _ = audio_batch(spec, encoders)
    silent, _ = audio_batch(spec, encoders, sound=False)
    video_only = tiny_spec(spec.path, spec.family)
    flops = [s.train_flops(denoiser, x, full=False)
             for s, x in ((spec, with_sound), (spec, silent), (video_only, silent[:6]))]
    assert flops[0] > flops[1] and flops[1] == flops[2]


def test_compiled_layers_trace_whole_and_keep_their_graphs_for_new_tensors(spec, encoders):
    """Each block and the head compile to one graph that serves the next micro-batch (new
    tensors, same shapes) without recompiling. On an H100 on 2026-12-06 the head guarded on its
    inputs' identities (`id()`), so every call recompiled: tiny LTX-2.3 with sound took 3.5 s per
    step against 0.26 s for video alone, with ~14,900 host syncs per step, and the released size
    ran 8x slower than video alone. The embedding layer is left out: like every family's first
    layer, its `requires_grad_()` on the outputs runs eager by design (stage_io.needs_grad)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    layers = spec.pipeline_layers(lora_denoiser(spec))
    torch._dynamo.reset()
    counters.clear()
    for layer in layers[1:]:
        layer.compile(backend="eager")
    try:
        run(layers, audio_batch(spec, encoders, seed=0)[0])
        graphs = counters["stats"]["unique_graphs"]
        run(layers, audio_batch(spec, encoders, seed=1)[0])
        assert counters["stats"]["unique_graphs"] == graphs, "a layer recompiled for new tensors"
        assert not counters["graph_break"], dict(counters["graph_break"])
    finally:
        torch._dynamo.reset()
