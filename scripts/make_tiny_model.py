#!/usr/bin/env python
"""Write a tiny random model in the on-disk layout of a real one, for tests and dry runs.

    python scripts/make_tiny_model.py flux /tmp/tiny-flux [--seed 0]

The folder then stands in for the real checkpoint (e.g. `model.path=/tmp/tiny-flux`). An existing
complete folder is left as it is.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

# family -> "module:factory", each factory `(path: Path, seed: int) -> Path`; imported lazily so a
# family's heavy imports are paid only when it is asked for.
FACTORIES: dict[str, str] = {
    "flux": "dpipe.models.flux.tiny:make_tiny_flux",
    "flux_kontext": "dpipe.models.flux.tiny:make_tiny_flux_kontext",
    "flux2": "dpipe.models.flux2.tiny:make_tiny_flux2",
    "wan": "dpipe.models.wan.tiny:make_tiny_wan",
    "wan_i2v": "dpipe.models.wan.tiny:make_tiny_wan_i2v",
    "wan22_ti2v": "dpipe.models.wan.tiny:make_tiny_wan22_ti2v",
    "wan22_a14b": "dpipe.models.wan.tiny:make_tiny_wan22_a14b",
    "wan22_i2v_a14b": "dpipe.models.wan.tiny:make_tiny_wan22_i2v_a14b",
    "cosmos_predict2": "dpipe.models.cosmos_predict2.tiny:make_tiny_cosmos_predict2",
    "cosmos_predict2_v2w": "dpipe.models.cosmos_predict2.tiny:make_tiny_cosmos_predict2_v2w",
    "cosmos1": "dpipe.models.cosmos1.tiny:make_tiny_cosmos1",
    "anima": "dpipe.models.anima.tiny:make_tiny_anima",
    "minimax_h3": "dpipe.models.minimax_h3.tiny:make_tiny_minimax_h3",
    "hunyuan_video": "dpipe.models.hunyuan_video.tiny:make_tiny_hunyuan_video",
    "ltx_video": "dpipe.models.ltx_video.tiny:make_tiny_ltx_video",
    "hunyuan_video15": "dpipe.models.hunyuan_video15.tiny:make_tiny_hunyuan_video15",
    "ltx2": "dpipe.models.ltx_video.ltx2.tiny:make_tiny_ltx2",
    "ltx23": "dpipe.models.ltx_video.ltx2.ltx23_tiny:make_tiny_ltx23",
    "chroma": "dpipe.models.chroma.tiny:make_tiny_chroma",
    "sd3": "dpipe.models.sd3.tiny:make_tiny_sd3",
    "auraflow": "dpipe.models.auraflow.tiny:make_tiny_auraflow",
    "sdxl": "dpipe.models.sdxl.tiny:make_tiny_sdxl",
    "hunyuan_image": "dpipe.models.hunyuan_image.tiny:make_tiny_hunyuan_image",
    "hidream": "dpipe.models.hidream.tiny:make_tiny_hidream",
    "z_image": "dpipe.models.z_image.tiny:make_tiny_z_image",
    "lumina2": "dpipe.models.lumina2.tiny:make_tiny_lumina2",
    "qwen_image": "dpipe.models.qwen_image.tiny:make_tiny_qwen_image",
    "qwen_image_edit": "dpipe.models.qwen_image.tiny:make_tiny_qwen_image_edit",
    "krea2": "dpipe.models.krea2.tiny:make_tiny_krea2",
    "ideogram4": "dpipe.models.ideogram4.tiny:make_tiny_ideogram4",
    "ernie_image": "dpipe.models.ernie_image.tiny:make_tiny_ernie_image",
    "omnigen2": "dpipe.models.omnigen2.tiny:make_tiny_omnigen2",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("family", choices=sorted(FACTORIES), help="model family to imitate")
    parser.add_argument("out_dir", type=Path, help="folder to write (left as is if complete)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    args = parser.parse_args(argv)
    # Everything is built locally; never let a hub lookup stall on retries.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    module_name, func_name = FACTORIES[args.family].split(":")
    factory = getattr(importlib.import_module(module_name), func_name)
    print(factory(args.out_dir, seed=args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
