// A barrier for the threads of one parallel region that meet many times in a row (decode_stack.cpp: ~10 times per
// layer of a decode step).
//
// Each torch op that runs its own at::parallel_for starts and joins an OpenMP team: ~1 us warm on the Zen 4 VM, and
// more after a weight stream has evicted libgomp's state. Inside one region the threads only need to wait for each
// other, which costs one shared cache line: the last thread to arrive moves the generation on, the others spin on it.
// Spinning suits a team of at most one thread per core (torch's intra-op threads); past kSpinsBeforeYield spins a
// waiter yields its core at every check, so an oversubscribed machine (another process's threads on the same
// cores) still makes progress.
//
// abort() releases every waiter for good: wait() then returns false, and the callers leave the region (a thread
// that raised must not leave the others waiting for it).
#pragma once

#include <atomic>
#include <cstdint>
#include <thread>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

namespace pagedserve_native {

class SpinBarrier {
 public:
  // The team's size: every thread of the region passes the same value before its first wait().
  void set_num_threads(int num_threads) { num_threads_.store(num_threads, std::memory_order_relaxed); }

  // Waits until every thread of the team has arrived; false once abort() was called (by any thread).
  bool wait() {
    const uint32_t generation = generation_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) == num_threads_.load(std::memory_order_relaxed) - 1) {
      // Reset before the release below: a thread released by it may arrive at the next wait at once.
      arrived_.store(0, std::memory_order_relaxed);
      generation_.store(generation + 1, std::memory_order_release);
    } else {
      for (int64_t spins = 0; generation_.load(std::memory_order_acquire) == generation; ++spins) {
        if (aborted_.load(std::memory_order_relaxed)) return false;
        if (spins < kSpinsBeforeYield) {
#if defined(__SSE2__)
          _mm_pause();
#endif
        } else {
          std::this_thread::yield();
        }
      }
    }
    return !aborted_.load(std::memory_order_relaxed);
  }

  void abort() { aborted_.store(true, std::memory_order_relaxed); }

 private:
  // ~0.2-0.5 ms of pause instructions: the stages' imbalances (a row stage, attention's items) are a few
  // microseconds, so a waiter past this is most likely waiting for a thread that lost its core.
  static constexpr int64_t kSpinsBeforeYield = int64_t{1} << 14;
  alignas(64) std::atomic<int> arrived_{0};
  alignas(64) std::atomic<uint32_t> generation_{0};
  std::atomic<int> num_threads_{1};
  std::atomic<bool> aborted_{false};
};

}  // namespace pagedserve_native
