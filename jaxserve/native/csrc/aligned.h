// Cache-line-aligned storage for the kernels' scratch: a vector store into it never splits over
// two lines, and an AMX tile row (64 bytes) read from it is one line (a tile of activations at
// an odd 16-byte offset reads 32 lines in place of 16: the AMX GEMMs ran ~1.7x slower so).
#pragma once

#include <cstddef>
#include <new>
#include <vector>

namespace jaxserve_native {

template <typename T>
struct LineAligned {
  using value_type = T;
  LineAligned() = default;
  template <typename U>
  LineAligned(const LineAligned<U>&) {}
  T* allocate(std::size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* p, std::size_t) { ::operator delete(p, std::align_val_t(64)); }
  bool operator==(const LineAligned&) const { return true; }
  bool operator!=(const LineAligned&) const { return false; }
};

template <typename T>
using AlignedVector = std::vector<T, LineAligned<T>>;

}  // namespace jaxserve_native
