#pragma once
// Checks every reader runs before opening a file: a FIFO would block open() forever and a device such as
// /dev/zero never ends, so only regular files (after symlinks) are read.

#include <string>
#include <string_view>

namespace capsnet::data {

/// Empty when `path` is a regular file (following symlinks) or does not exist (the caller's open then
/// reports that); otherwise why it is not read: "is a directory", "not a regular file (a FIFO, socket or
/// device)", or the error of looking it up (e.g. a symlink loop).
std::string unreadable_reason(const std::string& path);

/// Empty when `path` can be written in place: it does not exist, is a regular file, or is a character
/// device such as /dev/null (written straight, never replaced); otherwise why not: "is a directory", or
/// "is a FIFO, socket or block device" (a FIFO would block until a reader comes).
std::string unwritable_reason(const std::string& path);

/// True when `path` exists and is not a regular file (after symlinks): a writer that replaces files
/// (write to a temporary, rename over) must refuse it, or it would replace a device node or FIFO.
bool exists_but_not_regular(const std::string& path);

/// `text` with every byte that is not part of valid UTF-8 written as the four characters \xNN (a backslash,
/// x and two upper-case hex digits); `text` itself when it is valid. JSON holds UTF-8 only: this is how
/// file, folder and class names that are not UTF-8 are written into it.
std::string escape_invalid_utf8(std::string_view text);

}  // namespace capsnet::data
