// Kiln's declarations of Gloo's API (see ../../README.md).
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

// The Gloo inside torch 2.11 has the extended store interface; its own header
// announces it with this macro, which ProcessGroupGloo.hpp tests.
#define GLOO_STORE_HAS_STORE_V2 1

namespace gloo {
namespace rendezvous {

// The key-value store Gloo's ranks find each other through. libtorch adapts its
// c10d::Store to it (ProcessGroupGloo::GlooStore); Kiln never derives from it.
class Store {
 public:
  virtual ~Store() = default;

  virtual void set(const std::string& key, const std::vector<char>& data) = 0;
  virtual std::vector<char> get(const std::string& key) = 0;
  virtual void wait(const std::vector<std::string>& keys) = 0;
  virtual void wait(
      const std::vector<std::string>& keys,
      const std::chrono::milliseconds& timeout) = 0;

  virtual bool has_v2_support() = 0;
  virtual std::vector<std::vector<char>> multi_get(const std::vector<std::string>& keys) = 0;
  virtual void multi_set(
      const std::vector<std::string>& keys,
      const std::vector<std::vector<char>>& values) = 0;
  virtual void append(const std::string& key, const std::vector<char>& data) = 0;
  virtual int64_t add(const std::string& key, int64_t value) = 0;
};

}  // namespace rendezvous
}  // namespace gloo
