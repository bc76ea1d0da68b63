// parallel.h's thread sharing.
#include "parallel.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <memory>
#include <thread>

namespace jaxserve_native {
namespace {

namespace ffi = xla::ffi;

struct Job {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  int64_t total = 0;
  std::function<void(int64_t)> fn;
};

void Work(Job& job) {
  for (int64_t i; (i = job.next.fetch_add(1, std::memory_order_relaxed)) < job.total;) {
    job.fn(i);
    job.done.fetch_add(1, std::memory_order_release);
  }
}

}  // namespace

int64_t ThreadCap() {
  static const int64_t cap = [] {
    const char* s = std::getenv("JAXSERVE_NATIVE_THREADS");
    int64_t v = s ? std::atoll(s) : 0;
    return v > 0 ? v : int64_t(std::max(1u, std::thread::hardware_concurrency()));
  }();
  return cap;
}

namespace {
thread_local bool on_caller = false;
}  // namespace

int64_t ShareBytes() {
  static const int64_t bytes = [] {
    const char* s = std::getenv("JAXSERVE_NATIVE_SHARE_BYTES");
    return s && *s ? int64_t(std::atoll(s)) : kShareBytes;
  }();
  return bytes;
}

OnCaller::OnCaller(bool on) : was_(on_caller) { on_caller = was_ || on; }
OnCaller::~OnCaller() { on_caller = was_; }

void ParallelFor(ffi::ThreadPool& pool, int64_t total, std::function<void(int64_t)> fn) {
  int64_t threads = on_caller ? 1 : std::min({pool.num_threads(), ThreadCap(), total});
  if (threads <= 1) {
    for (int64_t i = 0; i < total; ++i) fn(i);
    return;
  }
  auto job = std::make_shared<Job>();
  job->total = total;
  job->fn = std::move(fn);
  for (int64_t t = 1; t < threads; ++t) pool.Schedule([job] { Work(*job); });
  Work(*job);
  while (job->done.load(std::memory_order_acquire) < total) std::this_thread::yield();
}

}  // namespace jaxserve_native
