"""GGUF transformers kept quantized: the tiny FLUX model's Black Forest Labs-layout file written
by the `gguf` package's own writer and quantizer (as city96's convert tool writes one), read into
FluxTransformer2DModel through the family's key map.

The tiny model's rows are 16 to 256 values wide: Q8_0, Q4_0 and Q5_0 (32-value blocks) quantize
its block Linears; the K-quants' 256-value blocks fit only its time and guidance embeddings'
first Linears (real sizes use them), whose K-quant blocks the test writes itself."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dpipe.config.schema import ModelConfig
from dpipe.errors import ConfigError, ModelLoadError
from dpipe.models.common.gguf_files import gguf_linear_class, write_gguf_copy
from dpipe.models.flux.tiny import make_tiny_flux, write_bfl_single_file
from dpipe.models.registry import build_spec

PREFIX = "model.diffusion_model."


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(the tiny FLUX diffusers folder, its transformer as one plain BFL-layout file)."""
    root = tmp_path_factory.mktemp("gguf")
    folder = make_tiny_flux(root / "flux")
    return folder, write_bfl_single_file(folder, root / "flux1-dev.safetensors", PREFIX)


def _spec(path: Path, folder: Path, **model):
    from omegaconf import OmegaConf

    cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig),
                          {"family": "flux", "path": str(path), "max_text_tokens": 16,
                           "single_file_config": str(folder), **model})
    return build_spec(OmegaConf.to_object(cfg))


def dequantized_copy(file: Path, out: Path) -> Path:
    """The GGUF `file` as a plain safetensors file of its values as the `gguf` package
    dequantizes them, under ComfyUI's prefix."""
    import gguf

    values = {t.name: gguf.quants.dequantize(t.data, t.tensor_type)
              for t in gguf.GGUFReader(str(file)).tensors}
    save_file({PREFIX + name: torch.tensor(v, dtype=torch.float32) for name, v in values.items()},
              str(out))
    return out


def gguf_copy(plain: Path, out: Path, quant: str, arch: str) -> Path:
    """`plain` as a `quant` GGUF: the `gguf` package's quantizer, or random K-quant blocks."""
    if quant.endswith("_K"):
        return k_quant_copy(plain, out, quant, arch)
    return write_gguf_copy(plain, out, quant, arch)


def assert_gguf_keeps_the_values(spec_of, plain: Path, tmp_path: Path, quant: str = "Q8_0",
                                 kept_at_least: int = 4) -> Path:
    """A family's tiny single file `plain` as a `quant` GGUF, read by `spec_of(path)`'s spec: its
    Linears whose rows split into blocks stay quantized, and every weight is the one the same
    file's values, dequantized by the `gguf` package into a plain file, give. Returns the GGUF
    and that plain file."""
    file = gguf_copy(plain, tmp_path / f"{plain.stem}-{quant}.gguf", quant,
                     type(spec_of(plain)).gguf_architectures[0])
    model = spec_of(file).load_denoiser(torch.float32)
    dequantized = dequantized_copy(file, tmp_path / f"{plain.stem}-{quant}-dequantized.safetensors")
    want = spec_of(dequantized).load_denoiser(torch.float32).state_dict()
    modules = dict(model.named_modules())
    kept, got = 0, {}
    for name, value in model.state_dict().items():
        module = modules.get(name.removesuffix(".weight"))
        if isinstance(module, gguf_linear_class()) and name.endswith(".weight"):
            assert value.dtype == torch.uint8 and module.quant_type.name == quant, name
            got[name], kept = module.dequantized(), kept + 1
        else:
            got[name] = value
    assert kept >= kept_at_least and got.keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(got[name], value), name
    return file, dequantized


# Bytes per value of each block type: a 32-value block of Q8_0 holds an fp16 scale and 32 int8.
BYTES_PER_VALUE = {"Q8_0": 34 / 32, "Q4_0": 18 / 32, "Q5_0": 22 / 32, "Q4_K": 144 / 256,
                   "Q5_K": 176 / 256, "Q6_K": 210 / 256}


# Where a K-quant block keeps its fp16 super-block scales (d, and dmin but in Q6_K): the rest of
# a block (6-bit sub-block scales, 4-6-bit values) is any bytes.
K_SCALES = {"Q4_K": (0, 4), "Q5_K": (0, 4), "Q6_K": (208, 210)}


