#pragma once
// Bounds on what a LibTorch archive (a zip file: checkpoints, weight files) may expand to, checked before
// LibTorch reads it.
//
// Why: LibTorch's archive reader (miniz) allocates each record at the uncompressed size its zip entry
// declares and then inflates into it, so a 4 MB file of deflated zeros that declares gigabytes takes the
// process to gigabytes before any check of ours can run. LibTorch and PyTorch write every record stored
// (uncompressed), so in a real archive the records' sizes add up to less than the archive's own size:
// that is the bound, and it needs no knowledge of the model the file holds.

#include <cstdint>
#include <functional>
#include <string>

namespace capsnet::train {

/// The unsigned little-endian integer of `bytes` (1..8) bytes at p (the byte order of zip's fields).
uint64_t little_endian(const char* p, int bytes);

/// Reads n bytes at offset into out; false when the source has fewer.
using ArchiveReader = std::function<bool(uint64_t offset, size_t n, char* out)>;

/// "" when the zip archive of `size` bytes read through `read` declares no more uncompressed bytes, all
/// entries together, than `size`; else a sentence saying what it declares. Reads only the end-of-directory
/// records and the central directory (zip64 included). An archive whose directory cannot be found or
/// parsed is left to LibTorch, which refuses it ("" here).
std::string zip_expansion_problem(const ArchiveReader& read, uint64_t size);
/// The same for an archive in memory.
std::string zip_expansion_problem(const char* data, size_t size);
/// The same for an archive in a file ("" when the file cannot be opened: the caller reports that).
std::string zip_file_expansion_problem(const std::string& path);

}  // namespace capsnet::train
