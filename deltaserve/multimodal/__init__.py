"""Image input for MiniCPM-V-4.6: the SigLIP2 vision tower, its window-attention merger and the
projector into the language model's embedding space (formats.md section 3)."""
