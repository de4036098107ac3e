// The probe's ratio rule (retriever/engine/tiers.py NavigationTier.probe) in one pass over a call's (q, m) lists:
// numpy did it in a dozen calls (sqrt, the bound, a gather of the lists' sizes, a cumulative sum, masks), ~15-20 us
// of a one-query search's ~370. Arithmetic as numpy's: each distance's square root in float32, the bound
// float32(1 + ratio) times the nearest one's, a list kept when its root is within the bound or when the lists
// before it (nearest first) hold fewer than `rerank` postings; a list cut becomes -1.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>

#include "numpy_out.h"

namespace nb = nanobind;
using namespace nb::literals;
using fusionrag::NumpyOut;

using Lists = nb::ndarray<int32_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using Dists = nb::ndarray<const float, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using Sizes = nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

void bind_probe_cut(nb::module_& m) {
  m.def(
      "ratio_cut",
      [](Lists lists, Dists dists, std::optional<Sizes> sizes, double ratio, int64_t rerank) {
        const size_t nq = lists.shape(0), w = lists.shape(1);
        if (dists.shape(0) != nq || dists.shape(1) != w)
          throw std::invalid_argument("dists must have the lists' shape (" + std::to_string(nq) + ", " +
                                      std::to_string(w) + ")");
        const int64_t* sz = sizes ? sizes->data() : nullptr;
        const int64_t nsizes = sizes ? int64_t(sizes->shape(0)) : 0;
        int32_t* l = lists.data();
        const float* d = dists.data();
        if (sz)
          for (size_t i = 0; i < nq * w; ++i)
            if (l[i] >= nsizes)
              throw std::invalid_argument("list " + std::to_string(l[i]) + " has no size (" +
                                          std::to_string(nsizes) + " lists)");
        NumpyOut<int64_t> probed({nq});
        const float scale = static_cast<float>(1.0 + ratio);
        {
          nb::gil_scoped_release nogil;
          for (size_t i = 0; i < nq; ++i) {
            int32_t* row = l + i * w;
            const float* drow = d + i * w;
            const float bound = scale * std::sqrt(std::max(drow[0], 0.0f));
            int64_t before = 0, kept = 0;
            for (size_t j = 0; j < w; ++j) {
              const int32_t list = row[j];
              bool keep = std::sqrt(std::max(drow[j], 0.0f)) <= bound;
              if (sz) {
                keep |= before < rerank && list >= 0;
                before += list >= 0 ? sz[list] : 0;
              }
              if (!keep) row[j] = -1;
              kept += row[j] >= 0;
            }
            probed.data()[i] = kept;
          }
        }
        return probed.release();
      },
      "lists"_a.noconvert(), "dists"_a, "sizes"_a = nb::none(), "ratio"_a, "rerank"_a,
      "The ratio rule on int32 (q, m) lists, nearest first, in place: a list stays where sqrt(its squared distance) "
      "<= float32(1 + ratio) x the nearest one's, or (sizes given, int64 postings a list) where the lists before it "
      "hold fewer than `rerank` postings; the others become -1. Returns the lists kept a query, int64 (q,).");
}
