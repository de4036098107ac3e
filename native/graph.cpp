#include <nanobind/nanobind.h>
namespace nb = nanobind;
void bind_graph(nb::module_& m) { (void)m; }
