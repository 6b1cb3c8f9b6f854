"""Cascade Speculative Drafting (Chen et al., 2024): the Max-Gram statistical drafter (``maxgram``) and the cascade
of a neural reviewer over Max-Gram (``cascade``)."""
