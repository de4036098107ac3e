// A result array filled without the GIL, then handed to Python as a numpy array
// that owns its memory. Page-aligned, so O_DIRECT may read straight into it.
#pragma once
#include <nanobind/ndarray.h>
#include <stdlib.h>

#include <algorithm>
#include <cstddef>
#include <initializer_list>
#include <memory>
#include <new>
#include <vector>

namespace fusionrag {

template <class T>
class NumpyOut {
 public:
  NumpyOut(std::initializer_list<size_t> shape) : shape_(shape) {
    size_t n = 1;
    for (size_t s : shape_) n *= s;
    void* p = nullptr;
    if (posix_memalign(&p, 4096, std::max<size_t>(1, n * sizeof(T)))) throw std::bad_alloc();
    data_.reset(static_cast<T*>(p));
  }
  T* data() { return data_.get(); }

  nanobind::ndarray<nanobind::numpy, T> release() {  // needs the GIL
    T* p = data_.release();
    nanobind::capsule owner(p, [](void* q) noexcept { free(q); });
    return nanobind::ndarray<nanobind::numpy, T>(p, shape_.size(), shape_.data(), owner);
  }

 private:
  std::vector<size_t> shape_;
  std::unique_ptr<T, void (*)(void*)> data_{nullptr, free};
};

}  // namespace fusionrag
