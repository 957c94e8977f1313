// Kiln's declarations of Gloo's API (see ../../README.md). Gloo reports errors
// as exceptions derived from std::runtime_error; libtorch rethrows them as
// c10::Error, which is what Kiln's bridge catches.
#pragma once

#include <stdexcept>
