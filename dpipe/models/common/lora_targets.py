"""peft target regexes (over diffusers' module names) that several families' LoRAs share."""

# Every Linear of the double- and single-stream blocks of FLUX.1's design (FLUX.1, HunyuanVideo,
# HunyuanImage 2.1): attention incl. the text stream's, MLPs, modulations; none outside them
# (embedders, token refiners, head), as the community trains these families' LoRAs.
_DUAL_STREAM_LINEARS = [
    r"attn\.to_q", r"attn\.to_k", r"attn\.to_v", r"attn\.to_out\.0",
    r"attn\.add_q_proj", r"attn\.add_k_proj", r"attn\.add_v_proj", r"attn\.to_add_out",
    r"ff\.net\.0\.proj", r"ff\.net\.2", r"ff_context\.net\.0\.proj", r"ff_context\.net\.2",
    r"norm1\.linear", r"norm1_context\.linear", r"norm\.linear", r"proj_mlp", r"proj_out",
]
DUAL_STREAM_LORA_TARGETS = (r"(?:single_)?transformer_blocks\.\d+\.(?:"
                            + "|".join(_DUAL_STREAM_LINEARS) + ")")
