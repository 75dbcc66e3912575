// Dims: a tensor's sizes, kept inline up to kInline dimensions.
//
// Every donation records its tensor's shape (the reports' "f32[4,4]").  A
// std::vector costs one heap allocation per donor and step, and in a loop
// that donates hundreds of tensors per step those small allocations showed
// in the count of the async loop (benchmarks/bench_async_instructions.py):
// not only their own cost, but the malloc traffic they add to torch's own.
// Shapes with more dimensions than kInline go to a vector.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <vector>

namespace torch_xla_donate {

class Dims {
 public:
  static constexpr size_t kInline = 6;

  Dims() = default;
  Dims(const std::vector<int64_t>& v) { assign(v.begin(), v.end()); }  // NOLINT: a shape is a shape

  template <class It>
  void assign(It first, It last) {
    const size_t n = static_cast<size_t>(std::distance(first, last));
    size_ = n;
    if (n <= kInline) {
      std::copy(first, last, inline_);
      heap_.clear();
    } else {
      heap_.assign(first, last);
    }
  }
  void clear() { assign(inline_, inline_); }

  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  const int64_t* begin() const { return size_ <= kInline ? inline_ : heap_.data(); }
  const int64_t* end() const { return begin() + size_; }
  int64_t operator[](size_t i) const { return begin()[i]; }

 private:
  size_t size_ = 0;
  int64_t inline_[kInline];
  std::vector<int64_t> heap_;  // only beyond kInline dimensions
};

}  // namespace torch_xla_donate
