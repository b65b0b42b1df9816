"""Import ComfyUI 0.33.0 for its model and LoRA loading code in CPU mode
(the state `main.py --cpu` parses to).

The only torchvision / torchaudio wheels on the machine this ran on are CUDA builds that cannot
load beside the CPU build of torch, and ComfyUI's model / LoRA loading never calls them (only
pre-processing, detectors and audio VAEs do), so they are replaced by a stand-in that raises
if anything uses it. A dev tool: needs a ComfyUI checkout on PYTHONPATH; not a test."""
import sys
import types


class _Absent(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        sub = _Absent(f"{self.__name__}.{name}")
        sys.modules[sub.__name__] = sub
        return sub

    def __call__(self, *a, **k):
        raise RuntimeError(f"{self.__name__} is not available (torchvision stand-in)")


# transformers and diffusers record whether torchvision exists when first imported: import
# them before the stand-in is installed
from transformers.utils import import_utils as _tf_imports  # noqa: E402
_tf_imports.is_torchvision_available()
import diffusers.utils.import_utils  # noqa: E402,F401
for _name in ("torchvision", "torchvision.ops", "torchvision.transforms",
              "torchvision.transforms.functional", "torchvision.models",
              "torchaudio", "torchaudio.functional", "torchaudio.transforms"):
    sys.modules[_name] = _Absent(_name)
for _name in ("torchvision", "torchaudio"):
    sys.modules[_name].__path__ = []

argv, sys.argv = sys.argv, [sys.argv[0], "--cpu", "--disable-dynamic-vram"]
import comfy.options  # noqa: E402
comfy.options.enable_args_parsing()
import comfy.cli_args  # noqa: E402
sys.argv = argv
import comfy.model_management as mm  # noqa: E402,F401
import comfy.sd  # noqa: E402,F401
import comfy.lora  # noqa: E402,F401
import comfy.utils  # noqa: E402,F401
import comfy.model_detection  # noqa: E402,F401
