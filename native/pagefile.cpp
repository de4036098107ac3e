#include <nanobind/nanobind.h>
namespace nb = nanobind;
void bind_pagefile(nb::module_& m) { (void)m; }
