"""The tiny FLUX.1-dev folder loads and runs through diffusers' real loading code."""

import os

# Before any Hugging Face import: a hub lookup offline would stall ~48 s on retries.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import importlib.util
import json
import multiprocessing
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import FluxPipeline
from safetensors import safe_open

from dpipe.models.flux.tiny import make_tiny_flux
from dpipe.models.tiny_parts import train_clip_bpe, train_t5_unigram, write_atomically

CAPTION = "a red circle on a blue background"
REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def pipe(tiny) -> FluxPipeline:
    # Weights are stored in bf16 like the real repo; compute in fp32 on CPU.
    return FluxPipeline.from_pretrained(tiny, dtype=torch.float32)


def test_its_vae_encodes_pictures(pipe):
    """The VAE is a real autoencoder of the demo's synthetic shapes (a random one decodes any
    latent to noise), stored in bf16, loaded by FluxPipeline with its defaults; its scale and
    shift make their latents zero-mean and unit-variance, as FLUX.1's do for photos."""
    from dpipe.data.synthetic import draw_shape

    images = torch.stack([torch.from_numpy(np.array(draw_shape(i, 64)[0])) for i in range(64)])
    pixels = images.permute(0, 3, 1, 2).float() / 127.5 - 1
    vae = pipe.vae
    with torch.no_grad():
        latents = vae.encode(pixels).latent_dist.sample(torch.Generator().manual_seed(0))
        decoded = vae.decode(latents).sample.clamp(-1, 1)
    error = ((decoded - pixels).abs().mean() * 127.5).item()
    assert error < 4, f"mean error {error:.2f} / 255"  # 2.6: the shapes' edges, in 4x4 patches
    normalized = (latents - vae.config.shift_factor) * vae.config.scaling_factor
    assert abs(normalized.mean()) < 0.1 and 0.8 < normalized.std() < 1.2


def test_text_encoder_is_stored_in_bf16(tiny):
    with safe_open(tiny / "text_encoder/model.safetensors", "pt") as f:
        assert f.get_tensor(next(iter(f.keys()))).dtype == torch.bfloat16


def test_shapes_match_the_declared_config(pipe):
    assert pipe.vae_scale_factor == 4
    latents = pipe.vae.encode(torch.zeros(1, 3, 64, 64)).latent_dist.mode()
    assert latents.shape == (1, 4, 16, 16)
    assert pipe.scheduler.config.use_dynamic_shifting and pipe.scheduler.config.shift == 3.0
    assert pipe.tokenizer.model_max_length == 77 and pipe.tokenizer_2.model_max_length == 512
    prompt_embeds, pooled, text_ids = pipe.encode_prompt(CAPTION, None, max_sequence_length=32)
    assert prompt_embeds.shape == (1, 32, 32) and pooled.shape == (1, 32)
    # Test captions must not fall back to unknown tokens in either tokenizer.
    assert pipe.tokenizer_2.unk_token_id not in pipe.tokenizer_2(CAPTION).input_ids
    clip_ids = pipe.tokenizer(CAPTION).input_ids
    assert len(clip_ids) == len(CAPTION.split()) + 2  # every word is one token, plus bos/eos


def test_another_seed_makes_another_model(tmp_path, tiny):
    other = make_tiny_flux(tmp_path / "other", seed=1)
    shard = "transformer/diffusion_pytorch_model-00001-of-00003.safetensors"
    assert (other / shard).read_bytes() != (tiny / shard).read_bytes()


def test_tokenizers_are_the_same_in_every_process():
    # Hash-order tie-breaking (as in tokenizers' own trainers) would differ under another seed.
    code = ("from dpipe.models.tiny_parts import train_clip_bpe, train_t5_unigram;"
            "print(repr((train_clip_bpe(), train_t5_unigram())))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONHASHSEED": "12345"}).stdout
    assert out.strip() == repr((train_clip_bpe(), train_t5_unigram()))


def _make_after(barrier, path):
    # Forked from a parent whose OpenMP pool is warm: one thread avoids libgomp's fork hazards.
    torch.set_num_threads(1)
    barrier.wait()
    make_tiny_flux(path, seed=0)


def test_concurrent_creation_leaves_one_valid_folder(tmp_path):
    # fork: the children inherit the imports (spawn would re-import diffusers, ~6 s each).
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(2)
    target = tmp_path / "flux"
    procs = [ctx.Process(target=_make_after, args=(barrier, target)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    assert [p.name for p in tmp_path.iterdir()] == ["flux"]  # the loser's temp copy is gone
    FluxPipeline.from_pretrained(target, dtype=torch.float32)


def test_write_atomically_discards_the_copy_of_a_lost_race(tmp_path):
    target = tmp_path / "model"

    def writer(tmp):
        (tmp / "mine.txt").write_text("loser")
        target.mkdir()  # another process finishes first
        (target / "theirs.txt").write_text("winner")

    assert write_atomically(target, writer) == target
    assert [p.name for p in tmp_path.iterdir()] == ["model"]
    assert [p.name for p in target.iterdir()] == ["theirs.txt"]


def test_refuses_a_foreign_folder(tmp_path):
    (tmp_path / "flux").mkdir()
    (tmp_path / "flux" / "notes.txt").write_text("not a model")
    with pytest.raises(FileExistsError, match="model_index.json"):
        make_tiny_flux(tmp_path / "flux")


def test_cli_writes_the_folder(tmp_path):
    spec = importlib.util.spec_from_file_location(
        "make_tiny_model", REPO_ROOT / "scripts" / "make_tiny_model.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    assert cli.main(["flux", str(tmp_path / "cli"), "--seed", "2"]) == 0
    assert (tmp_path / "cli" / "model_index.json").is_file()
