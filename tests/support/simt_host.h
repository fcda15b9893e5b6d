// Host shim that runs CUDA kernels' own source on the CPU, SIMT-style (tests/support/cuda_emulator.py includes it ahead of
// the kernel source and compiles both with g++).
//
// The CUDA keywords vanish or become host C++:
// - __global__, __device__, __host__, __launch_bounds__(n) vanish; __forceinline__ is inline. __CUDACC__ is defined,
//   so the kernel sources compile their __global__ wrappers as nvcc sees them; __CUDA_ARCH__ is not, so device
//   intrinsics (__fmul_rn, __umul64hi) take their host spellings.
// - threadIdx, blockIdx, blockDim, gridDim are globals that always hold the running emulated thread's values.
// - __shared__ is `static`: one copy per kernel function, and since the blocks of a launch run one after another, a
//   static is exactly one block's shared memory. CUDA leaves shared memory uninitialised, so every variable
//   declared __shared__ is filled with 0xff bytes (a NaN in every float and double, 0xffffffff in every unsigned)
//   before each block: a read of shared memory no thread of the block wrote shows up in the results. The emulator
//   finds the variables in the built library's symbol table and registers them (host_set_shared).
// - __syncthreads() is a barrier over cooperative fibers: each thread of a block runs on its own small stack (made
//   with POSIX makecontext; switches are _setjmp/_longjmp, no OS threads). A block runs every thread up to its next
//   barrier, one thread after another, in the order host_set_order chose (increasing, decreasing, or a
//   pseudo-random permutation drawn afresh for every block and phase), then every thread up to the following
//   barrier, and so on; the blocks of the grid run one after another in the same kind of order. Nothing runs
//   concurrently and the schedule depends only on the order, so a run is deterministic; a kernel that reads what
//   another thread writes without a barrier between gives a different result in some order. Every thread must
//   reach the same barrier each phase (the same __syncthreads() in the source, the same number of times) and then
//   all must return together: anything else is a divergent barrier (undefined on a GPU: a hang or a wrong result),
//   reported as the launch's error.
// - A launch's geometry is checked against CUDA's limits and the kernel's __launch_bounds__ (host_bounds_<name>).
#pragma once

#undef _FORTIFY_SOURCE                 // _longjmp between fiber stacks: no __longjmp_chk
#include <dlfcn.h>
#include <setjmp.h>
#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <mutex>
#include <utility>
#include <vector>

#define __CUDACC__ 1
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define __syncthreads() ::simt::barrier(__COUNTER__, __FILE__, __LINE__)

struct uint3 {
    unsigned x, y, z;
};

