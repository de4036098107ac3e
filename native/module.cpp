// The fusionrag native extension: one module, one binding function per part.
#include <nanobind/nanobind.h>

namespace nb = nanobind;

void bind_graph(nb::module_& m);
void bind_scan(nb::module_& m);
void bind_pagefile(nb::module_& m);
void bind_rerank(nb::module_& m);

NB_MODULE(_native, m) {
  m.doc() = "fusionrag native core: navigation graph, CPU PQ scan, SSD page file, re-ranking";
  bind_graph(m);
  bind_scan(m);
  bind_pagefile(m);
  bind_rerank(m);
}
