"""Pure tensor codecs: column quantizers with bit packing, and the two-stage quantized all-reduce."""

from lightning_commstrats.compression.aggregation import MatrixLayout, QuantizedAllReduce
from lightning_commstrats.compression.quantizers import CODEC_BITS, ColumnCodec, pack_bits, packed_bytes, unpack_bits

__all__ = [
    "CODEC_BITS",
    "ColumnCodec",
    "MatrixLayout",
    "QuantizedAllReduce",
    "pack_bits",
    "packed_bytes",
    "unpack_bits",
]
