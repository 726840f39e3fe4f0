// Work handed out a unit at a time. at::parallel_for splits a range into one equal share per thread and waits for
// the last one: on a shared virtual machine the host slows one core now and then, and the other thread then waits
// at the end of every matmul (the 1.5B's 512-token prefill: 1.73-1.85x one thread's speed on two threads, the CPU
// time the same). Here the threads at::parallel_for starts take units from one counter, so a slowed thread takes
// fewer. A unit writes outputs no other unit writes: which thread runs it changes no value.
#pragma once
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

// fn(state, u) for u in [0, num_units), each once, by whichever thread takes it next; units taken in order, each
// thread with its own State (default-constructed per call: scratch a thread reuses from one unit to the next).
template <class State, class Fn>
inline void parallel_units_with(int64_t num_units, const Fn& fn) {
  if (num_units <= 0) return;
  std::atomic<int64_t> next{0};
  const int64_t num_workers = std::min<int64_t>(at::get_num_threads(), num_units);
  at::parallel_for(0, num_workers, 1, [&](int64_t, int64_t) {
    State state;
    for (int64_t u = next.fetch_add(1, std::memory_order_relaxed); u < num_units;
         u = next.fetch_add(1, std::memory_order_relaxed))
      fn(state, u);
  });
}

struct NoState {};

template <class Fn>
inline void parallel_units(int64_t num_units, const Fn& fn) {
  parallel_units_with<NoState>(num_units, [&](NoState&, int64_t u) { fn(u); });
}

// Runs of a matmul's tiles a thread takes: enough that the last unit's wait is small against the call.
constexpr int64_t kRunsPerThread = 16;
// Up to this many rows (decode steps, speculative verification) each thread takes one equal run of tiles, as
// at::parallel_for splits them: a decode step streams its run from memory, and its prefetches run ahead through it.
constexpr int64_t kStaticRows = 32;

// Tiles per run: enough runs that the last unit's wait is small against the call.
inline int64_t tile_run(int64_t num_tiles) {
  return std::max<int64_t>(1, num_tiles / (int64_t(at::get_num_threads()) * kRunsPerThread));
}

// fn(state, t0, t1) for runs of tiles [t0, t1) that cover [0, num_tiles), taken as the threads come free: work on
// the tiles alone (expanding each once), no rows.
template <class State, class Fn>
inline void parallel_runs(int64_t num_tiles, const Fn& fn) {
  const int64_t run = tile_run(num_tiles), num_runs = (num_tiles + run - 1) / run;
  parallel_units_with<State>(num_runs, [&](State& state, int64_t u) {
    fn(state, u * run, std::min(num_tiles, (u + 1) * run));
  });
}

// fn(state, t0, t1, m0, m1) for tiles [t0, t1) times rows [m0, m1), over num_tiles tiles and M rows in blocks of
// block_rows: with at most kStaticRows rows one run of tiles a thread, every block in turn; with more, units of one
// block times a run of tiles, taken as the threads come free, the blocks in order (both threads on one block of
// rows, which stays in their caches). Each output is one unit's: the same values however the units fall.
template <class State, class Fn>
inline void parallel_tiles(int64_t num_tiles, int64_t M, int64_t block_rows, const Fn& fn) {
  if (num_tiles <= 0 || M <= 0) return;
  if (M <= kStaticRows) {
    at::parallel_for(0, num_tiles, 1, [&](int64_t t0, int64_t t1) {
      State state;
      for (int64_t m0 = 0; m0 < M; m0 += block_rows) fn(state, t0, t1, m0, std::min(M, m0 + block_rows));
    });
    return;
  }
  const int64_t run = tile_run(num_tiles);
  const int64_t num_runs = (num_tiles + run - 1) / run;
  parallel_units_with<State>((M + block_rows - 1) / block_rows * num_runs, [&](State& state, int64_t u) {
    const int64_t t0 = u % num_runs * run, m0 = u / num_runs * block_rows;
    fn(state, t0, std::min(num_tiles, t0 + run), m0, std::min(M, m0 + block_rows));
  });
}
