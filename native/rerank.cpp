#include <nanobind/nanobind.h>
namespace nb = nanobind;
void bind_rerank(nb::module_& m) { (void)m; }
