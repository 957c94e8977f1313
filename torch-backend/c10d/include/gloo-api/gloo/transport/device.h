// Kiln's declarations of Gloo's API (see ../../README.md).
#pragma once

namespace gloo {
namespace transport {

// A network device (an interface and address to bind). Kiln receives these
// from ProcessGroupGloo::create*Device and passes them back; never built here.
class Device;

// A buffer of a pending send or receive, held by std::unique_ptr in libtorch's
// send and receive work objects, which Kiln never creates.
class UnboundBuffer;

}  // namespace transport
}  // namespace gloo
