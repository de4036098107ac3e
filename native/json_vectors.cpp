// Query vectors in a JSON request body, parsed in C++ (server/bodies.py Body.vectors): the list of rows of numbers
// a search body carries, read straight into a float32 matrix without the GIL. Through Python each number became a
// float object and each row a list before numpy copied it (~30 us a 384-d row under the GIL): a quarter of the
// time the GIL was held on 32-query searches, the service's limit when both cores were otherwise free.
//
// Only the plain case is read here: `[[n, ...], ...]` with every row `dim` JSON numbers (RFC 8259's grammar) that
// are finite as float32, at most `max_rows` rows, at least one. Anything else (NaN, a string, a row of another
// length, too many rows, a number past float32, malformed JSON) gives None, and the caller's walker reads the same
// bytes and answers with its own words: this path never decides an error. Each number is parsed as a double
// (correctly rounded, as json and orjson do) and then rounded to float32, as numpy's conversion of the walker's
// floats does, so both give the same bits.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <charconv>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <vector>

#include "numpy_out.h"

namespace nb = nanobind;

namespace {

struct Cursor {
  const char* p;
  const char* end;

  void ws() {
    while (p < end && (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r')) ++p;
  }
  bool eat(char c) {
    ws();
    if (p < end && *p == c) {
      ++p;
      return true;
    }
    return false;
  }
  bool peek(char c) {
    ws();
    return p < end && *p == c;
  }
};

inline bool digit(char c) { return c >= '0' && c <= '9'; }

// One JSON number at c.p (after whitespace): its value rounded to float32, false unless it is one and finite there.
bool number(Cursor& c, float& out) {
  c.ws();
  const char* s = c.p;
  const char* q = s;
  if (q < c.end && *q == '-') ++q;
  if (q >= c.end) return false;
  if (*q == '0') {
    ++q;
  } else if (digit(*q)) {
    while (q < c.end && digit(*q)) ++q;
  } else {
    return false;
  }
  if (q < c.end && *q == '.') {
    ++q;
    if (q >= c.end || !digit(*q)) return false;
    while (q < c.end && digit(*q)) ++q;
  }
  if (q < c.end && (*q == 'e' || *q == 'E')) {
    ++q;
    if (q < c.end && (*q == '+' || *q == '-')) ++q;
    if (q >= c.end || !digit(*q)) return false;
    while (q < c.end && digit(*q)) ++q;
  }
  double v;
  auto r = std::from_chars(s, q, v);
  if (r.ec != std::errc() || r.ptr != q) return false;  // out of double's range: the walker says so
  float f = static_cast<float>(v);
  if (!std::isfinite(f)) return false;  // past float32's range: the walker refuses it in its words
  out = f;
  c.p = q;
  return true;
}

}  // namespace

void bind_json_vectors(nb::module_& m) {
  m.def(
      "parse_vectors",
      [](nb::handle data, size_t pos, size_t dim, size_t max_rows) -> nb::object {
        Py_buffer view;
        if (PyObject_GetBuffer(data.ptr(), &view, PyBUF_SIMPLE) != 0) throw nb::python_error();
        std::vector<float> values;
        size_t rows = 0, end = 0;
        bool ok = false;
        {
          nb::gil_scoped_release nogil;
          const char* base = static_cast<const char*>(view.buf);
          Cursor c{base + std::min(pos, static_cast<size_t>(view.len)), base + view.len};
          ok = dim > 0 && c.eat('[');
          if (ok && c.peek(']')) ok = false;  // no rows: the walker's (and the model's) to answer
          while (ok) {
            if (rows == max_rows || !c.eat('[')) {
              ok = false;
              break;
            }
            size_t at = values.size();
            values.resize(at + dim);
            for (size_t j = 0; ok && j < dim; ++j) ok = (j == 0 || c.eat(',')) && number(c, values[at + j]);
            if (!ok || !c.eat(']')) {
              ok = false;
              break;
            }
            ++rows;
            if (c.eat(']')) break;
            if (!c.eat(',')) ok = false;
          }
          end = static_cast<size_t>(c.p - base);
        }
        PyBuffer_Release(&view);
        if (!ok) return nb::none();
        std::unique_ptr<float[]> out(new float[values.size()]);
        std::copy(values.begin(), values.end(), out.get());
        return nb::make_tuple(fusionrag::to_numpy(std::move(out), {rows, dim}), end);
      },
      nb::arg("data"), nb::arg("pos"), nb::arg("dim"), nb::arg("max_rows"),
      "The list of query vectors at byte `pos` of a JSON body (bytes or bytearray): (float32 (rows, dim), the "
      "position past its ']'), or None where it is not 1..max_rows rows of `dim` JSON numbers finite as float32 "
      "(the caller's own reader then answers for it). Each number is rounded to double, then to float32.");
}
