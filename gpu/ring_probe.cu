// The ring probe: this machine's floor for gpusnap's split data path, without gpusnap.
//
// It runs the data path the split path runs, with nothing of gpusnap in it: GPU memory to a
// pinned host ring to tmpfs files and back, with the same shape (ring slots, copy streams,
// writer threads with one file each). Its times are the data part of issue 14's floor.
//
// Dump direction: --gib GiB on the device, filled by a kernel with a non-constant pattern (a
// hash of the word index). Chunk k (one slot, --slot-mib MiB) is copied device->host into a
// free slot of the pinned ring (cudaHostAlloc, --slots slots) on stream k % --streams, with an
// event recorded after it; the main thread waits for the oldest copy's event and hands its slot
// to the writer threads (one shared queue). A writer pwrites the slot to the end of its own file
// in --dir (created fresh: O_CREAT|O_TRUNC, mode 0600) and gives the slot back. write_s runs
// from the first copy to the last writer done (files closed).
// Restore direction: the device is cleared (cudaMemset 0). Reader threads, one per file, take
// free slots and pread their file's chunks into them; the main thread copies each loaded slot
// host->device to its chunk's place (stream k % --streams, event per slot) and gives a slot back
// once its copy's event has completed. read_s runs from the start to the last copy done.
// Verification (after each restore): a kernel compares EVERY word of the device with the
// pattern and counts mismatches (verified = 0 mismatches), and the host also reads back 64
// sampled words (first, last, spread between) and compares them with the pattern it computes
// itself. As a self-test of the check, the cleared device must show mismatches before the
// restore.
//
// The pinned ring, streams and events are set up once, outside the timed parts (gpusnap's own
// set-up is what the floor leaves out). --repeat N runs both directions N times with fresh
// files (removed after each run unless --keep): on a fresh VM the first run pays the guest's
// first touch of memory, so the floor is the last run.
//
// Output: human-readable lines on stderr; one JSON line per run on stdout:
//   {"kind": "ring-probe", "gib", "bytes", "slots", "slot_mib", "streams", "threads", "run",
//    "runs", "write_s", "write_gbps", "read_s", "read_gbps", "verified", "mismatches", "verify",
//    "dir", "device", "mem_available_gib_before", "mem_available_gib_after"}
// GB = 1e9 bytes. Exit status: 0; 1 when a CUDA call or a system call fails (the message names
// it); 2 for bad arguments; 3 when a run's data did not verify (its JSON line is printed first).
//
// Build: nvcc -O2 -arch=sm_90 -o /tmp/gpusnap-bin/ring_probe gpu/ring_probe.cu (gpu/build.sh).
// Host test without a GPU: g++ -O2 -x c++ -DRING_PROBE_HOST_MOCK -pthread -o ring_probe_mock
// gpu/ring_probe.cu replaces the device with host memory and synchronous copies (same
// threads, queues, files and checks; the rates mean nothing).
// Usage: ring_probe [--gib 16] [--slots 16] [--slot-mib 32] [--streams 4] [--threads 16]
//                   [--dir /dev/shm/gpusnap-ring-probe] [--repeat 1] [--keep] [--device 0]

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#ifndef RING_PROBE_HOST_MOCK
#include <cuda_runtime.h>
#define HD __host__ __device__
#else
#define HD
#endif

typedef unsigned long long u64;

// ---------------------------------------------------------------- errors

static void die_sys(const char *call, const std::string &what, int err) {
  fprintf(stderr, "ring_probe: %s(%s) failed: %s\n", call, what.c_str(), strerror(err));
  fflush(stderr);
  _exit(1);  // from any thread: no teardown while other threads use the device or the files
}

static void die_msg(const std::string &msg) {
  fprintf(stderr, "ring_probe: %s\n", msg.c_str());
  fflush(stderr);
  _exit(1);
}

// ---------------------------------------------------------------- the pattern

