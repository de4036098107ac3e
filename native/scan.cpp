#include <nanobind/nanobind.h>
namespace nb = nanobind;
void bind_scan(nb::module_& m) { (void)m; }
