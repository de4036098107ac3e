// Arrays between numpy and the native parts: shapes for messages, and results
// filled without the GIL, then handed to Python as numpy arrays that own their memory.
#pragma once
#include <nanobind/ndarray.h>
#include <stdlib.h>

#include <algorithm>
#include <cstddef>
#include <initializer_list>
#include <memory>
#include <new>
#include <string>
#include <vector>

namespace fusionrag {

// "(2, 5)", "(3,)": an array's shape as numpy prints it.
template <class A>
std::string shape_of(const A& a) {
  std::string s = "(";
  for (size_t i = 0; i < a.ndim(); ++i) s += (i ? ", " : "") + std::to_string(a.shape(i));
  return s + (a.ndim() == 1 ? ",)" : ")");
}

// Hands a new[]-allocated result to Python.
template <class T>
nanobind::ndarray<nanobind::numpy, T> to_numpy(std::unique_ptr<T[]> data, std::initializer_list<size_t> shape) {
  T* p = data.release();
  nanobind::capsule owner(p, [](void* v) noexcept { delete[] static_cast<T*>(v); });
  return nanobind::ndarray<nanobind::numpy, T>(p, shape, owner);
}

// A result allocated for its shape, page-aligned, so O_DIRECT may read straight into it.
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