// splitmix64 of the word index and the run's seed: every word differs, and a word restored at
// the wrong place or from the wrong run does not match.
HD static inline u64 pattern(u64 i, u64 seed) {
  u64 z = i + seed * 0x9E3779B97F4A7C15ull + 0x632BE59BD9B4E019ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// ---------------------------------------------------------------- the device
//
// Everything the pipeline does with the GPU goes through these few functions; the host mock
// (RING_PROBE_HOST_MOCK) implements them with host memory and synchronous copies.

#ifndef RING_PROBE_HOST_MOCK

#define CK(x)                                                                              \
  do {                                                                                     \
    cudaError_t e_ = (x);                                                                  \
    if (e_ != cudaSuccess)                                                                 \
      die_msg(std::string(#x) + " failed: " + cudaGetErrorName(e_) + " (" +                \
              cudaGetErrorString(e_) + ")");                                               \
  } while (0)

__global__ void fill_kernel(u64 *p, u64 n, u64 seed) {
  for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
    p[i] = pattern(i, seed);
}

__global__ void check_kernel(const u64 *p, u64 n, u64 seed, u64 *bad) {
  u64 mine = 0;
  for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
    mine += p[i] != pattern(i, seed);
  if (mine) atomicAdd(bad, mine);
}

struct Gpu {
  u64 *dev = nullptr;
  u64 words = 0;
  u64 *d_bad = nullptr;
  std::vector<cudaStream_t> streams;
  std::vector<cudaEvent_t> events;  // one per ring slot
  std::string name;

  void init(int device, size_t bytes, int nstreams, int nslots) {
    CK(cudaSetDevice(device));
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, device));
    name = prop.name;
    words = bytes / 8;
    CK(cudaMalloc((void **)&dev, bytes));
    CK(cudaMalloc((void **)&d_bad, sizeof(u64)));
    streams.resize(nstreams);
    for (auto &s : streams) CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    events.resize(nslots);
    for (auto &e : events) CK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  }
  void *host_alloc(size_t bytes) {
    void *p = nullptr;
    CK(cudaHostAlloc(&p, bytes, cudaHostAllocDefault));
    return p;
  }
  void fill(u64 seed) {
    fill_kernel<<<4096, 256>>>(dev, words, seed);
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
  }
  void clear() {
    CK(cudaMemset(dev, 0, words * 8));
    CK(cudaDeviceSynchronize());
  }
  u64 mismatches(u64 seed) {
    CK(cudaMemset(d_bad, 0, sizeof(u64)));
    check_kernel<<<4096, 256>>>(dev, words, seed, d_bad);
    CK(cudaGetLastError());
    u64 bad = 0;
    CK(cudaMemcpy(&bad, d_bad, sizeof bad, cudaMemcpyDeviceToHost));
    return bad;
  }
  u64 word(u64 i) {
    u64 v = 0;
    CK(cudaMemcpy(&v, dev + i, sizeof v, cudaMemcpyDeviceToHost));
    return v;
  }
  void d2h(void *host, size_t off, size_t len, int stream) {
    CK(cudaMemcpyAsync(host, (char *)dev + off, len, cudaMemcpyDeviceToHost, streams[stream]));
  }
  void h2d(size_t off, const void *host, size_t len, int stream) {
    CK(cudaMemcpyAsync((char *)dev + off, host, len, cudaMemcpyHostToDevice, streams[stream]));
  }
  void record(int slot, int stream) { CK(cudaEventRecord(events[slot], streams[stream])); }
  void wait(int slot) { CK(cudaEventSynchronize(events[slot])); }
  bool done(int slot) {
    cudaError_t e = cudaEventQuery(events[slot]);
    if (e == cudaErrorNotReady) return false;
    CK(e);
    return true;
  }
  void sync_all() { CK(cudaDeviceSynchronize()); }
};

#else  // RING_PROBE_HOST_MOCK: host memory, synchronous copies

struct Gpu {
  u64 *dev = nullptr;
  u64 words = 0;
  std::string name = "host mock (no GPU)";

  void init(int, size_t bytes, int, int) {
    words = bytes / 8;
    dev = (u64 *)malloc(bytes ? bytes : 8);
    if (!dev) die_sys("malloc", "device stand-in", errno);
  }
  void *host_alloc(size_t bytes) {
    void *p = malloc(bytes);
    if (!p) die_sys("malloc", "ring", errno);
    return p;
  }
  void fill(u64 seed) {
    for (u64 i = 0; i < words; i++) dev[i] = pattern(i, seed);
  }
  void clear() { memset(dev, 0, words * 8); }
  u64 mismatches(u64 seed) {
    u64 bad = 0;
    for (u64 i = 0; i < words; i++) bad += dev[i] != pattern(i, seed);
    return bad;
  }
  u64 word(u64 i) { return dev[i]; }
  void d2h(void *host, size_t off, size_t len, int) { memcpy(host, (char *)dev + off, len); }
  void h2d(size_t off, const void *host, size_t len, int) { memcpy((char *)dev + off, host, len); }
  void record(int, int) {}
  void wait(int) {}
  bool done(int) { return true; }
  void sync_all() {}
};

