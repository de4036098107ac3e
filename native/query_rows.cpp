// Query rows checked and made unit length in one pass (retriever/engine/queries.py prepare_queries): what numpy
// did in ten calls (isfinite, a float64 copy, einsum for the squared norms, the problem masks, then a second float64
// copy, norm and division for cosine) cost ~16 us on a one-query search, more than the service's parse of its body.
//
// Each row's squared norm is summed in double, as vector_problems' float64 einsum does, so a tiny (even denormal)
// vector still has its direction and a huge one does not overflow; the first row the engine cannot use is reported
// with why (the caller words it), and rows are divided by the double norm and rounded to float32 as normalize does.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cmath>
#include <cstdint>
#include <memory>

#include "numpy_out.h"

namespace nb = nanobind;

using Rows = nb::ndarray<const float, nb::ndim<2>, nb::c_contig, nb::device::cpu>;

void bind_query_rows(nb::module_& m) {
  m.def(
      "check_rows",
      [](Rows block, bool cosine, bool unit, double max_sq) -> nb::object {
        const size_t n = block.shape(0), d = block.shape(1);
        const float* x = block.data();
        int64_t bad = -1;
        int why = 0;
        double bad_sq = 0;
        std::unique_ptr<float[]> out;
        {
          nb::gil_scoped_release nogil;
          if (unit) out.reset(new float[n * d]);
          for (size_t i = 0; i < n && bad < 0; ++i) {
            const float* r = x + i * d;
            double sq = 0;
            bool finite = true;
            for (size_t j = 0; j < d; ++j) {
              const double v = r[j];
              finite &= std::isfinite(r[j]);
              sq += v * v;
            }
            if (!finite) {
              bad = int64_t(i), why = 1;
            } else if (sq > max_sq) {
              bad = int64_t(i), why = 2, bad_sq = sq;
            } else if (cosine && sq == 0) {
              bad = int64_t(i), why = 3;
            } else if (unit) {
              const double norm = std::sqrt(sq);
              float* o = out.get() + i * d;
              for (size_t j = 0; j < d; ++j) o[j] = static_cast<float>(double(r[j]) / norm);
            }
          }
        }
        if (bad >= 0) return nb::make_tuple(nb::none(), bad, why, bad_sq);
        if (!unit) return nb::make_tuple(nb::none(), -1, 0, 0.0);
        return nb::make_tuple(fusionrag::to_numpy(std::move(out), {n, d}), -1, 0, 0.0);
      },
      nb::arg("block"), nb::arg("cosine"), nb::arg("unit"), nb::arg("max_sq"),
      "Check float32 (n, d) rows in one pass: (unit rows float32 (n, d) when `unit`, else None; the first bad row or "
      "-1; why: 1 NaN or infinity, 2 squared norm over max_sq, 3 a zero vector under `cosine`; that squared norm). Norms in double; each row divided by its double norm and rounded to float32.");
}
