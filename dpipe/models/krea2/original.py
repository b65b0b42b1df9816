"""Krea 2 transformer weights under krea-ai's original module names, those of the single files
ComfyUI loads (`first`, `tmlp.0`, `blocks.N.attn.wq`, `blocks.N.mlp.gate`, `last.linear`, ...:
ComfyUI 0.33.0, upstream 783545f6, `comfy/ldm/krea2/model.py`; its `krea2_to_diffusers` in
`comfy/utils.py` pairs them with diffusers' names).

dpipe reads Krea 2 from the diffusers folder only; this converter names where each Linear of
the diffusers model sits in such a file, so that `dpipe-lora merge` places a diffusers-named
Krea 2 LoRA (the names ComfyUI applies Krea 2 LoRAs by) on it. ComfyUI's table names the
Linears only: a norm or modulation table has no original name here and raises KeyError, so
nothing is renamed by guess.
"""

from __future__ import annotations

import torch

from dpipe.models.single_file import block_original_module

# diffusers -> original, outside the blocks.
_TOP = {"img_in": "first", "time_embed.linear_1": "tmlp.0", "time_embed.linear_2": "tmlp.2",
        "time_mod_proj": "tproj.1", "txt_in.linear_1": "txtmlp.1", "txt_in.linear_2": "txtmlp.3",
        "text_fusion.projector": "txtfusion.projector", "final_layer.linear": "last.linear"}
# Inside every block: the gated attention and the SwiGLU.
_BLOCK = {"attn.to_q": "attn.wq", "attn.to_k": "attn.wk", "attn.to_v": "attn.wv",
          "attn.to_gate": "attn.gate", "attn.to_out.0": "attn.wo",
          "ff.gate": "mlp.gate", "ff.up": "mlp.up", "ff.down": "mlp.down"}
_BLOCKS = [("transformer_blocks", "blocks", _BLOCK, {}),
           ("text_fusion.layerwise_blocks", "txtfusion.layerwise_blocks", _BLOCK, {}),
           ("text_fusion.refiner_blocks", "txtfusion.refiner_blocks", _BLOCK, {})]


def original_state_dict(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Diffusers-named Krea2Transformer2DModel Linears (weights and biases) under the original
    names, one to one. KeyError for a weight with no original name in ComfyUI's table."""
    out = {}
    for key, value in weights.items():
        module, _, param = key.rpartition(".")
        original = _TOP.get(module)
        if original is None:
            found = block_original_module(module, _BLOCKS)
            if found is None:
                raise KeyError(f"no original Krea 2 name for {key!r} (ComfyUI's table names "
                               "the Linears only)")
            original = found[0]
        out[f"{original}.{param}"] = value
    return out