struct dim3 {
    unsigned x, y, z;
    constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

// the running emulated thread's indices (the scheduler sets them before it resumes a thread, and the thread sets
// them again when it resumes after a barrier)
static uint3 threadIdx, blockIdx;
static dim3 blockDim, gridDim;

namespace simt {

constexpr size_t kStackBytes = 64 << 10;     // each emulated thread's stack, above a guard page
constexpr unsigned kMaxThreads = 1024;       // threads per block on every GPU the backend targets

// An emulated thread: a fiber on its own stack. A fiber is made once (makecontext, entered with setcontext) and
// then kept: between blocks it waits at its park point, and a block starts the kernel in it from there. Switches
// between the scheduler and the fibers are _setjmp/_longjmp (no system call, unlike swapcontext, which saves and
// restores the signal mask every time).
struct Thread {
    ucontext_t context;                      // how the fiber is first entered
    jmp_buf jump;                            // where it resumes: its park point, or the barrier it waits at
    uint3 index;
    unsigned barriers;                       // barriers passed in this block
    int site;                                // the __syncthreads() it waits at (__COUNTER__)
    const char* file;
    int line;
    bool parked;                             // waiting for a block to start the kernel
    bool done;                               // returned from the kernel in this block
};

static std::mutex launch_lock;               // one launch at a time: the shared memory and the fibers are global
static std::vector<Thread> threads;
static char* stacks = nullptr;               // threads.size() slots of guard page + stack
static size_t slot_bytes = 0;
static jmp_buf scheduler;                    // where a fiber hands control back to
static Thread* current = nullptr;
static void (*kernel_entry)(const void*) = nullptr;
static const void* kernel_args = nullptr;
static std::vector<std::pair<char*, size_t>> shared_regions;
static int order_mode = 0;                   // 0 increasing, 1 decreasing, 2 pseudo-random
static unsigned order_seed = 1;
static thread_local char error_text[1024];   // why the last launch of this OS thread failed

inline int fail(const char* format, ...) __attribute__((format(printf, 1, 2)));
inline int fail(const char* format, ...) {
    va_list args;
    va_start(args, format);
    vsnprintf(error_text, sizeof error_text, format, args);
    va_end(args);
    return 1;
}

// __syncthreads(): note where this thread waits, hand control back to the block's scheduler, and when it is
// resumed (every thread of the block having arrived) carry on as this thread again
static __attribute__((noinline)) void barrier(int site, const char* file, int line) {
    Thread* self = current;
    self->site = site;
    self->file = file;
    self->line = line;
    ++self->barriers;
    if (!_setjmp(self->jump)) _longjmp(scheduler, 1);
    threadIdx = self->index;
}

// the body of every fiber: park, run the kernel as the thread the scheduler set up, park again
static void fiber_main() {
    Thread* self = current;
    for (;;) {
        self->parked = true;
        if (!_setjmp(self->jump)) _longjmp(scheduler, 1);
        self->parked = false;
        threadIdx = self->index;
        kernel_entry(kernel_args);
        self->done = true;
    }
}

// continue `thread` until it waits at a barrier, returns from the kernel or parks
static __attribute__((noinline)) void resume(Thread* thread) {
    current = thread;
    threadIdx = thread->index;
    if (!_setjmp(scheduler)) _longjmp(thread->jump, 1);
    current = nullptr;
}

// make the fiber of threads[t] and let it run to its park point
static __attribute__((noinline)) void start_fiber(unsigned t) {
    Thread& thread = threads[t];
    getcontext(&thread.context);
    thread.context.uc_stack.ss_sp = stacks + t * slot_bytes + (slot_bytes - kStackBytes);
    thread.context.uc_stack.ss_size = kStackBytes;
    thread.context.uc_link = nullptr;        // fiber_main never returns
    makecontext(&thread.context, fiber_main, 0);
    current = &thread;
    if (!_setjmp(scheduler)) setcontext(&thread.context);
    current = nullptr;
}

// fibers for `count` threads (stacks allocated once, grown when a launch needs more)
inline void reserve(size_t count) {
    if (count <= threads.size()) return;
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    if (stacks) munmap(stacks, slot_bytes * threads.size());
    slot_bytes = page + kStackBytes;
    void* memory = mmap(nullptr, slot_bytes * count, PROT_READ | PROT_WRITE,
                        MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (memory == MAP_FAILED) {
        fprintf(stderr, "simt_host.h: cannot map %zu thread stacks\n", count);
        abort();
    }
    stacks = static_cast<char*>(memory);
    for (size_t t = 0; t < count; ++t) mprotect(stacks + t * slot_bytes, page, PROT_NONE);   // guard pages
    threads.assign(count, Thread());         // every fiber is made afresh (parked == false)
}

// the order in which a phase resumes the `count` threads of a block
inline void phase_order(std::vector<unsigned>& order, unsigned count, unsigned long long block, unsigned phase) {
    order.resize(count);
    for (unsigned t = 0; t < count; ++t) order[t] = t;
    if (order_mode == 1) std::reverse(order.begin(), order.end());
    if (order_mode == 2) {
        unsigned long long state = (order_seed + 0x9E3779B97F4A7C15ULL * (block + 1) + 0xBF58476D1CE4E5B9ULL * phase) *
                                       6364136223846793005ULL + 1442695040888963407ULL;
        for (unsigned i = count; i > 1; --i) {
            state = state * 6364136223846793005ULL + 1442695040888963407ULL;
            std::swap(order[i - 1], order[(state >> 33) % i]);
        }
    }
}

inline void format_index(char* text, size_t size, const uint3& i) { snprintf(text, size, "(%u,%u,%u)", i.x, i.y, i.z); }

// run one block to completion; 0, or 1 with error_text set
inline int run_block(unsigned count, unsigned long long block_number) {
    for (const auto& region : shared_regions) memset(region.first, 0xff, region.second);
    for (unsigned t = 0; t < count; ++t) {
        Thread& thread = threads[t];
        if (!thread.parked) start_fiber(t);
        thread.index = uint3{t % blockDim.x, (t / blockDim.x) % blockDim.y, t / (blockDim.x * blockDim.y)};
        thread.barriers = 0;
        thread.done = false;
    }
    std::vector<unsigned> order;
    for (unsigned phase = 0;; ++phase) {
        phase_order(order, count, block_number, phase);
        for (unsigned t : order) resume(&threads[t]);
        unsigned finished = 0, first_waiting = count;
        for (unsigned t = 0; t < count; ++t) {
            if (threads[t].done) ++finished;
            else if (first_waiting == count) first_waiting = t;
        }
        if (finished == count) return 0;
        // a divergent barrier: the threads waiting at one are abandoned (made afresh by the next launch)
        char a[48], b[48], where[48];
        snprintf(where, sizeof where, "(%u,%u,%u)", blockIdx.x, blockIdx.y, blockIdx.z);
        const Thread& waiting = threads[first_waiting];
        format_index(a, sizeof a, waiting.index);
        if (finished) {
            const Thread* returned = &threads[0];
            while (!returned->done) ++returned;
            format_index(b, sizeof b, returned->index);
            return fail("divergent __syncthreads() in block %s: thread %s waits at %s:%d (barrier %u) while thread "
                        "%s has returned", where, a, waiting.file, waiting.line, waiting.barriers, b);
        }
        for (unsigned t = 0; t < count; ++t)
            if (threads[t].site != waiting.site) {
                format_index(b, sizeof b, threads[t].index);
                return fail("divergent __syncthreads() in block %s: thread %s waits at %s:%d, thread %s at %s:%d",
                            where, a, waiting.file, waiting.line, b, threads[t].file, threads[t].line);
            }
    }
}

// a launch's grid and block (x, y, z each) within CUDA's limits and the kernel's __launch_bounds__
inline int check_geometry(const unsigned* geometry, unsigned bound) {
    const dim3 grid(geometry[0], geometry[1], geometry[2]), block(geometry[3], geometry[4], geometry[5]);
    const unsigned long long count = 1ULL * block.x * block.y * block.z;
    if (!grid.x || !grid.y || !grid.z || !count || grid.y > 65535 || grid.z > 65535 || block.x > 1024 ||
        block.y > 1024 || block.z > 64 || count > kMaxThreads)
        return fail("invalid launch geometry grid (%u,%u,%u) block (%u,%u,%u)", grid.x, grid.y, grid.z, block.x,
                    block.y, block.z);
    if (count > bound)
        return fail("block (%u,%u,%u) is more threads than __launch_bounds__(%u)", block.x, block.y, block.z, bound);
    return 0;
}

// run `entry(args)` (a kernel called with its parameters) over the grid, block after block
inline int launch(const unsigned* geometry, unsigned bound, void (*entry)(const void*), const void* args) {
    if (check_geometry(geometry, bound)) return 1;
    const dim3 grid(geometry[0], geometry[1], geometry[2]), block(geometry[3], geometry[4], geometry[5]);
    const unsigned long long count = 1ULL * block.x * block.y * block.z;
    if (1ULL * grid.x * grid.y * grid.z > (1ULL << 24))
        return fail("grid (%u,%u,%u): more blocks than the emulator runs", grid.x, grid.y, grid.z);
    std::lock_guard<std::mutex> guard(launch_lock);
    reserve(count);
    gridDim = grid;
    blockDim = block;
    kernel_entry = entry;
    kernel_args = args;
    std::vector<unsigned> blocks;                // blocks run one after another, in the chosen order too
    phase_order(blocks, grid.x * grid.y * grid.z, ~0ULL, 0);
    for (unsigned number : blocks) {
        blockIdx = uint3{number % grid.x, (number / grid.x) % grid.y, number / (grid.x * grid.y)};
        if (run_block(static_cast<unsigned>(count), number)) return 1;
    }
    return 0;
}

// the items [begin, end) of a grid-stride loop in the order host_set_order chose
inline std::vector<unsigned> item_order(unsigned begin, unsigned end) {
    std::vector<unsigned> items;
    phase_order(items, end - begin, 0, 0);
    for (unsigned& item : items) item += begin;
    return items;
}

}  // namespace simt

extern "C" void host_set_order(int mode, unsigned seed) {
    simt::order_mode = mode;
    simt::order_seed = seed;
}

extern "C" const char* host_error() { return simt::error_text; }

// the library's __shared__ variables, as offsets from its load address and sizes in bytes
extern "C" void host_set_shared(const unsigned long long* offsets, const unsigned long long* sizes, unsigned count) {
    Dl_info info;
    dladdr(reinterpret_cast<void*>(&host_set_shared), &info);
    simt::shared_regions.clear();
    for (unsigned i = 0; i < count; ++i)
        simt::shared_regions.emplace_back(static_cast<char*>(info.dli_fbase) + offsets[i], sizes[i]);
}
