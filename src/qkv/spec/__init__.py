"""Model descriptions without torch: the decoder's config, RoPE parameters as data, layer types, the one
reader of an HF config, and the presets of published models. Pure Python: importing it does not import torch.
"""
