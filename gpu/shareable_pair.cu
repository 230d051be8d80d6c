// A parent and an exec'd child sharing one device allocation through a POSIX-fd shareable handle
// (CUDA driver VMM API, no legacy IPC): the case gpusnap's agent does not serve itself.
//
// The parent cuMemCreate()s --mib MiB (default 256) with requestedHandleTypes =
// CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, maps it (cuMemAddressReserve, cuMemMap,
// cuMemSetAccess), fills it (word i = i % 9973, word 0 = 0: a counter), checks the checksum once,
// cuMemExportToShareableHandle()s it, then fork()s and exec()s itself as the child (CUDA is not
// fork-safe: the child only execs) with one end of a socketpair. The child gets the fd:
//   --mode scm    the parent sends it over the socket (SCM_RIGHTS) and closes its own copy once
//                 the child says it imported (--keep-fd: the parent keeps it open);
//   --mode pidfd  the parent keeps its fd open and sends only its number; the child takes it
//                 with pidfd_open(parent) + pidfd_getfd (PyTorch's way for expandable segments).
// The child cuMemImportFromShareableHandle()s it, cuMemAddressReserve, cuMemMap,
// cuMemSetAccess, releases the imported handle (the mapping holds the memory), closes its fd
// and acks; both then close the socket: after the hand-shake neither holds a socket, only the
// parent (pidfd mode, or --keep-fd) the exported fd.
// Every --interval-ms (100) the child adds 1 to word 0 (a one-thread kernel), both hash the rest
// (a kernel sums words 1..N-1 into a 64-bit total) and read word 0, and log
//   tick N counter C ok 0|1
// (ok: the sum equals the value computed on the host, and no CUDA call of the tick failed; a
// failed call is logged on an `error ...` line before it, and the loop goes on).
// Logs in --dir: producer.log (first line `pid P consumer C`), consumer.log (`pid P`), plus
// `ready ...`, `shared ...`, `imported ...` lines; the harness is gpu/shareable_ckpt.py.
//
// Usage: shareable_pair parent --dir DIR [--mode scm|pidfd] [--mib 256] [--interval-ms 100]
//                               [--keep-fd]
//        (the child is `shareable_pair child ...`, started by the parent)
// Build: nvcc -O2 -arch=sm_90 -o shareable_pair gpu/shareable_pair.cu -lcuda (gpu/build.sh)
// Host mock (no GPU; gpu/shareable_ckpt.py --mock): g++ -O2 -x c++ -DSHAREABLE_HOST_MOCK
//   gpu/shareable_pair.cu: a memfd stands in for the physical memory (export = dup, import =
//   mmap of the received fd), the kernels are loops; the fd passing is the real one.
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#ifndef SHAREABLE_HOST_MOCK
#include <cuda.h>
#include <cuda_runtime.h>
#endif

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SYS_pidfd_getfd
#define SYS_pidfd_getfd 438
#endif

typedef unsigned long long u64;
typedef unsigned int u32;

static int g_log = -1;
static int g_errors = 0;  // failed calls in the current tick

static void logf_(const char *fmt, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(buf, sizeof buf - 1, fmt, ap);
  va_end(ap);
  if (n < 0) return;
  if (n > (int)sizeof buf - 2) n = sizeof buf - 2;
  if (buf[n - 1] != '\n') buf[n++] = '\n';
  if (g_log >= 0) {
    ssize_t w = write(g_log, buf, n);  // O_APPEND: one line, one write
    (void)w;
  }
  fwrite(buf, 1, n, stdout);
  fflush(stdout);
}

static void die(const char *fmt, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  logf_("fatal %s", buf);
  exit(1);
}

// ------------------------------------------------------------------ device layer
#ifdef SHAREABLE_HOST_MOCK
typedef uintptr_t devptr;
typedef int mem_handle;  // the memfd

static int dev_init(void) { return 0; }

static int alloc_exportable(size_t want, size_t *size, mem_handle *h, devptr *ptr) {
  size_t g = 2 << 20;
  *size = (want + g - 1) / g * g;
  int fd = (int)syscall(SYS_memfd_create, "shareable-pair", 0);
  if (fd < 0 || ftruncate(fd, (off_t)*size) != 0) return errno;
  void *p = mmap(NULL, *size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) return errno;
  *h = fd;
  *ptr = (devptr)p;
  logf_("mock: memfd %d of %zu bytes stands in for the device memory", fd, *size);
  return 0;
}

static int export_fd(mem_handle h, int *fd) {
  *fd = dup(h);
  if (*fd < 0) return errno;
  close(h);  // like the driver's handle, the parent keeps only the mapping and the export
  return 0;
}

