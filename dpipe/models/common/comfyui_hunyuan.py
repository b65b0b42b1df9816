"""ComfyUI's names for the Tencent families it runs on its HunyuanVideo model code.

HunyuanVideo, HunyuanVideo 1.5 and HunyuanImage 2.1 files are renamed alike when ComfyUI loads
them, so their ComfyUI LoRAs address the same renamed modules; the renames live here once.
"""

from __future__ import annotations

# The renames ComfyUI applies to the original keys when it loads a file of the HunyuanVideo
# family (HunyuanVideo, 1.5 and HunyuanImage 2.1 all run on its HunyuanVideo model code), in its
# order (the embedder MLPs before the generic `mlp.fc1`, which they do not match anyway). Its
# modules, and so the names its LoRA loader addresses first, are the renamed ones.
COMFYUI_RENAMES = [
    ("txt_in.t_embedder.mlp.0.", "txt_in.t_embedder.in_layer."),
    ("txt_in.t_embedder.mlp.2.", "txt_in.t_embedder.out_layer."),
    ("txt_in.c_embedder.linear_1.", "txt_in.c_embedder.in_layer."),
    ("txt_in.c_embedder.linear_2.", "txt_in.c_embedder.out_layer."),
    ("_mod.linear.", "_mod.lin."), ("_attn_qkv.", "_attn.qkv."),
    ("mlp.fc1.", "mlp.0."), ("mlp.fc2.", "mlp.2."),
    ("_attn_q_norm.weight", "_attn.norm.query_norm.scale"),
    ("_attn_k_norm.weight", "_attn.norm.key_norm.scale"),
    (".q_norm.weight", ".norm.query_norm.scale"), (".k_norm.weight", ".norm.key_norm.scale"),
    ("_attn_proj.", "_attn.proj."), (".modulation.linear.", ".modulation.lin."),
    ("_in.mlp.2.", "_in.out_layer."), ("_in.mlp.0.", "_in.in_layer."),
]


def comfyui_key(key: str) -> str:
    """An original key as ComfyUI names it inside its model."""
    for old, new in COMFYUI_RENAMES:
        key = key.replace(old, new)
    return key


def comfyui_module(module: str) -> str:
    return comfyui_key(module + ".").removesuffix(".")
