"""The block geometry of the scaled formats, as plain numbers (no torch).

The codecs take their block sizes from here, and so does every reader that only maps bytes to
elements (``k3bundle trace``), which must not load torch to answer in well under a second.
"""

MXFP4_BLOCK = 32  # OCP MX v1.0: E2M1 elements per E8M0 scale
MXFP4_SCALE_RULES = ("floor", "rceil", "even")  # how a block's E8M0 scale is chosen (docs/formats.md)
NVFP4_BLOCK = 16  # E2M1 elements per E4M3 scale
FP8_BLOCK = 128  # fp8-e4m3-block128: rows and columns per f32 scale
SWIZZLE_TILE_ROWS, SWIZZLE_TILE_COLS = 128, 4  # the 128x4 scale tile of NVIDIA's block-scaled GEMMs
