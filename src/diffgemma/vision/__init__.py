"""Image input: Gemma-4's vision tower, image preprocessing and the image-token merge.

config     VisionConfig / ImageProcessing, parsed from the checkpoint
preprocess image (path, bytes, PIL) -> pixel patches, as transformers' image processor makes them
tower      the reference forward of the vision tower + projector (weights read on first image)
merge      the prompt layout of an image, the embedding merge, the prefill attention rule
"""
