// The fusionrag native extension: one module, one binding function per part.
#include <nanobind/nanobind.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "scratch_meter.h"
#include "threadpool.h"

namespace nb = nanobind;

void bind_graph(nb::module_& m);
void bind_scan(nb::module_& m);
void bind_pagefile(nb::module_& m);
void bind_rerank(nb::module_& m);
void bind_json_vectors(nb::module_& m);
void bind_query_rows(nb::module_& m);
void bind_probe_cut(nb::module_& m);

NB_MODULE(_native, m) {
  m.doc() = "fusionrag native core: navigation graph, CPU PQ scan, SSD page file, re-ranking, query vectors of JSON";
  bind_graph(m);
  bind_scan(m);
  bind_pagefile(m);
  bind_rerank(m);
  bind_json_vectors(m);
  bind_query_rows(m);
  bind_probe_cut(m);

  m.def(
      "scratch_bytes", [] { return std::max<int64_t>(0, fusionrag::scratch_total().load(std::memory_order_relaxed)); },
      "Bytes the search kernels keep allocated per thread between calls, summed over the process's threads: "
      "the graph's visited tags (4 B a centroid), a scan's seen-bitmap (N / 8 bytes), a batch plan's masks "
      "(N bytes) and smaller buffers, one set per thread that has searched, held until that thread ends; and the "
      "re-rank's scratch kept for the next call (a round's blocks and its read-ahead, at most twice the pool's "
      "threads of them).");

  // For tests of the pool itself: a job whose items wait on something the test controls.
  m.def(
      "_pool_read_bytes",
      [](int fd, size_t items, int num_threads) {
        nb::gil_scoped_release nogil;
        fusionrag::ThreadPool::instance().parallel_for(
            items, fusionrag::pool_threads(num_threads), [&](size_t, size_t) {
              char c;
              ssize_t r;
              while ((r = ::read(fd, &c, 1)) < 0 && errno == EINTR) {
              }
              if (r != 1) throw std::runtime_error("_pool_read_bytes: read gave " + std::to_string(r));
            });
      },
      nb::arg("fd"), nb::arg("items"), nb::arg("num_threads") = 0,
      "Test hook: a pool job of `items` items on up to num_threads threads, each item reading one byte from fd "
      "(blocking until it is there).");
}
