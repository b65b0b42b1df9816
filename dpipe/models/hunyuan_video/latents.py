"""The latent grid of HunyuanVideo and HunyuanVideo 1.5: both VAEs' configs name their
compression, and both transformers patch on top of it."""

from __future__ import annotations


class VideoLatentGrid:
    """`pixel_multiple` and `temporal_ratio` of a `DiffusersFamily` from its folder's configs."""

    @property
    def pixel_multiple(self) -> int:
        # The VAE's config names its downscale; the transformer's patches on top.
        return (self.part_config("vae")["spatial_compression_ratio"]
                * self.part_config("transformer")["patch_size"])

    @property
    def temporal_ratio(self) -> int:
        return self.part_config("vae")["temporal_compression_ratio"]
