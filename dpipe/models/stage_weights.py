"""A denoiser built with no weights read, so that each pipeline stage reads only its own weights
(`DenoiserSkeleton`), and where those weights come from (`FolderWeights`: diffusers model
folders; `dpipe.models.single_file_weights.FileWeights`: one file in the original layout).

A source of weights answers two questions under the model's own parameter names: whether it
holds a name (`holds`), and the tensors of the names asked for, each cast to its own dtype as it
is read (`read`); `missing(name)` words the error for a name it lacks. A quantized single file's
Linear weights read also leave their stored form (`stored_forms`), which the skeleton hands to
their Linears as the whole load does (`stored_form`, for `dpipe.train.stored_base`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

import torch
from torch import nn

from dpipe.errors import ModelLoadError
from dpipe.models.diffusers_folder import read_json
from dpipe.models.safetensors_files import read_tensors
from dpipe.models.single_file import load_or_fail

WEIGHTS_FILE = "diffusion_pytorch_model.safetensors"
WEIGHTS_INDEX = "diffusion_pytorch_model.safetensors.index.json"


class WeightSource(Protocol):
    stored_forms: dict  # a weight's name -> its Linear's stored form, for the weights read

    def holds(self, name: str) -> bool: ...

    def read(self, wanted: dict[str, torch.dtype]) -> dict[str, torch.Tensor]: ...

    def missing(self, name: str) -> str: ...


@dataclass
class DenoiserSkeleton:
    """A denoiser built from its config with no weights read: its parameters are placeholders of
    their shape and dtype that hold no memory, so that anything made from the model before its
    weights (peft's adapters, which take the device and dtype of the weight they wrap) is made
    as over the loaded model. `load` then reads the weights a pipeline stage keeps from
    `weights`, each in the dtype it is kept in, and leaves the others on the meta device."""

    model: nn.Module
    weights: WeightSource
    keys: dict[int, tuple[str, nn.Parameter]]  # id(parameter) -> its name in the model

    def load(self, keep: set[int], dtype_of: Callable[[nn.Parameter], torch.dtype]) -> None:
        """Reads the parameters whose id is in `keep`, each cast to `dtype_of(parameter)` as it
        is read (never a whole copy in another dtype), and the persistent buffers the source
        holds; puts every other parameter on the meta device."""
        wanted: dict[str, torch.dtype] = {}
        kept: dict[str, nn.Parameter] = {}
        weight_of = {}  # a weight's name -> its module (under peft's wrapping, if any)
        for module in self.model.modules():
            weight = module._parameters.get("weight")
            if id(weight) in self.keys and id(weight) in keep:
                weight_of[self.keys[id(weight)][0]] = module
        for key, param in self.keys.values():
            if id(param) in keep:
                if not self.weights.holds(key):
                    raise ModelLoadError(self.weights.missing(key))
                # A GGUF Linear's weight is its file's bytes: read as stored, never cast.
                wanted[key] = dtype_of(param) if param.is_floating_point() else param.dtype
                kept[key] = param
        meta: dict[int, nn.Parameter] = {}  # a placeholder -> its meta parameter
        for module in self.model.modules():
            for name, param in list(module._parameters.items()):
                if id(param) in self.keys and id(param) not in keep:
                    if id(param) not in meta:
                        meta[id(param)] = nn.Parameter(param.to("meta"), param.requires_grad)
                    module._parameters[name] = meta[id(param)]
        buffers = {}
        for module_name, module in self.model.named_modules():
            for name, buffer in module.named_buffers(recurse=False):
                key = f"{module_name}.{name}" if module_name else name
                if self.weights.holds(key) and name not in module._non_persistent_buffers_set:
                    wanted[key] = torch.float32 if buffer.is_floating_point() else buffer.dtype
                    buffers[key] = (module, name)
        for key, tensor in self.weights.read(wanted).items():
            if key in kept:
                kept[key].data = tensor
            else:
                module, name = buffers[key]
                module._buffers[name] = tensor
        for key, form in self.weights.stored_forms.items():
            weight_of[key].stored_form = form
        self.weights.stored_forms.clear()


def empty_model(model_cls, folder: Path) -> nn.Module:
    """`model_cls` built from `folder`/config.json as diffusers' `from_pretrained` builds it: no
    initialisation, parameters on the meta device, buffers made by the constructor."""
    import accelerate
    from diffusers.models.modeling_utils import no_init_weights

    def build():
        config = model_cls.load_config(folder)
        with no_init_weights(), accelerate.init_empty_weights():
            return model_cls.from_config(config)

    return load_or_fail(build, folder)


def skeleton_of(model: nn.Module, weights: WeightSource) -> DenoiserSkeleton:
    """`model` (built by `empty_model`) in eval mode, each parameter a one-element placeholder
    broadcast to its shape, its weights to be read from `weights`."""
    placeholders: dict[int, nn.Parameter] = {}  # a weight two modules share stays shared
    keys = {}
    for module_name, module in model.named_modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if id(param) not in placeholders:
                empty = torch.zeros((), dtype=param.dtype).expand(param.shape)
                placeholders[id(param)] = nn.Parameter(empty, requires_grad=param.requires_grad)
                new = placeholders[id(param)]
                keys[id(new)] = (f"{module_name}.{name}" if module_name else name, new)
            module._parameters[name] = placeholders[id(param)]
    return DenoiserSkeleton(model.eval(), weights, keys)


def holds_safetensors(folder: Path) -> bool:
    """Whether a diffusers model folder keeps its weights as safetensors (diffusers reads the
    other formats whole)."""
    return (folder / WEIGHTS_FILE).is_file() or (folder / WEIGHTS_INDEX).is_file()


class FolderWeights:
    """The weights of diffusers model folders' safetensors files. `folders`: the prefix of a
    parameter's name -> the folder whose files hold it under the rest of the name ({"": folder}
    for a denoiser that is one diffusers model)."""

    def __init__(self, folders: dict[str, Path]):
        self.files: dict[str, tuple[Path, str]] = {}  # name -> (file, its key there)
        self.stored_forms: dict = {}  # diffusers folders store values only
        self.folders = folders
        for prefix, folder in folders.items():
            for key, file in _weight_files(folder).items():
                self.files[prefix + key] = (file, key)

    def holds(self, name: str) -> bool:
        return name in self.files

    def missing(self, name: str) -> str:
        prefix = next((p for p in self.folders if name.startswith(p)), "")
        return (f"{self.folders[prefix]} holds no weight {name.removeprefix(prefix)}: save the "
                "model again with diffusers' save_pretrained")

    def read(self, wanted: dict[str, torch.dtype]) -> dict[str, torch.Tensor]:
        by_file: dict[Path, dict[str, tuple[str, torch.dtype]]] = {}
        for name, dtype in wanted.items():
            file, key = self.files[name]
            by_file.setdefault(file, {})[key] = (name, dtype)
        out = {}
        for file, keys in by_file.items():
            tensors = read_tensors(file, {key: dtype for key, (_, dtype) in keys.items()})
            out.update({keys[key][0]: tensor for key, tensor in tensors.items()})
        return out


def _weight_files(folder: Path) -> dict[str, Path]:
    """Each weight name of a diffusers model folder -> the safetensors file that holds it."""
    index = folder / WEIGHTS_INDEX
    if index.is_file():
        return {key: folder / name for key, name in read_json(index)["weight_map"].items()}
    from safetensors import safe_open

    with safe_open(folder / WEIGHTS_FILE, framework="pt") as f:
        return dict.fromkeys(f.keys(), folder / WEIGHTS_FILE)


def folder_skeleton(model_cls, folder: Path) -> DenoiserSkeleton | None:
    """The denoiser of the diffusers model folder `folder`, its weights read from there; None
    where the folder holds no safetensors weights."""
    if not holds_safetensors(folder):
        return None
    return skeleton_of(empty_model(model_cls, folder), FolderWeights({"": folder}))
