"""smollm3: SmolLM3-3B: Llama's block, except that every fourth layer (il + 1) % 4 == 0 applies no RoPE
("NoPE" layers; llama.cpp hard-codes the interval, src/models/smollm3.cpp). Normal pairing (the converter
permutes Q/K as for llama). Tensors: llama's.
"""

from ..base import ROPE_NORMAL, Architecture, LayerPlan

NO_ROPE_EVERY = 4

ARCH = Architecture(
    name="smollm3",
    rope_type=ROPE_NORMAL,
    layer=lambda info: LayerPlan(rope=(info.index + 1) % NO_ROPE_EVERY != 0),
)
