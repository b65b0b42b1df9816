"""The shared layer under the model families: what two or more families use lives here once.

A family folder imports only this package, the top-level shared modules of `dpipe.models`
(spec, diffusers_folder, single_file, lora_files, comfyui, attention_mask, sync_free, ...),
`dpipe.diffusion` and its own files; tests/unit/test_layers.py checks it.

- stage_io: what a pipeline layer does to the tensors it sends (`needs_grad`)
- shapes: padded lengths, valid frame counts, images as one-frame videos
- joined_latents: a joint audio-video sample's streams as one tensor (MiniMax H3, LTX-2)
- latent_packing: FLUX's 2x2 latent packing and position ids (FLUX.1, Kontext, Chroma)
- key_tables: the table engine for original-layout key maps (fused Linears stacked and split)
- bfl_layout: BFL's FLUX.1 / FLUX.2 layout tables, single files and ComfyUI LoRAs
- quantized_files: single files in ComfyUI's scaled fp8 or int8 with scales, read dequantized
- comfyui_hunyuan: ComfyUI's renames for the families it runs on its HunyuanVideo code
- tiny_files: tiny components written sharded as the real repos are
- tiny_qwen_tokenizer, tiny_llama3_tokenizer: tiny byte-level BPE tokenizers several families use
"""
