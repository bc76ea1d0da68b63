// parallel.h's thread sharing.
#include "parallel.h"

#include <immintrin.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
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

int64_t EnvInt(const char* name, int64_t fallback) {
  const char* s = std::getenv(name);
  return s && *s ? int64_t(std::atoll(s)) : fallback;
}

// The library's own helper threads (ThreadCap() - 1 of them), which after each job keep polling
// for the next one for SpinNs() before they sleep: a decode step's calls come tens of
// microseconds apart, so they find the crew awake and a call of ~10 us can still be shared.
class Crew {
 public:
  explicit Crew(int64_t helpers, int64_t spin_ns) : spin_ns_(spin_ns) {
    for (int64_t t = 0; t < helpers; ++t) std::thread([this] { Loop(); }).detach();
  }

  // Runs job on the crew and the calling thread; false (nothing run) while another caller has the
  // crew. Helpers asleep are woken and join when they can: a call over before they wake ran on
  // the caller alone, and the caller waits only for chunks a helper has claimed.
  bool Run(const std::shared_ptr<Job>& job) {
    if (busy_.exchange(true, std::memory_order_acquire)) return false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      job_ = job;
      gen_.fetch_add(1, std::memory_order_release);
      if (sleepers_) cv_.notify_all();
    }
    Work(*job);
    // Chunks a helper has claimed: poll, and let another thread have this CPU now and then (a
    // helper preempted mid-chunk may need it).
    for (int64_t n = 1; job->done.load(std::memory_order_acquire) < job->total; ++n) {
      _mm_pause();
      if (n % 256 == 0) std::this_thread::yield();
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      job_.reset();
    }
    busy_.store(false, std::memory_order_release);
    return true;
  }

 private:
  void Loop() {
    uint64_t seen = gen_.load(std::memory_order_acquire);
    for (;;) {
      auto t0 = std::chrono::steady_clock::now();
      uint64_t g;
      for (int64_t n = 1; (g = gen_.load(std::memory_order_acquire)) == seen; ++n) {
        _mm_pause();
        if (n % 256 != 0) continue;
        std::this_thread::yield();  // a thread of another's waiting for this CPU goes first
        if (std::chrono::steady_clock::now() - t0 > std::chrono::nanoseconds(spin_ns_)) {
          std::unique_lock<std::mutex> lock(mu_);
          ++sleepers_;
          cv_.wait(lock, [&] { return gen_.load(std::memory_order_acquire) != seen; });
          --sleepers_;
          t0 = std::chrono::steady_clock::now();
        }
      }
      seen = g;
      std::shared_ptr<Job> job;
      {
        std::lock_guard<std::mutex> lock(mu_);
        job = job_;
      }
      if (job) Work(*job);
    }
  }

  const int64_t spin_ns_;
  std::atomic<bool> busy_{false};
  std::atomic<uint64_t> gen_{0};
  std::mutex mu_;
  std::condition_variable cv_;
  std::shared_ptr<Job> job_;  // guarded by mu_
  int sleepers_ = 0;          // guarded by mu_
};

}  // namespace

int64_t ThreadCap() {
  static const int64_t cap = [] {
    const int64_t v = EnvInt("JAXSERVE_NATIVE_THREADS", 0);
    if (v > 0) return v;
    cpu_set_t cpus;  // the CPUs this process may run on (taskset, cgroups), not every CPU online
    if (sched_getaffinity(0, sizeof(cpus), &cpus) == 0) return int64_t(std::max(1, CPU_COUNT(&cpus)));
    return int64_t(std::max(1u, std::thread::hardware_concurrency()));
  }();
  return cap;
}

