// A minimal test runner for the C++ unit tests (no test framework is installed here).
//
//   PL_TEST(name) { PL_CHECK(cond) << "context"; }   ...   int main() { return pl_test::run_all(); }
// Prints "N passed, N failed" at the end; exits non-zero if any test failed.
#pragma once

#include <exception>
#include <functional>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

namespace pl_test {

struct Failure : std::exception {
  std::string msg;
  explicit Failure(std::string m) : msg(std::move(m)) {}
  const char* what() const noexcept override { return msg.c_str(); }
};

// Collects "<< context" and throws Failure when destroyed on a failed check.
class CheckStream {
 public:
  CheckStream(bool ok, const char* expr, const char* file, int line) : ok_(ok) {
    if (!ok_) os_ << file << ":" << line << ": check failed: " << expr << " ";
  }
  template <typename T>
  CheckStream& operator<<(const T& v) {
    if (!ok_) os_ << v;
    return *this;
  }
  ~CheckStream() noexcept(false) {
    if (!ok_) throw Failure(os_.str());
  }

 private:
  bool ok_;
  std::ostringstream os_;
};

inline std::vector<std::pair<std::string, std::function<void()>>>& registry() {
  static std::vector<std::pair<std::string, std::function<void()>>> tests;
  return tests;
}

struct Register {
  Register(const char* name, std::function<void()> fn) { registry().emplace_back(name, std::move(fn)); }
};

inline int run_all() {
  int passed = 0, failed = 0;
  for (auto& [name, fn] : registry()) {
    try {
      fn();
      ++passed;
      std::cout << "PASS " << name << "\n";
    } catch (const std::exception& e) {
      ++failed;
      std::cout << "FAIL " << name << ": " << e.what() << "\n";
    }
  }
  std::cout << passed << " passed, " << failed << " failed\n";
  return failed == 0 ? 0 : 1;
}

}  // namespace pl_test

#define PL_CHECK(cond) ::pl_test::CheckStream((cond), #cond, __FILE__, __LINE__)
#define PL_TEST(name)                                                  \
  static void name();                                                  \
  static ::pl_test::Register name##_registration(#name, &name);        \
  static void name()
