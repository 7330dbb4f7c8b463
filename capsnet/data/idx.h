#pragma once
// IDX file format (LeCun's MNIST files): magic 0x00 0x00 <type> <ndims>, ndims big-endian uint32 sizes,
// then the data. Every read is checked against the file length so that a truncated, corrupt or
// oversized file is reported by name instead of producing garbage.

#include <torch/torch.h>

#include <stdexcept>
#include <string>

namespace capsnet::data {

/// Thrown for any malformed IDX file; what() names the file and the problem.
class IdxError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// Reads an unsigned-byte (type 0x08) IDX file into a uint8 tensor of the shape its header gives.
/// Files ending in ".gz" are read through zlib. Throws IdxError on: missing/unreadable file (a FIFO or
/// device too), bad magic, unsupported type, zero or >4 dims, a dimension of 0, data shorter or longer
/// than the header says. max_rows > 0 reads only the first max_rows rows (along the first dimension;
/// memory is that of those rows): a plain file is still checked against its size, a .gz only up to them.
torch::Tensor read_idx(const std::string& path, int64_t max_rows = 0);

/// Writes a uint8 tensor (1 to 4 dims) as an IDX file (type 0x08). Used by tests and generators.
/// A path ending in ".gz" is written gzip-compressed. Throws IdxError for another dtype, 0 or > 4
/// dims, an empty dimension, or an I/O failure.
void write_idx(const std::string& path, const torch::Tensor& data);

}  // namespace capsnet::data