def k_quant_copy(file: Path, out: Path, quant: str, arch: str = "flux") -> Path:
    """`file` as a GGUF whose 256-value rows hold random `quant` blocks with fp16 scales of
    ~1e-3: the `gguf` package has no K-quant quantizer (llama.cpp's C tools write them), and its
    dequantization is what the test compares with."""
    import gguf
    import numpy as np
    from safetensors.torch import load_file

    qtype = gguf.GGMLQuantizationType[quant]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(out), arch=arch)
    for key, value in load_file(str(file)).items():
        rows, cols = value.shape if value.dim() == 2 else (0, 1)
        if cols % block or not key.endswith(".weight"):
            writer.add_tensor(key.removeprefix(PREFIX), value.float().numpy())
            continue
        blocks = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
        start, end = K_SCALES[quant]
        scales = rng.uniform(5e-4, 2e-3, (len(blocks), (end - start) // 2)).astype(np.float16)
        blocks[:, start:end] = scales.view(np.uint8)
        writer.add_tensor(key.removeprefix(PREFIX), blocks.reshape(rows, -1), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.mark.parametrize("quant", list(BYTES_PER_VALUE))
def test_weights_are_the_gguf_packages_dequantization_and_stay_quantized(tiny, tmp_path, quant):
    """Every weight the model multiplies by equals `gguf.quants.dequantize` of the file's tensor
    (through the BFL key map's qkv splits and modulation swap), the quantized ones are held as
    the file's bytes, and forward and backward equal the dequantized file's model."""
    folder, plain = tiny
    file = tmp_path / f"flux1-dev-{quant}.gguf"
    if quant.endswith("_K"):
        k_quant_copy(plain, file, quant)
    else:
        write_gguf_copy(plain, file, quant, "flux")
    spec = _spec(file, folder)
    spec.ensure_available()
    model = spec.load_denoiser(torch.float32)
    reference = _spec(dequantized_copy(file, tmp_path / "deq.safetensors"), folder
                      ).load_denoiser(torch.float32)
    want = reference.state_dict()
    stored = {name: m for name, m in model.named_modules() if isinstance(m, gguf_linear_class())}
    import gguf

    reader = gguf.GGUFReader(str(file))
    quantized = [t for t in reader.tensors if t.tensor_type.name == quant]
    # Every quantized tensor of the file lands in Linears, in its bytes (qkv split in three).
    assert len(stored) >= (20 if quant.endswith("_0") else 2), list(stored)
    assert sum(m.weight.numel() for m in stored.values()) == sum(int(t.n_bytes) for t in quantized)
    got = {}
    for name, value in model.state_dict().items():
        module = stored.get(name.removesuffix(".weight"))
        if module is not None and name.endswith(".weight"):
            assert value.dtype == torch.uint8 and module.quant_type.name == quant, name
            got[name] = module.dequantized()
        else:
            got[name] = value
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(got[name], value), name
    # Memory planning and block swap count what the layers hold: the file's bytes, the small
    # tensors in fp32 as loaded.
    from dpipe.pipeline.block_swap import frozen_bytes

    in_file = sum(int(t.n_bytes) for t in reader.tensors)
    layers = spec.pipeline_layers(model.requires_grad_(False))  # a LoRA's frozen base
    assert sum(frozen_bytes(layer) for layer in layers) == in_file
    for module in stored.values():
        assert module.weight.numel() == (module.in_features * module.out_features
                                         * BYTES_PER_VALUE[quant])

    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, 8, 32, generator=generator)
    out = {}
    for key, denoiser in (("gguf", model), ("plain", reference)):
        block = denoiser.single_transformer_blocks[0]  # proj_mlp 32 -> 128, proj_out 160 -> 32
        x = hidden.clone().requires_grad_()
        y = block.proj_out(torch.cat([x, block.proj_mlp(x)], dim=-1))
        y.square().sum().backward()
        out[key] = (y.detach(), x.grad)
    torch.testing.assert_close(out["gguf"], out["plain"], rtol=1e-5, atol=1e-6)


def test_a_gguf_of_another_architecture_is_named(tiny, tmp_path):
    folder, plain = tiny
    for arch, said in (("wan", "another architecture ('wan'"), ("t5", "text encoder (t5)"),
                       ("minimax_h3", "another architecture ('minimax_h3'")):
        file = write_gguf_copy(plain, tmp_path / f"{arch}.gguf", "Q8_0", arch)
        spec = _spec(file, folder)
        with pytest.raises(ModelLoadError, match=r"not a FLUX\.1 transformer") as err:
            spec.load_denoiser(torch.float32)
        assert said in str(err.value) and str(file) in str(err.value), err.value
        with pytest.raises(ModelLoadError) as per_stage:  # a worker reading its stage alone
            spec.denoiser_skeleton()
        assert str(per_stage.value) == str(err.value)


def test_a_gguf_base_trains_a_lora_only(tiny, tmp_path):
    from dpipe.config.compose import compose_run

    folder, _ = tiny
    file = tmp_path / "flux1-dev-Q8_0.gguf"
    for override, said in (("model.mode=full", "model.mode=full trains every weight"),
                           ("model.base_dtype=fp8", "drop model.base_dtype"),
                           ("model.merge_adapters=[a.safetensors]", "merge into a bf16 file")):
        with pytest.raises(ConfigError, match="is a GGUF file") as err:
            compose_run(["model=tiny_flux", f"model.path={file}", "model.tiny=false",
                         f"model.single_file_config={folder}", "dataset=synthetic", override])
        assert said in str(err.value), err.value


# Compiling on the CPU takes 10-16 s on this 2-core machine: slow.
@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["eager", "compiled"])
def test_backward_keeps_the_blocks_not_a_dequantized_copy(compiled):
    """Also inside torch.compile, where an autograd.Function had its dequantized weight saved."""
    import shutil

    import gguf

    if compiled and not shutil.which("cc"):
        pytest.skip("torch.compile on CPU needs a C compiler")
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 32)
    qtype = gguf.GGMLQuantizationType.Q8_0
    blocks = torch.from_numpy(gguf.quants.quantize(linear.weight.detach().numpy(), qtype))
    module = gguf_linear_class()(linear, blocks.shape, qtype)
    module.weight = torch.nn.Parameter(blocks, requires_grad=False)
    module.bias = torch.nn.Parameter(linear.bias.detach(), requires_grad=False)
    model = torch.compile(module) if compiled else module
    x = torch.randn(4, 64, requires_grad=True)
    model(x)  # compiles
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = model(x)
    assert [(t.dtype, tuple(t.shape)) for t in saved] == [(torch.uint8, (32, 68))]
    y.sum().backward()
    x_ref = x.detach().clone().requires_grad_(True)
    torch.nn.functional.linear(x_ref, module.dequantized(), module.bias).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-6)