static int import_map(int fd, size_t size, devptr *ptr) {
  void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) return errno;
  *ptr = (devptr)p;
  return 0;
}

static void fill(devptr p, size_t n) {
  u32 *w = (u32 *)p;
  for (size_t i = 0; i < n; i++) w[i] = (u32)(i % 9973);
}

static int checksum(devptr p, size_t n, u64 *out) {
  volatile u32 *w = (volatile u32 *)p;
  u64 s = 0;
  for (size_t i = 1; i < n; i++) s += w[i];
  *out = s;
  return 0;
}

static int bump(devptr p) {
  __atomic_add_fetch((u32 *)p, 1, __ATOMIC_SEQ_CST);
  return 0;
}

static int read_counter(devptr p, u32 *c) {
  *c = __atomic_load_n((u32 *)p, __ATOMIC_SEQ_CST);
  return 0;
}

static const char *platform(void) { return "host-mock"; }
#else
typedef CUdeviceptr devptr;
typedef CUmemGenericAllocationHandle mem_handle;

static CUdevice g_dev;
static CUdeviceptr g_sum;  // 8 bytes of scratch for the checksum (cuMemAlloc, the driver's own)

static int drv(CUresult r, const char *what) {
  if (r == CUDA_SUCCESS) return 0;
  const char *name = "?";
  cuGetErrorName(r, &name);
  logf_("error %s %d %s", what, (int)r, name);
  g_errors++;
  return (int)r;
}

static int rt(cudaError_t r, const char *what) {
  if (r == cudaSuccess) return 0;
  logf_("error %s %d %s", what, (int)r, cudaGetErrorName(r));
  g_errors++;
  return (int)r;
}

__global__ void fill_kernel(u32 *p, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    p[i] = (u32)(i % 9973);
}

__global__ void sum_kernel(const u32 *p, size_t n, u64 *out) {
  u64 s = 0;
  for (size_t i = 1 + blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    s += p[i];
  for (int o = 16; o > 0; o >>= 1) s += __shfl_down_sync(0xffffffffu, s, o);
  if ((threadIdx.x & 31) == 0) atomicAdd(out, s);
}

__global__ void bump_kernel(u32 *p) { p[0] += 1; }

static int dev_init(void) {
  int e = 0;
  if ((e = rt(cudaSetDevice(0), "cudaSetDevice")) || (e = rt(cudaFree(0), "cudaFree(0)"))) return e;
  if ((e = drv(cuDeviceGet(&g_dev, 0), "cuDeviceGet"))) return e;
  int fd_ok = 0;
  drv(cuDeviceGetAttribute(&fd_ok, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
                           g_dev),
      "cuDeviceGetAttribute(POSIX_FD_SUPPORTED)");
  int vmm = 0;
  drv(cuDeviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, g_dev),
      "cuDeviceGetAttribute(VMM_SUPPORTED)");
  logf_("device 0: VMM supported %d, POSIX fd handles supported %d", vmm, fd_ok);
  if (!fd_ok) return 1;
  return drv(cuMemAlloc(&g_sum, 8), "cuMemAlloc(scratch)");
}

static void access_desc(CUmemAccessDesc *d) {
  memset(d, 0, sizeof *d);
  d->location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  d->location.id = g_dev;
  d->flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
}

static int alloc_exportable(size_t want, size_t *size, mem_handle *h, devptr *ptr) {
  CUmemAllocationProp prop;
  memset(&prop, 0, sizeof prop);
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = g_dev;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  size_t g = 0;
  int e;
  if ((e = drv(cuMemGetAllocationGranularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
               "cuMemGetAllocationGranularity")))
    return e;
  *size = (want + g - 1) / g * g;
  if ((e = drv(cuMemCreate(h, *size, &prop, 0), "cuMemCreate"))) return e;
  if ((e = drv(cuMemAddressReserve(ptr, *size, 0, 0, 0), "cuMemAddressReserve"))) return e;
  if ((e = drv(cuMemMap(*ptr, *size, 0, *h, 0), "cuMemMap"))) return e;
  CUmemAccessDesc d;
  access_desc(&d);
  if ((e = drv(cuMemSetAccess(*ptr, *size, &d, 1), "cuMemSetAccess"))) return e;
  logf_("cuMemCreate %zu bytes (granularity %zu), handle %#llx, mapped at %#llx", *size, g,
        (u64)*h, (u64)*ptr);
  return 0;
}

static int export_fd(mem_handle h, int *fd) {
  return drv(cuMemExportToShareableHandle((void *)fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                                          0),
             "cuMemExportToShareableHandle");
}

