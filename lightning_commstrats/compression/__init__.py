"""Pure tensor code: line quantizers (uniform grids, 1-bit SGD's means, E3M0) with bit packing, the two-stage
quantized all-reduce, sparse top-k pseudo-gradients (SparseLoCo), the exchange component over them, row selection."""

from lightning_commstrats.compression.aggregation import MatrixLayout, QuantizedAllReduce
from lightning_commstrats.compression.exchange import (
    EXCHANGE_BITS,
    BucketedAllReduce,
    GradientCompression,
    TensorExchange,
)
from lightning_commstrats.compression.quantizers import (
    CODEC_BITS,
    CODECS,
    ColumnCodec,
    E3M0Codec,
    make_codec,
    pack_bits,
    packed_bytes,
    unpack_bits,
)
from lightning_commstrats.compression.rows import batch_token_ids, most_frequent, random_rows, resolve_count, union
from lightning_commstrats.compression.sparse import SparseAllGather, TopKCodec

__all__ = [
    "CODECS",
    "CODEC_BITS",
    "EXCHANGE_BITS",
    "BucketedAllReduce",
    "ColumnCodec",
    "E3M0Codec",
    "GradientCompression",
    "MatrixLayout",
    "QuantizedAllReduce",
    "SparseAllGather",
    "TensorExchange",
    "TopKCodec",
    "batch_token_ids",
    "make_codec",
    "most_frequent",
    "pack_bits",
    "packed_bytes",
    "random_rows",
    "resolve_count",
    "union",
    "unpack_bits",
]