# Families whose GGUF loading is checked here (the others' in their own test files): family ->
# the `general.architecture` their GGUFs carry (city96's converter tells Z-Image by Lumina 2's
# keys and Anima by Cosmos-Predict2's).
FAMILY_GGUFS = {"z_image": "lumina2", "anima": "cosmos", "minimax_h3": "minimax_h3"}


@pytest.fixture(scope="module")
def family_files(tmp_path_factory):
    """family -> (a LoRA run's config on its tiny folder, its transformer as one original-layout
    file under ComfyUI's prefix), made on first use."""
    import importlib

    from dpipe.config.compose import compose_run

    made = {}

    def get(family: str):
        if family not in made:
            run = compose_run([f"model=tiny_{family}", "dataset=synthetic"])
            build_spec(run.model).ensure_available()  # writes the tiny folder, as a run does
            tiny = importlib.import_module(f"dpipe.models.{family}.tiny")
            out = tmp_path_factory.mktemp(family) / f"{family}.safetensors"
            made[family] = run, tiny.write_single_file(Path(run.model.path), out, PREFIX)
        return made[family]
    return get


def _on_file(run, path: Path):
    """`run` (composed once: composing takes ~0.5 s) with `path` as model.path and its tiny
    folder as model.single_file_config."""
    import dataclasses

    return dataclasses.replace(run, model=dataclasses.replace(
        run.model, path=str(path), tiny=False, single_file_config=run.model.path))


def _base_weights(layers) -> dict[str, torch.Tensor]:
    """The frozen base of LoRA `layers` by name: each GGUF Linear's weight as it multiplies."""
    out = {}
    for i, layer in enumerate(layers):
        modules = dict(layer.named_modules())
        for name, value in layer.state_dict().items():
            module = modules.get(name.removesuffix(".weight"))
            if "lora_" in name:
                continue
            gguf = isinstance(module, gguf_linear_class()) and name.endswith(".weight")
            out[f"{i}.{name}"] = module.dequantized() if gguf else value
    return out