#endif

// ---------------------------------------------------------------- a blocking queue

template <typename T>
class Queue {
 public:
  void push(T v) {
    {
      std::lock_guard<std::mutex> g(m_);
      q_.push_back(v);
    }
    cv_.notify_one();
  }
  // Blocks until an item is there (true) or the queue is closed and empty (false).
  bool pop(T &out) {
    std::unique_lock<std::mutex> g(m_);
    cv_.wait(g, [&] { return !q_.empty() || closed_; });
    if (q_.empty()) return false;
    out = q_.front();
    q_.pop_front();
    return true;
  }
  bool try_pop(T &out) {
    std::lock_guard<std::mutex> g(m_);
    if (q_.empty()) return false;
    out = q_.front();
    q_.pop_front();
    return true;
  }
  void close() {
    {
      std::lock_guard<std::mutex> g(m_);
      closed_ = true;
    }
    cv_.notify_all();
  }
  void reset() {
    std::lock_guard<std::mutex> g(m_);
    q_.clear();
    closed_ = false;
  }

 private:
  std::mutex m_;
  std::condition_variable cv_;
  std::deque<T> q_;
  bool closed_ = false;
};

// ---------------------------------------------------------------- files

static void write_all(int fd, const std::string &name, const char *p, size_t len, off_t off) {
  while (len > 0) {
    ssize_t n = pwrite(fd, p, len, off);
    if (n < 0) {
      if (errno == EINTR) continue;
      die_sys("pwrite", name, errno);
    }
    if (n == 0) die_msg("pwrite(" + name + ") wrote nothing");
    p += n;
    len -= (size_t)n;
    off += n;
  }
}

static void read_all(int fd, const std::string &name, char *p, size_t len, off_t off) {
  while (len > 0) {
    ssize_t n = pread(fd, p, len, off);
    if (n < 0) {
      if (errno == EINTR) continue;
      die_sys("pread", name, errno);
    }
    if (n == 0) die_msg("pread(" + name + "): unexpected end of file");
    p += n;
    len -= (size_t)n;
    off += n;
  }
}

static void close_or_die(int fd, const std::string &name) {
  if (close(fd) != 0 && errno != EINTR) die_sys("close", name, errno);
}

static double mono_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

static double mem_available_gib() {
  FILE *f = fopen("/proc/meminfo", "r");
  if (!f) return -1;
  char line[256];
  double v = -1;
  while (fgets(line, sizeof line, f)) {
    unsigned long long kib;
    if (sscanf(line, "MemAvailable: %llu kB", &kib) == 1) {
      v = kib / 1048576.0;
      break;
    }
  }
  fclose(f);
  return v;
}

// ---------------------------------------------------------------- the probe

struct Opts {
  double gib = 16;
  int slots = 16;
  long slot_mib = 32;
  int streams = 4;
  int threads = 16;
  std::string dir = "/dev/shm/gpusnap-ring-probe";
  int repeat = 1;
  bool keep = false;
  int device = 0;
};

struct Loc {
  int file = -1;
  off_t off = 0;
};

struct Item {
  int slot;
  u64 chunk;
};

struct Probe {
  Opts o;
  Gpu gpu;
  size_t bytes = 0, slot_bytes = 0;
  u64 nchunks = 0;
  char *ring = nullptr;
  std::vector<std::string> files;
  std::vector<Loc> loc;  // where each chunk went (written by the writers, one entry each)
  Queue<int> free_q;
  Queue<Item> work_q;  // dump: copied slots for the writers; restore: loaded slots for the GPU

  size_t chunk_len(u64 k) const {
    size_t off = (size_t)k * slot_bytes;
    return bytes - off < slot_bytes ? bytes - off : slot_bytes;
  }
  char *slot_ptr(int s) const { return ring + (size_t)s * slot_bytes; }
  void refill_free() {
    free_q.reset();
    for (int s = 0; s < o.slots; s++) free_q.push(s);
  }