static int import_map(int fd, size_t size, devptr *ptr) {
  mem_handle h{};
  int e;
  if ((e = drv(cuMemImportFromShareableHandle(&h, (void *)(uintptr_t)fd,
                                              CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
               "cuMemImportFromShareableHandle")))
    return e;
  if ((e = drv(cuMemAddressReserve(ptr, size, 0, 0, 0), "cuMemAddressReserve"))) return e;
  if ((e = drv(cuMemMap(*ptr, size, 0, h, 0), "cuMemMap"))) return e;
  CUmemAccessDesc d;
  access_desc(&d);
  if ((e = drv(cuMemSetAccess(*ptr, size, &d, 1), "cuMemSetAccess"))) return e;
  drv(cuMemRelease(h), "cuMemRelease(imported)");  // the mapping holds the memory
  logf_("imported handle %#llx mapped at %#llx", (u64)h, (u64)*ptr);
  return 0;
}

static void fill(devptr p, size_t n) {
  fill_kernel<<<1024, 256>>>((u32 *)p, n);
  rt(cudaGetLastError(), "fill_kernel launch");
  rt(cudaMemset((void *)p, 0, 4), "cudaMemset(counter)");
  drv(cuCtxSynchronize(), "cuCtxSynchronize(fill)");
}

static int checksum(devptr p, size_t n, u64 *out) {
  int e;
  if ((e = drv(cuMemsetD8(g_sum, 0, 8), "cuMemsetD8(scratch)"))) return e;
  sum_kernel<<<1024, 256>>>((const u32 *)p, n, (u64 *)g_sum);
  if ((e = rt(cudaGetLastError(), "sum_kernel launch"))) return e;
  if ((e = drv(cuCtxSynchronize(), "cuCtxSynchronize(sum)"))) return e;
  return drv(cuMemcpyDtoH(out, g_sum, 8), "cuMemcpyDtoH(sum)");
}

static int bump(devptr p) {
  bump_kernel<<<1, 1>>>((u32 *)p);
  int e = rt(cudaGetLastError(), "bump_kernel launch");
  return e ? e : drv(cuCtxSynchronize(), "cuCtxSynchronize(bump)");
}

static int read_counter(devptr p, u32 *c) { return drv(cuMemcpyDtoH(c, p, 4), "cuMemcpyDtoH(counter)"); }

static const char *platform(void) { return "cuda"; }
#endif

// ------------------------------------------------------------------ fd passing
struct Msg {
  char magic[8];  // "shpair1"
  int mode;       // 0 scm, 1 pidfd
  int parent_pid;
  int remote_fd;  // the parent's fd number (pidfd mode)
  int pad;
  u64 size;
};

static int send_msg(int sock, const Msg *m, int fd) {
  struct iovec iov = {(void *)m, sizeof *m};
  struct msghdr mh;
  memset(&mh, 0, sizeof mh);
  mh.msg_iov = &iov;
  mh.msg_iovlen = 1;
  union {
    char buf[CMSG_SPACE(sizeof(int))];
    struct cmsghdr align;
  } u;
  if (fd >= 0) {
    memset(&u, 0, sizeof u);
    mh.msg_control = u.buf;
    mh.msg_controllen = sizeof u.buf;
    struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(c), &fd, sizeof fd);
  }
  ssize_t n;
  do n = sendmsg(sock, &mh, MSG_NOSIGNAL); while (n < 0 && errno == EINTR);
  return n == (ssize_t)sizeof *m ? 0 : -1;
}

static int recv_msg(int sock, Msg *m, int *fd) {
  struct iovec iov = {m, sizeof *m};
  struct msghdr mh;
  memset(&mh, 0, sizeof mh);
  mh.msg_iov = &iov;
  mh.msg_iovlen = 1;
  union {
    char buf[CMSG_SPACE(sizeof(int))];
    struct cmsghdr align;
  } u;
  mh.msg_control = u.buf;
  mh.msg_controllen = sizeof u.buf;
  ssize_t n;
  do n = recvmsg(sock, &mh, MSG_CMSG_CLOEXEC | MSG_WAITALL); while (n < 0 && errno == EINTR);
  if (n != (ssize_t)sizeof *m || memcmp(m->magic, "shpair1", 8) != 0) return -1;
  *fd = -1;
  for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c))
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS)
      memcpy(fd, CMSG_DATA(c), sizeof(int));
  return 0;
}

