// How the shim's C functions report failure: a C++ exception becomes an error text in the
// caller's buffer (never an unwind into Rust), and a broken precondition throws.
#pragma once

#include <cstddef>
#include <cstdio>
#include <stdexcept>
#include <string>

namespace regatta_shim {

inline void write_error(const char* text, char* error, size_t error_len) {
    if (error != nullptr && error_len > 0) {
        std::snprintf(error, error_len, "%s", text);
    }
}

// Throws `what` (as std::invalid_argument) unless `holds`.
inline void expect(bool holds, const std::string& what) {
    if (!holds) {
        throw std::invalid_argument(what);
    }
}

}  // namespace regatta_shim