@pytest.mark.parametrize("family", list(FAMILY_GGUFS))
def test_a_lora_trains_on_a_familys_gguf(family_files, tmp_path, family):
    """The layers a LoRA run builds on the family's original-layout file as a Q8_0 GGUF (Anima's
    text adapter included): every Linear whose rows split into blocks holds the file's bytes and
    multiplies by the `gguf` package's dequantization of them, every other weight is that of the
    dequantized file, and so is the first loss; an optimizer step moves the adapters only, and
    the loss. A GGUF of another model is refused naming the file."""
    from dpipe.bench.worker import fixed_micro_batches
    from dpipe.train.trainable import trainable_layers
    from tests.unit.video_checks import run

    base, plain = family_files(family)
    file = write_gguf_copy(plain, tmp_path / f"{family}-Q8_0.gguf", "Q8_0", FAMILY_GGUFS[family])
    dequantized = dequantized_copy(file, tmp_path / f"{family}-dequantized.safetensors")
    built = {}
    for name, path in (("gguf", file), ("dequantized", dequantized)):
        config = _on_file(base, path)
        spec = build_spec(config.model)
        layers = trainable_layers(spec, config)
        inputs, labels = fixed_micro_batches(spec, "tiny", 1, 2, seed=0)[0]
        built[name] = spec, layers, inputs, labels, spec.loss(run(layers, inputs), labels)
    spec, layers, inputs, labels, loss = built["gguf"]
    stored = {name: m.weight for layer in layers for name, m in layer.named_modules()
              if isinstance(m, gguf_linear_class())}
    assert len(stored) >= 12 and all(w.dtype == torch.uint8 for w in stored.values())
    got, want = _base_weights(layers), _base_weights(built["dequantized"][1])
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(got[name], value), name
    assert loss.item() == pytest.approx(built["dequantized"][4].item(), rel=1e-5, abs=1e-7)

    bytes_before = {name: w.clone() for name, w in stored.items()}
    adapters = [p for layer in layers for p in layer.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in adapters]
    loss.backward()
    torch.optim.AdamW(adapters, lr=1e-2).step()
    assert all(not torch.equal(p, b) for p, b in zip(adapters, before))
    assert all(torch.equal(stored[n], b) for n, b in bytes_before.items())
    assert spec.loss(run(layers, inputs), labels).item() != loss.item()

    other = "hyvid" if family == "minimax_h3" else "wan"  # some MiniMax H3 GGUFs carry `wan`
    refused = write_gguf_copy(plain, tmp_path / f"{other}.gguf", "Q8_0", other)
    with pytest.raises(ModelLoadError, match=f"another architecture \\('{other}'") as err:
        build_spec(_on_file(base, refused).model).load_denoiser(torch.float32)
    assert str(refused) in str(err.value)


def test_z_images_k_quant_gguf_is_its_values_kept_quantized(family_files, tmp_path):
    """A Q4_K GGUF (city96's Z-Image Turbo files are mostly K-quants): the tiny model's time
    embedder is the part whose rows split into 256-value blocks."""

    base, plain = family_files("z_image")
    assert_gguf_keeps_the_values(lambda path: build_spec(_on_file(base, path).model), plain,
                                 tmp_path, "Q4_K", kept_at_least=2)


def test_z_image_and_lumina2_files_are_told_apart(family_files, tmp_path):
    """Z-Image's blocks are Lumina 2's, and both models' GGUFs carry `lumina2`: each family
    names the other's file (by Z-Image's caption pad token) instead of failing on sizes."""
    from safetensors.torch import load_file

    from dpipe.models.lumina2.comfyui import from_native as lumina2_names

    base, plain = family_files("z_image")
    state = {k.removeprefix(PREFIX): v for k, v in load_file(plain).items()}
    with pytest.raises(ValueError, match="a Z-Image transformer. Train it with model=z_image"):
        lumina2_names(state, None)
    del state["cap_pad_token"]  # as in Lumina 2's files
    save_file({PREFIX + k: v for k, v in state.items()}, tmp_path / "lumina2.safetensors")
    file = write_gguf_copy(tmp_path / "lumina2.safetensors", tmp_path / "lumina2-Q8_0.gguf",
                           "Q8_0", "lumina2")
    with pytest.raises(ModelLoadError, match="Lumina-Image 2.0 transformer.*model=lumina2") as err:
        build_spec(_on_file(base, file).model).load_denoiser(torch.float32)
    assert str(file) in str(err.value)