static void set_timeout(int sock, int secs) {
  struct timeval tv = {secs, 0};
  setsockopt(sock, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  setsockopt(sock, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
}

// ------------------------------------------------------------------ the two sides
struct Args {
  const char *role = nullptr, *dir = nullptr;
  int mode = 0;  // 0 scm, 1 pidfd
  size_t mib = 256;
  int interval_ms = 100;
  int keep_fd = 0;
  int sock = -1;
};

static void open_log(const char *dir, const char *name) {
  char path[4096];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  g_log = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (g_log < 0) {
    fprintf(stderr, "cannot open %s: %s\n", path, strerror(errno));
    exit(1);
  }
}

static u64 expected_sum(size_t n) {
  // sum of i % 9973 over i in 1..n-1 (word 0 is the counter)
  u64 q = n / 9973, r = n % 9973;
  return q * (9973ull * 9972ull / 2) + (r ? (r - 1) * r / 2 : 0);
}

static void sleep_until(struct timespec *next, int interval_ms) {
  next->tv_nsec += (long)interval_ms * 1000000L;
  while (next->tv_nsec >= 1000000000L) {
    next->tv_nsec -= 1000000000L;
    next->tv_sec++;
  }
  struct timespec now;
  clock_gettime(CLOCK_MONOTONIC, &now);
  if (now.tv_sec > next->tv_sec + 1) *next = now;  // after a long stop (a dump): no burst
  while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, next, NULL) == EINTR) {
  }
}

static void tick_loop(devptr p, size_t n, int bumps, int interval_ms) {
  const u64 want = expected_sum(n);
  struct timespec next;
  clock_gettime(CLOCK_MONOTONIC, &next);
  for (u64 tick = 0;; tick++) {
    g_errors = 0;
    if (bumps) bump(p);
    u64 s = 0;
    u32 c = 0;
    int e = checksum(p, n, &s);
    e |= read_counter(p, &c);
    int ok = !e && !g_errors && s == want;
    if (!e && s != want) logf_("mismatch tick %llu sum %llu want %llu", tick, s, want);
    logf_("tick %llu counter %u ok %d", tick, c, ok);
    sleep_until(&next, interval_ms);
  }
}

static int parent(const Args &a, const char *self) {
  open_log(a.dir, "producer.log");
  logf_("platform %s mode %s mib %zu", platform(), a.mode ? "pidfd" : "scm", a.mib);
  if (dev_init()) die("device init failed");
  size_t size = 0;
  mem_handle h{};
  devptr p = 0;
  if (alloc_exportable(a.mib << 20, &size, &h, &p)) die("the exportable allocation failed");
  size_t n = size / 4;
  fill(p, n);
  u64 s0 = 0;
  checksum(p, n, &s0);
  logf_("ready size %zu sum %llu want %llu", size, s0, expected_sum(n));
  if (s0 != expected_sum(n)) die("the fill does not check");
  int fd = -1;
  if (export_fd(h, &fd)) die("export failed");
  fcntl(fd, F_SETFD, FD_CLOEXEC);  // not inherited by the child: it gets it over the socket
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) die("socketpair: %s", strerror(errno));
  char mode[8], mib[32], iv[32], sock[16], dir[4096];
  snprintf(mode, sizeof mode, "%s", a.mode ? "pidfd" : "scm");
  snprintf(mib, sizeof mib, "%zu", a.mib);
  snprintf(iv, sizeof iv, "%d", a.interval_ms);
  snprintf(sock, sizeof sock, "%d", sv[1]);
  snprintf(dir, sizeof dir, "%s", a.dir);
  char *argv[] = {(char *)self, (char *)"child", (char *)"--mode", mode, (char *)"--mib", mib,
                  (char *)"--interval-ms", iv, (char *)"--sock", sock, (char *)"--dir", dir, NULL};
  fflush(stdout);
  pid_t child = fork();
  if (child < 0) die("fork: %s", strerror(errno));
  if (child == 0) {
    // only exec here: CUDA is not fork-safe
    fcntl(sv[1], F_SETFD, 0);
    execv("/proc/self/exe", argv);
    _exit(127);
  }
  close(sv[1]);
  logf_("pid %d consumer %d", (int)getpid(), (int)child);
  set_timeout(sv[0], 120);
  Msg m;
  memset(&m, 0, sizeof m);
  memcpy(m.magic, "shpair1", 8);
  m.mode = a.mode;
  m.parent_pid = getpid();
  m.remote_fd = fd;
  m.size = size;
  if (send_msg(sv[0], &m, a.mode == 0 ? fd : -1) != 0) logf_("share-failed send: %s", strerror(errno));
  char ack = 0;
  ssize_t r;
  do r = read(sv[0], &ack, 1); while (r < 0 && errno == EINTR);
  int kept = 1;
  if (r == 1 && ack == 'K') {
    if (a.mode == 0 && !a.keep_fd) {
      close(fd);
      kept = 0;
    }
    logf_("shared mode %s fd_kept %d child_import ok", mode, kept);
  } else {
    logf_("share-failed: the child's answer %d (%c): %s", (int)r, r == 1 ? ack : '-',
          r < 0 ? strerror(errno) : "no ack");
  }
  close(sv[0]);
  tick_loop(p, n, 0, a.interval_ms);
  return 0;
}

