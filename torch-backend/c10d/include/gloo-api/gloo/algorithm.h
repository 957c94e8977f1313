// Kiln's declarations of Gloo's API (see ../README.md): nothing from this header
// is used by ProcessGroupGloo.hpp's declarations.
#pragma once

#include "gloo/context.h"
