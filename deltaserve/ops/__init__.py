"""Kernels. Each op has a plain torch reference beside its fast path and a parity test.

Shape alphabet used in every docstring:
  B  sequences in a batch            T  tokens per sequence (query length)
  S  tokens in the KV cache          C  conv channels (2*H*K + HV*V)
  H  key heads (GDN)                 HV value heads (GDN), a multiple of H
  K  key head dim                    V  value head dim
  HQ query heads (attention)         HKV key/value heads (attention)
  D  attention head dim              W  conv kernel width (4)
  N  hidden size                     I  MLP intermediate size
"""

import os

# fla-core autotunes with keys that leave out the sequence length and by default keeps its choice
# on disk for every later process: set here, before anything can import fla (ops/fla_scan.tune)
os.environ.setdefault("FLA_CACHE_RESULTS", "0")