static int child(const Args &a) {
  open_log(a.dir, "consumer.log");
  logf_("pid %d", (int)getpid());
  if (a.sock < 0) die("--sock missing");
  set_timeout(a.sock, 120);
  char nak = 'E';
  if (dev_init()) {
    ssize_t w = write(a.sock, &nak, 1);
    (void)w;
    die("device init failed");
  }
  Msg m;
  int fd = -1;
  if (recv_msg(a.sock, &m, &fd) != 0) die("no share message from the parent");
  if (m.mode == 1) {
    int pfd = (int)syscall(SYS_pidfd_open, m.parent_pid, 0);
    if (pfd < 0) {
      ssize_t w = write(a.sock, &nak, 1);
      (void)w;
      die("share-failed pidfd_open(%d): %s", m.parent_pid, strerror(errno));
    }
    fd = (int)syscall(SYS_pidfd_getfd, pfd, m.remote_fd, 0);
    int err = errno;
    close(pfd);
    if (fd < 0) {
      ssize_t w = write(a.sock, &nak, 1);
      (void)w;
      die("share-failed pidfd_getfd(%d, fd %d): %s", m.parent_pid, m.remote_fd, strerror(err));
    }
    logf_("pidfd_getfd: fd %d of pid %d is fd %d here", m.remote_fd, m.parent_pid, fd);
  } else if (fd < 0) {
    ssize_t w = write(a.sock, &nak, 1);
    (void)w;
    die("share-failed: no fd in the SCM_RIGHTS message");
  } else {
    logf_("SCM_RIGHTS: received fd %d", fd);
  }
  devptr p = 0;
  if (import_map(fd, (size_t)m.size, &p)) {
    ssize_t w = write(a.sock, &nak, 1);
    (void)w;
    die("share-failed: the import failed");
  }
  close(fd);  // the mapping holds the memory
  char ack = 'K';
  ssize_t w = write(a.sock, &ack, 1);
  (void)w;
  close(a.sock);
  logf_("imported size %llu mode %s fd closed", m.size, m.mode ? "pidfd" : "scm");
  tick_loop(p, (size_t)m.size / 4, 1, a.interval_ms);
  return 0;
}

int main(int argc, char **argv) {
  signal(SIGPIPE, SIG_IGN);
  Args a;
  if (argc < 2) {
    fprintf(stderr, "usage: %s parent|child --dir DIR [--mode scm|pidfd] [--mib N] "
                    "[--interval-ms MS] [--keep-fd]\n", argv[0]);
    return 2;
  }
  a.role = argv[1];
  for (int i = 2; i < argc; i++) {
    const char *k = argv[i];
    const char *v = i + 1 < argc ? argv[i + 1] : nullptr;
    if (!strcmp(k, "--keep-fd")) {
      a.keep_fd = 1;
      continue;
    }
    if (!v) {
      fprintf(stderr, "%s needs a value\n", k);
      return 2;
    }
    i++;
    if (!strcmp(k, "--dir")) a.dir = v;
    else if (!strcmp(k, "--mode")) {
      if (!strcmp(v, "scm")) a.mode = 0;
      else if (!strcmp(v, "pidfd")) a.mode = 1;
      else {
        fprintf(stderr, "--mode scm|pidfd, not %s\n", v);
        return 2;
      }
    } else if (!strcmp(k, "--mib")) a.mib = strtoull(v, nullptr, 10);
    else if (!strcmp(k, "--interval-ms")) a.interval_ms = atoi(v);
    else if (!strcmp(k, "--sock")) a.sock = atoi(v);
    else {
      fprintf(stderr, "unknown argument %s\n", k);
      return 2;
    }
  }
  if (!a.dir || a.mib == 0 || a.interval_ms <= 0) {
    fprintf(stderr, "--dir is needed; --mib and --interval-ms must be positive\n");
    return 2;
  }
  if (!strcmp(a.role, "parent")) return parent(a, argv[0]);
  if (!strcmp(a.role, "child")) return child(a);
  fprintf(stderr, "role must be parent or child, not %s\n", a.role);
  return 2;
}
