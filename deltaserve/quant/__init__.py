"""Quantized weights: schemes (pack/unpack references), the quantized Linear/embedding, `quantize`."""
