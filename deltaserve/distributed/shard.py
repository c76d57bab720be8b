"""Which part of each checkpoint tensor a tensor-parallel rank holds (Megatron's split).

Column-parallel (output rows split by heads, no communication): q_proj (per head [query D | gate
D], so whole heads are contiguous rows), k_proj, v_proj, in_proj_z/b/a, gate_proj, up_proj, and
the GDN conv input in_proj_qkv and its conv1d channels, whose [q | k | v] blocks are each split by
heads; A_log and dt_bias follow the value heads. Row-parallel (input columns split, partial sums
all-reduced): o_proj, out_proj, down_proj. Vocabulary-parallel: embed_tokens and lm_head rows (the
last rank padded with zero rows when the vocabulary does not divide). Norms are replicated.

Contiguous head ranges keep grouped heads together: value head h reads key head h // (HV/H) and
query head h kv head h // (HQ/HKV), and both stay on the rank that holds h.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from deltaserve.config import TextConfig
from deltaserve.errors import CheckpointError, ConfigError

COLUMN = ("q_proj", "k_proj", "v_proj", "in_proj_z", "in_proj_b", "in_proj_a", "gate_proj",
          "up_proj")
ROW = ("o_proj", "out_proj", "down_proj")
VOCAB = ("embed_tokens", "lm_head")
QKV_BLOCKS = ("in_proj_qkv", "conv1d")  # [q H*K | k H*K | v HV*V] rows / channels
PER_V_HEAD = ("A_log", "dt_bias")
QUANT_LEAVES = ("weight", "scales", "biases")


@dataclass(frozen=True, slots=True)
class TPPlan:
    """Rank `rank` of `size` over the model of `cfg` (the checkpoint's full config)."""

    cfg: TextConfig
    rank: int
    size: int
    # row-parallel modules whose inputs stay in a GGUF's value-head order (Linear.input_order:
    # heads narrower than the file's blocks); set by check_quantized_split
    file_ordered: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        c, n = self.cfg, self.size
        counts = {"num_attention_heads": c.num_attention_heads,
                  "num_key_value_heads": c.num_key_value_heads,
                  "linear_num_key_heads": c.linear_num_key_heads,
                  "linear_num_value_heads": c.linear_num_value_heads,
                  "intermediate_size": c.intermediate_size}
        bad = [f"{k} = {v}" for k, v in counts.items() if v % n]
        if bad:
            raise ConfigError(f"tensor parallelism over {n} ranks needs every head count to divide "
                              f"by {n}; this model has {', '.join(bad)}")
        if c.vocab_size < n:
            raise ConfigError(f"a vocabulary of {c.vocab_size} cannot split over {n} ranks")

    @property
    def vocab_rows(self) -> int:
        """Rows of the vocabulary each rank holds (the last one maybe padded)."""
        return -(-self.cfg.vocab_size // self.size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_rows

    @property
    def vocab_valid(self) -> int:
        """Real (not padding) vocabulary rows of this rank."""
        return max(0, min(self.vocab_rows, self.cfg.vocab_size - self.vocab_start))

    def local_config(self) -> TextConfig:
        """The config of this rank's shard: the layers, pools and kernels run it unchanged."""
        c, n = self.cfg, self.size
        return dataclasses.replace(
            c, vocab_size=self.vocab_rows, intermediate_size=c.intermediate_size // n,
            num_attention_heads=c.num_attention_heads // n,
            num_key_value_heads=c.num_key_value_heads // n,
            linear_num_key_heads=c.linear_num_key_heads // n,
            linear_num_value_heads=c.linear_num_value_heads // n)

    def shard(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of checkpoint tensor `name` (our `model.*` / `lm_head.*` names)."""
        parts = name.split(".")
        leaf, module = parts[-1], parts[-2] if len(parts) > 1 else ""
        if leaf in PER_V_HEAD:
            return self._rows(tensor)
        if module in COLUMN:
            return self._rows(tensor)
        if module in QKV_BLOCKS:
            c = self.cfg
            blocks = tensor.split([c.linear_key_dim, c.linear_key_dim, c.linear_value_dim])
            return torch.cat([self._rows(b) for b in blocks])
        if module in ROW and name.rpartition(".")[0] in self.file_ordered:
            return self._file_cols(leaf, tensor)
        if module in ROW:
            return self._cols(name, tensor)
        if module in VOCAB:
            return self._vocab(tensor)
        return tensor

    def _rows(self, t: torch.Tensor) -> torch.Tensor:
        return t.chunk(self.size, dim=0)[self.rank] if t.shape[0] % self.size == 0 else _uneven(t)

    def _cols(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """Input columns; packed codes, scales and biases of a quantized weight split alike, which
        keeps whole quantization groups only if the groups divide by the ranks."""
        if t.shape[-1] % self.size:
            what = "quantization groups" if name.endswith((".scales", ".biases")) else "columns"
            raise CheckpointError(
                f"'{name}': {t.shape[-1]} {what} do not split over {self.size} ranks (a "
                "row-parallel split must keep whole quantization groups)")
        return t.chunk(self.size, dim=-1)[self.rank]

    def _file_runs(self) -> list[tuple[int, int]]:
        """This rank's out_proj input columns in a GGUF's tiled value-head order (file slot
        i*Hk + g holds HF head g*r + i): one run per i of its key groups' heads, ascending."""
        c, n = self.cfg, self.size
        hk, dv = c.linear_num_key_heads, c.linear_value_head_dim
        g0, width = self.rank * hk // n, hk // n
        return [((i * hk + g0) * dv, (i * hk + g0 + width) * dv)
                for i in range(c.linear_num_value_heads // hk)]

    def _file_cols(self, leaf: str, t: torch.Tensor) -> torch.Tensor:
        """The rank's runs of a tensor whose columns are in the file's order: the codes, scales
        and biases of whole blocks (check_quantized_split made sure), or input_order, whose
        entries become the rank's own HF columns."""
        cols = self.cfg.linear_value_dim
        if leaf == "input_order":
            picked = torch.cat([t[a:b] for a, b in self._file_runs()])
            return picked - self.rank * (cols // self.size)
        width = t.shape[-1]
        return torch.cat([t[..., a * width // cols : b * width // cols]
                          for a, b in self._file_runs()], dim=-1)

    def _vocab(self, t: torch.Tensor) -> torch.Tensor:
        start, valid = self.vocab_start, self.vocab_valid
        part = t[start : start + valid]
        if valid == self.vocab_rows:
            return part
        pad = t.new_zeros(self.vocab_rows - valid, *t.shape[1:])  # zero codes/scales: zero rows
        return torch.cat([part, pad])


def _uneven(t: torch.Tensor) -> torch.Tensor:
    raise CheckpointError(f"a tensor of {t.shape[0]} rows does not split by heads (shape "
                          f"{list(t.shape)})")


def check_quantized_split(plan: TPPlan, index, scheme_for) -> TPPlan:
    """Before building: every quantized row-parallel weight keeps whole groups (or llama.cpp
    blocks) per rank. scheme_for(module) -> its quant.schemes.Scheme, None when not quantized.
    Returns the plan with the modules that keep a GGUF's value-head order (file_ordered)."""
    ordered = set()
    for name in index.locations:
        parts = name.split(".")
        if len(parts) < 2 or parts[-2] not in ROW:
            continue
        module = name.rpartition(".")[0]
        if parts[-1] == "input_order":
            _check_file_order(plan, module, scheme_for(module))
            ordered.add(module)
            continue
        scheme = scheme_for(module) if parts[-1] == "weight" else None
        if scheme is None:
            continue
        shape = index.meta(name)[0]
        groups = shape[-1] // scheme.packed_shape(1, scheme.group_size)[1]
        if groups % plan.size:
            cols = groups * scheme.group_size
            raise CheckpointError(
                f"'{module}': {cols} inputs in groups of {scheme.group_size} do not split over "
                f"{plan.size} ranks in whole groups ({cols // plan.size} per rank); use another "
                "tensor-parallel size or a smaller group size")
    return dataclasses.replace(plan, file_ordered=frozenset(ordered))


def _check_file_order(plan: TPPlan, module: str, scheme) -> None:
    """A rank's out_proj columns in the file's order are runs of (Hk / ranks) value heads: each
    run must be whole blocks of the module's scheme."""
    c = plan.cfg
    run = c.linear_num_key_heads // plan.size * c.linear_value_head_dim
    if scheme is None or module.rpartition(".")[2] != "out_proj" or run % scheme.group_size:
        group = "?" if scheme is None else scheme.group_size
        raise CheckpointError(
            f"'{module}' keeps the GGUF's value-head column order, and over {plan.size} ranks "
            f"each rank's runs of {run} columns are not whole blocks of {group}: use another "
            "tensor-parallel size")
