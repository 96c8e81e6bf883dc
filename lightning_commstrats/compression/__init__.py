"""Pure tensor code: column quantizers with bit packing, the two-stage quantized all-reduce, row selection."""

from lightning_commstrats.compression.aggregation import MatrixLayout, QuantizedAllReduce
from lightning_commstrats.compression.quantizers import CODEC_BITS, ColumnCodec, pack_bits, packed_bytes, unpack_bits
from lightning_commstrats.compression.rows import batch_token_ids, most_frequent, random_rows, resolve_count, union

__all__ = [
    "CODEC_BITS",
    "ColumnCodec",
    "MatrixLayout",
    "QuantizedAllReduce",
    "batch_token_ids",
    "most_frequent",
    "pack_bits",
    "packed_bytes",
    "random_rows",
    "resolve_count",
    "union",
    "unpack_bits",
]
