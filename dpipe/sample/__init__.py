"""Samples: during training, through the training processes' own pipeline stages, and by
`dpipe-sample`. `requests` reads `sample.prompts`, `link` passes micro-batches forward through a
pipeline's stages, `denoise` runs the family's denoising loop over them, `outputs` writes the
images, clips, TensorBoard entries and the index page, and `training` ties them into a run."""