  void writer(int t) {
    const std::string &name = files[t];
    int fd = open(name.c_str(), O_CREAT | O_TRUNC | O_WRONLY | O_CLOEXEC, 0600);
    if (fd < 0) die_sys("open", name, errno);
    off_t off = 0;
    Item it;
    while (work_q.pop(it)) {
      size_t len = chunk_len(it.chunk);
      write_all(fd, name, slot_ptr(it.slot), len, off);
      loc[it.chunk].file = t;
      loc[it.chunk].off = off;
      off += (off_t)len;
      free_q.push(it.slot);
    }
    close_or_die(fd, name);
  }

  double dump() {
    refill_free();
    work_q.reset();
    loc.assign(nchunks, Loc());
    double t0 = mono_s();
    std::vector<std::thread> ws;
    for (int t = 0; t < o.threads; t++) ws.emplace_back(&Probe::writer, this, t);
    std::deque<Item> inflight;  // in issue order
    u64 k = 0;
    auto issue = [&](int slot) {
      int st = (int)(k % (u64)o.streams);
      gpu.d2h(slot_ptr(slot), (size_t)k * slot_bytes, chunk_len(k), st);
      gpu.record(slot, st);
      inflight.push_back(Item{slot, k});
      k++;
    };
    while (k < nchunks || !inflight.empty()) {
      int slot;
      while (k < nchunks && free_q.try_pop(slot)) issue(slot);
      if (!inflight.empty()) {
        // the oldest copy, then any others already done, to the writers
        gpu.wait(inflight.front().slot);
        work_q.push(inflight.front());
        inflight.pop_front();
        while (!inflight.empty() && gpu.done(inflight.front().slot)) {
          work_q.push(inflight.front());
          inflight.pop_front();
        }
      } else if (free_q.pop(slot)) {  // every slot is with the writers: wait for one
        issue(slot);
      }
    }
    work_q.close();
    for (auto &w : ws) w.join();
    double t1 = mono_s();
    for (u64 c = 0; c < nchunks; c++)
      if (loc[c].file < 0) die_msg("internal: chunk " + std::to_string(c) + " was never written");
    return t1 - t0;
  }

  void reader(int t, const std::vector<u64> *mine) {
    const std::string &name = files[t];
    int fd = open(name.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) die_sys("open", name, errno);
    for (u64 c : *mine) {
      int slot;
      if (!free_q.pop(slot)) die_msg("internal: free-slot queue closed");
      read_all(fd, name, slot_ptr(slot), chunk_len(c), loc[c].off);
      work_q.push(Item{slot, c});
    }
    close_or_die(fd, name);
  }

  double restore() {
    // each reader reads its own file front to back (writers appended in pop order)
    std::vector<std::vector<u64>> lists(o.threads);
    for (u64 c = 0; c < nchunks; c++) lists[loc[c].file].push_back(c);
    for (auto &l : lists)
      std::sort(l.begin(), l.end(), [&](u64 a, u64 b) { return loc[a].off < loc[b].off; });
    refill_free();
    work_q.reset();
    double t0 = mono_s();
    std::vector<std::thread> rs;
    for (int t = 0; t < o.threads; t++) rs.emplace_back(&Probe::reader, this, t, &lists[t]);
    std::deque<Item> inflight;
    u64 issued = 0;
    auto issue = [&](const Item &it) {
      int st = (int)(it.chunk % (u64)o.streams);
      gpu.h2d((size_t)it.chunk * slot_bytes, slot_ptr(it.slot), chunk_len(it.chunk), st);
      gpu.record(it.slot, st);
      inflight.push_back(it);
      issued++;
    };
    auto release_done = [&]() {
      while (!inflight.empty() && gpu.done(inflight.front().slot)) {
        free_q.push(inflight.front().slot);
        inflight.pop_front();
      }
    };
    while (issued < nchunks) {
      Item it;
      if (work_q.try_pop(it)) {
        issue(it);
        release_done();
      } else if (!inflight.empty()) {
        gpu.wait(inflight.front().slot);
        free_q.push(inflight.front().slot);
        inflight.pop_front();
      } else if (work_q.pop(it)) {  // nothing loaded, nothing in flight: wait for a reader
        issue(it);
      }
    }
    while (!inflight.empty()) {
      gpu.wait(inflight.front().slot);
      inflight.pop_front();
    }
    gpu.sync_all();
    for (auto &r : rs) r.join();
    return mono_s() - t0;
  }
};

