"""Pure tensor code: column quantizers with bit packing, the two-stage quantized all-reduce, the exchange
component over them, row selection."""

from lightning_commstrats.compression.aggregation import MatrixLayout, QuantizedAllReduce
from lightning_commstrats.compression.exchange import (
    EXCHANGE_BITS,
    BucketedAllReduce,
    GradientCompression,
    TensorExchange,
)
from lightning_commstrats.compression.quantizers import CODEC_BITS, ColumnCodec, pack_bits, packed_bytes, unpack_bits
from lightning_commstrats.compression.rows import batch_token_ids, most_frequent, random_rows, resolve_count, union

__all__ = [
    "CODEC_BITS",
    "EXCHANGE_BITS",
    "BucketedAllReduce",
    "ColumnCodec",
    "GradientCompression",
    "MatrixLayout",
    "QuantizedAllReduce",
    "TensorExchange",
    "batch_token_ids",
    "most_frequent",
    "pack_bits",
    "packed_bytes",
    "random_rows",
    "resolve_count",
    "union",
    "unpack_bits",
]
