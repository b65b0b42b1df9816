"""AuraFlow samples as `AuraFlowPipeline` does: noise in (C, h, w), the scheduler's own timesteps
for `num_inference_steps` (`set_timesteps(steps)`, no custom sigmas, the config's static shift
1.73), the transformer given t / 1000 (it scales by 1000 itself), classifier-free guidance with
the negative prompt (3.5 and 50 steps by default), and the SDXL VAE's latents divided by its
scaling factor before decoding (no shift). The transformer takes and returns (B, C, h, w)."""

from __future__ import annotations

from dpipe.models.sampling import FamilySampling


class AuraFlowSampling(FamilySampling):
    decode_shift = False  # the pipeline divides by the VAE's scale alone
    default_steps = 50
    default_guidance = 3.5
    schedule = "steps"  # the pipeline passes num_inference_steps alone (no sigmas, no mu)
    reference_pipeline = "AuraFlowPipeline"