// ---------------------------------------------------------------- main

static std::string json_str(const std::string &s) {
  std::string o = "\"";
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') {
      o += '\\';
      o += (char)c;
    } else if (c < 0x20) {
      char b[8];
      snprintf(b, sizeof b, "\\u%04x", c);
      o += b;
    } else {
      o += (char)c;
    }
  }
  return o + "\"";
}

static void usage(const char *argv0) {
  fprintf(stderr,
          "usage: %s [--gib 16] [--slots 16] [--slot-mib 32] [--streams 4] [--threads 16]\n"
          "          [--dir /dev/shm/gpusnap-ring-probe] [--repeat 1] [--keep] [--device 0]\n",
          argv0);
}

static long parse_long(const char *s, const char *opt) {
  char *end = nullptr;
  errno = 0;
  long v = strtol(s, &end, 10);
  if (errno || !end || *end || end == s) {
    fprintf(stderr, "ring_probe: %s: not an integer: %s\n", opt, s);
    exit(2);
  }
  return v;
}

int main(int argc, char **argv) {
  Opts o;
  for (int i = 1; i < argc; i++) {
    std::string a = argv[i];
    bool has = i + 1 < argc;
    if (a == "--keep") {
      o.keep = true;
    } else if (a == "-h" || a == "--help") {
      usage(argv[0]);
      return 0;
    } else if (has && a == "--gib") {
      char *end = nullptr;
      o.gib = strtod(argv[++i], &end);
      if (!end || *end) {
        fprintf(stderr, "ring_probe: --gib: not a number: %s\n", argv[i]);
        return 2;
      }
    } else if (has && a == "--slots") {
      o.slots = (int)parse_long(argv[++i], "--slots");
    } else if (has && a == "--slot-mib") {
      o.slot_mib = parse_long(argv[++i], "--slot-mib");
    } else if (has && a == "--streams") {
      o.streams = (int)parse_long(argv[++i], "--streams");
    } else if (has && a == "--threads") {
      o.threads = (int)parse_long(argv[++i], "--threads");
    } else if (has && a == "--repeat") {
      o.repeat = (int)parse_long(argv[++i], "--repeat");
    } else if (has && a == "--device") {
      o.device = (int)parse_long(argv[++i], "--device");
    } else if (has && a == "--dir") {
      o.dir = argv[++i];
    } else {
      fprintf(stderr, "ring_probe: unknown or incomplete argument %s\n", a.c_str());
      usage(argv[0]);
      return 2;
    }
  }
  if (!(o.gib > 0) || o.slots < 1 || o.slot_mib < 1 || o.slot_mib > 1024 || o.streams < 1 ||
      o.threads < 1 || o.threads > 1024 || o.repeat < 1 || o.dir.empty()) {
    fprintf(stderr, "ring_probe: bad arguments (need --gib > 0, --slots >= 1, 1 <= --slot-mib <= "
                    "1024, --streams >= 1, 1 <= --threads <= 1024, --repeat >= 1, --dir)\n");
    return 2;
  }

  Probe p;
  p.o = o;
  p.slot_bytes = (size_t)o.slot_mib << 20;
  p.bytes = (size_t)(o.gib * 1073741824.0) / 8 * 8;
  if (p.bytes == 0) {
    fprintf(stderr, "ring_probe: --gib %g is less than one word\n", o.gib);
    return 2;
  }
  p.nchunks = (p.bytes + p.slot_bytes - 1) / p.slot_bytes;

  double s0 = mono_s();
  p.gpu.init(o.device, p.bytes, o.streams, o.slots);
  p.ring = (char *)p.gpu.host_alloc((size_t)o.slots * p.slot_bytes);
  memset(p.ring, 0, (size_t)o.slots * p.slot_bytes);  // touch the ring once, untimed
  fprintf(stderr,
          "ring_probe: device %s, %.3f GiB in %llu chunks; ring %d x %ld MiB pinned, %d streams, "
          "%d threads, dir %s, %d run(s); set-up %.2f s\n",
          p.gpu.name.c_str(), p.bytes / 1073741824.0, (u64)p.nchunks, o.slots, o.slot_mib,
          o.streams, o.threads, o.dir.c_str(), o.repeat, mono_s() - s0);

  bool made_dir = false;
  if (mkdir(o.dir.c_str(), 0700) == 0) {
    made_dir = true;
  } else if (errno != EEXIST) {
    die_sys("mkdir", o.dir, errno);
  }
  p.files.resize(o.threads);
  for (int t = 0; t < o.threads; t++) {
    char b[32];
    snprintf(b, sizeof b, "/ring-probe-%03d.bin", t);
    p.files[t] = o.dir + b;
  }

  const int nsample = 64;
  const u64 words = p.bytes / 8;
  int status = 0;
  for (int run = 1; run <= o.repeat; run++) {
    u64 seed = 0x5eed0000ull + (u64)run;
    p.gpu.fill(seed);
    u64 bad_fill = p.gpu.mismatches(seed);
    if (bad_fill != 0)
      die_msg("check kernel: " + std::to_string(bad_fill) + " mismatches right after the fill");
    double mem0 = mem_available_gib();

    double write_s = p.dump();
#ifdef RING_PROBE_HOST_MOCK
    if (getenv("RING_PROBE_MOCK_CORRUPT")) {  // harness test: one flipped byte must be caught
      int fd = open(p.files[0].c_str(), O_RDWR);
      char c = 0;
      if (fd < 0 || pread(fd, &c, 1, 8) != 1) die_sys("corrupt", p.files[0], errno);
      c ^= 0x40;
      if (pwrite(fd, &c, 1, 8) != 1) die_sys("corrupt", p.files[0], errno);
      close(fd);
    }
#endif
    p.gpu.clear();
    u64 cleared = p.gpu.mismatches(seed);
    if (cleared == 0) die_msg("check kernel: the cleared device matched the pattern");
    double read_s = p.restore();

    u64 bad = p.gpu.mismatches(seed);
    int bad_sample = 0;
    for (int j = 0; j < nsample; j++) {
      u64 i = words == 1 ? 0 : (u64)j * (words - 1) / (nsample - 1);
      if (p.gpu.word(i) != pattern(i, seed)) bad_sample++;
    }
    bool verified = bad == 0 && bad_sample == 0;
    double mem1 = mem_available_gib();
    if (!o.keep) {
      for (auto &f : p.files)
        if (unlink(f.c_str()) != 0) die_sys("unlink", f, errno);
    }
    double wg = p.bytes / write_s / 1e9, rg = p.bytes / read_s / 1e9;
    fprintf(stderr,
            "ring_probe: run %d/%d: write %.3f s (%.2f GB/s), read %.3f s (%.2f GB/s), %s "
            "(%llu of %llu words wrong on the device, %d of %d sampled on the host; %llu wrong "
            "before the restore)\n",
            run, o.repeat, write_s, wg, read_s, rg, verified ? "verified" : "NOT VERIFIED", bad,
            words, bad_sample, nsample, cleared);
    printf("{\"kind\": \"ring-probe\", \"gib\": %g, \"bytes\": %zu, \"slots\": %d, \"slot_mib\": %ld, "
           "\"streams\": %d, \"threads\": %d, \"run\": %d, \"runs\": %d, \"write_s\": %.4f, "
           "\"write_gbps\": %.2f, \"read_s\": %.4f, \"read_gbps\": %.2f, \"verified\": %s, "
           "\"mismatches\": %llu, \"sample_mismatches\": %d, "
           "\"verify\": \"every word compared on the device, and %d sampled words on the host\", "
           "\"dir\": %s, \"device\": %s, \"mem_available_gib_before\": %.1f, "
           "\"mem_available_gib_after\": %.1f%s}\n",
           o.gib, p.bytes, o.slots, o.slot_mib, o.streams, o.threads, run, o.repeat, write_s, wg,
           read_s, rg, verified ? "true" : "false", bad, bad_sample, nsample,
           json_str(o.dir).c_str(), json_str(p.gpu.name).c_str(), mem0, mem1,
#ifdef RING_PROBE_HOST_MOCK
           ", \"mock\": true"
#else
           ""
#endif
    );
    fflush(stdout);
    if (!verified) {
      status = 3;
      break;
    }
  }
  if (made_dir && !o.keep && rmdir(o.dir.c_str()) != 0)
    fprintf(stderr, "ring_probe: rmdir(%s): %s (left in place)\n", o.dir.c_str(), strerror(errno));
  return status;
}