namespace {

// One pass over n bytes from p (64-bit sums, so nothing is optimised away).
uint64_t ReadPass(const uint64_t* p, int64_t n) {
  uint64_t a = 0, b = 0, c = 0, d = 0;
  for (int64_t i = 0; i + 4 <= n / 8; i += 4) a += p[i], b += p[i + 1], c += p[i + 2], d += p[i + 3];
  return a + b + c + d;
}

// How much faster two threads read a buffer larger than most caches than one thread does: ~2
// where each thread has a core of its own, ~1 where the two share one core's load units (the
// two vCPUs of a Zen 4 machine measured in BENCHMARKS.md read at one core's rate) or where
// another process keeps the other core busy. The best of five rounds, so a passing burst of
// load elsewhere does not decide it.
double ProbeTwoThreads() {
  constexpr int64_t kBytes = int64_t(64) << 20;
  std::unique_ptr<uint64_t[]> buf(new uint64_t[kBytes / 8]);
  for (int64_t i = 0; i < kBytes / 8; ++i) buf[i] = uint64_t(i);
  std::atomic<uint64_t> sink{0};
  auto seconds = [](auto&& fn) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  double best = 0.0;
  for (int round = 0; round < 5; ++round) {
    const double one = seconds([&] { sink += ReadPass(buf.get(), kBytes); });
    const double two = seconds([&] {
      std::thread helper([&] { sink += ReadPass(buf.get() + kBytes / 16, kBytes / 2); });
      sink += ReadPass(buf.get(), kBytes / 2);
      helper.join();
    });
    best = std::max(best, one / two);
  }
  return best;
}

struct CrewChoice {
  int64_t spin_ns;
  double probe;  // ProbeTwoThreads(), or 0 where not measured
};

const CrewChoice& Choice() {
  static const CrewChoice choice = [] {
    const char* s = std::getenv("JAXSERVE_NATIVE_SPIN_US");
    if (ThreadCap() <= 1) return CrewChoice{0, 0.0};
    if (s && *s && std::string(s) != "auto") return CrewChoice{1000 * std::max<int64_t>(0, std::atoll(s)), 0.0};
    const double probe = ProbeTwoThreads();
    return CrewChoice{probe >= kCrewProbe ? 1000 * kSpinUs : 0, probe};
  }();
  return choice;
}

}  // namespace

int64_t SpinNs() { return Choice().spin_ns; }
double CrewProbe() { return Choice().probe; }

namespace {
thread_local bool on_caller = false;
thread_local bool on_pool = false;

Crew* TheCrew() {
  static Crew* crew = SpinNs() > 0 ? new Crew(ThreadCap() - 1, SpinNs()) : nullptr;  // SpinNs(): 0 on one CPU
  return crew;
}
}  // namespace

int64_t ShareBytes() {
  static const int64_t bytes = EnvInt("JAXSERVE_NATIVE_SHARE_BYTES", SpinNs() > 0 ? kCrewShareBytes : kShareBytes);
  return bytes;
}

RunOn::RunOn(bool caller, bool pool) : was_caller_(on_caller), was_pool_(on_pool) {
  on_caller = on_caller || caller;
  on_pool = on_pool || pool;
}
RunOn::~RunOn() {
  on_caller = was_caller_;
  on_pool = was_pool_;
}

int64_t PoolRows() {
  static const int64_t rows = EnvInt("JAXSERVE_NATIVE_POOL_ROWS", kPoolRows);
  return rows;
}

void ParallelFor(ffi::ThreadPool& pool, int64_t total, std::function<void(int64_t)> fn) {
  Crew* crew = on_caller || on_pool ? nullptr : TheCrew();
  int64_t threads = on_caller ? 1 : std::min(crew ? ThreadCap() : std::min(pool.num_threads(), ThreadCap()), total);
  if (threads <= 1) {
    for (int64_t i = 0; i < total; ++i) fn(i);
    return;
  }
  auto job = std::make_shared<Job>();
  job->total = total;
  job->fn = std::move(fn);
  if (crew && crew->Run(job)) return;
  // The crew is taken by another caller's call (this one shares XLA's pool), or there is none.
  threads = std::min({pool.num_threads(), ThreadCap(), total});
  for (int64_t t = 1; t < threads; ++t) pool.Schedule([job] { Work(*job); });
  Work(*job);
  while (job->done.load(std::memory_order_acquire) < total) std::this_thread::yield();
}

}  // namespace jaxserve_native
