// The threads a product is shared among: one pool of workers that spin, then yield, then sleep
// between products (a decode step's products come microseconds apart), taking the product's pieces
// as they come free.
#pragma once

#include <pthread.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace qk {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

// Waits for `cell` to differ from `old`: a spin of spin_us microseconds (the next product of a decode
// step usually comes within it), then asleep in the kernel (futex), never spinning on.  Past its
// first 20 us the spin yields the core at each turn, so that a thread with work to do (the stream
// thread, the engine's, another process) runs first where the cores are all taken.
template <class T>
T await_change(std::atomic<T>& cell, T old, int spin_us) {
  T now;
  auto start = std::chrono::steady_clock::now();
  auto until = start + std::chrono::microseconds(spin_us), polite = start + std::chrono::microseconds(20);
  bool yielding = false;
  for (int i = 0; (now = cell.load(std::memory_order_acquire)) == old; ++i) {
    if ((i & 63) == 63 || yielding) {
      auto t = std::chrono::steady_clock::now();
      if (t > until) {
        cell.wait(old, std::memory_order_acquire);
        continue;
      }
      yielding = t > polite;
    }
    if (yielding) {
      std::this_thread::yield();
    } else {
      cpu_relax();
    }
  }
  return now;
}

// Worker threads for one product at a time.  The caller runs fn(0) itself; a second caller while a
// product runs (another MLX stream) runs every fn(t) alone, which gives the same results since a
// share's sums do not depend on the split.
//
// run(n, fn) returns once fn(0) has returned and every worker that entered the product has left
// it.  A worker enters only while the product is open, and the caller closes it when fn(0)
// returns: with `fn` taking pieces of the work from a shared counter until none are left
// (Pieces), a worker that wakes late (asleep, or its core taken by another thread) finds the
// product closed or its pieces taken, and the caller never waits for it to wake.
class Pool {
 public:
  // How long a waiting thread spins before it sleeps.  Long enough to span what a decode step does
  // between two products (attention, norms, the host's next step): a worker woken from its sleep
  // takes tens of microseconds to run again under a hypervisor, every product.  SmolLM2 Q4_1 on 2
  // cores, one sequence: 86 tokens/s with 20 us, 96-97 with 1-2 ms; 4 sequences 191 against 228.
  int spin_us = 2000;

  void run(int n, const std::function<void(int)>& fn) {
    std::unique_lock<std::mutex> lock(busy_, std::try_to_lock);
    if (n <= 1 || !lock.owns_lock()) {
      for (int t = 0; t < n; ++t) fn(t);
      return;
    }
    while ((int)workers_ < n - 1) {
      // the epoch it starts from is the current one: a thread that starts late still sees this product
      std::thread(&Pool::work, this, (int)workers_ + 1, epoch_.load(std::memory_order_relaxed)).detach();
      ++workers_;
    }
    fn_ = &fn;
    n_ = n;
    const uint32_t e = (epoch_.load(std::memory_order_relaxed) + 1) & ~CLOSED;
    gate_.store((uint64_t)e << 32, std::memory_order_release);  // open, nobody inside
    epoch_.store(e, std::memory_order_release);
    epoch_.notify_all();
    fn(0);
    // closed: the epoch's low bit set; then wait for those inside to leave
    uint64_t g = gate_.load(std::memory_order_acquire);
    while (!gate_.compare_exchange_weak(g, ((uint64_t)(e | CLOSED) << 32) | (g & INSIDE), std::memory_order_acq_rel)) {
    }
    while ((g = gate_.load(std::memory_order_acquire)) & INSIDE) await_change(gate_, g, spin_us);
  }

 private:
  static constexpr uint32_t CLOSED = 0x80000000u;
  static constexpr uint64_t INSIDE = 0xffffffffu;

  void work(int index, uint32_t seen) {
    bool used = true;
    for (;;) {
      // a worker the last product did not use (fewer threads now than were started) sleeps at once
      seen = await_change(epoch_, seen, used ? spin_us : 0);
      used = index < n_;
      if (!used) continue;
      uint64_t g = gate_.load(std::memory_order_acquire);
      bool in = false;
      while ((uint32_t)(g >> 32) == seen && !(in = gate_.compare_exchange_weak(g, g + 1, std::memory_order_acq_rel))) {
      }
      if (!in) continue;  // closed already: the caller did it all
      (*fn_)(index);
      if ((gate_.fetch_sub(1, std::memory_order_acq_rel) & INSIDE) == 1) gate_.notify_one();
    }
  }

  std::mutex busy_;
  unsigned workers_ = 0;
  std::atomic<uint32_t> epoch_{0};  // the product's number (never with CLOSED set: see run)
  std::atomic<uint64_t> gate_{0};   // its epoch (| CLOSED once closed) << 32 | the workers inside it
  const std::function<void(int)>* fn_ = nullptr;
  int n_ = 0;
};

// `count` pieces of work handed out in order, each to the first thread that asks: a share of a
// product is fn(t) = while ((p = pieces.next()) >= 0) do piece p.
class Pieces {
 public:
  explicit Pieces(int count) : count_(count) {}
  int next() {
    int p = next_.fetch_add(1, std::memory_order_relaxed);
    return p < count_ ? p : -1;
  }

 private:
  int count_;
  std::atomic<int> next_{0};
};

// Never destroyed (its threads are detached and may be asleep at exit); a forked child, which has
// none of the parent's threads, starts a new one.
inline Pool* g_pool = new Pool();
inline const int g_atfork = pthread_atfork(nullptr, nullptr, [] { g_pool = new Pool(); });

}  // namespace qk
