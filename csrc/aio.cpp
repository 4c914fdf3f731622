// Asynchronous file I/O for NVMe offload: a pool of worker threads running
// pread/pwrite on file descriptors the caller opened (hybrid/kernels/aio.py).
//
//   pool = Pool(threads, max_chunk)
//   id = pool.submit(write, fd, tensor, tensor.data_ptr(), nbytes, file_offset)
//   err, done = pool.wait(id)          // blocks, with the GIL released
//
// One NVMe drive reaches its bandwidth only with several requests in flight,
// and one blocking pread of a whole tensor keeps one in flight. So a request is
// cut into chunks that are queued for all the threads: one large swap of an
// optimizer state uses every thread, and many small ones overlap.
//
// Chunk boundaries are multiples of 4096 bytes from the start of the request:
// a request that is aligned for O_DIRECT stays aligned in every chunk (the
// Python side decides which descriptor, direct or buffered, a request uses).
//
// wait() reports (errno, bytes transferred): errno is the first error any
// chunk met (0 if none) and "transferred" is the length of the prefix of the
// request that completed, so a read that met the end of the file tells the
// caller where the file ends (a truncated swap file) instead of handing back
// a buffer with a stale tail. Plain threads and pread/pwrite only: no
// io_uring or libaio, which are not on every machine this builds on.
//
// Only pybind11, no ATen: the pool needs a pointer and a reference that keeps
// its tensor alive, not tensor operations, and the ATen headers doubled the
// one-time build (36 s against 18 s on 2 cores).

#include <pybind11/pybind11.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <vector>

#include <unistd.h>

namespace py = pybind11;

namespace {

constexpr int64_t kGranule = 4096;        // O_DIRECT alignment kept by every chunk
constexpr int64_t kMinChunk = 256 << 10;  // below this, splitting costs more than it overlaps

struct Request {
  // The tensor whose memory `base` points into, held while threads use it: the
  // caller may drop its reference before wait() and the memory must not be
  // freed under a pread. Only touched with the GIL held (submit, wait, ~Pool).
  py::object keep;
  char* base = nullptr;
  int64_t nbytes = 0;
  int64_t offset = 0;
  int fd = -1;
  bool write = false;
  // Guarded by Pool::mu_.
  int pending = 0;
  int err = 0;
  int64_t end = 0;  // the lowest file offset a chunk stopped short at (EOF or error)
};

struct Chunk {
  std::shared_ptr<Request> req;
  int64_t lo, hi;  // byte range within the request
};

// Transfer [lo, hi) of the request. Returns (errno or 0, bytes done from lo).
// pread/pwrite may move fewer bytes than asked (signals, pipes, the end of a
// device) and may be interrupted before moving any (EINTR): both only mean
// "go on". A read of 0 bytes is the end of the file; a write of 0 bytes makes
// no progress and would loop forever, so it is reported as EIO.
std::pair<int, int64_t> transfer(const Request& r, int64_t lo, int64_t hi) {
  int64_t done = lo;
  while (done < hi) {
    char* p = r.base + done;
    size_t len = static_cast<size_t>(hi - done);
    off_t at = static_cast<off_t>(r.offset + done);
    ssize_t n = r.write ? ::pwrite(r.fd, p, len, at) : ::pread(r.fd, p, len, at);
    if (n < 0) {
      if (errno == EINTR) continue;
      return {errno, done - lo};
    }
    if (n == 0) return {r.write ? EIO : 0, done - lo};
    done += n;
  }
  return {0, done - lo};
}

class Pool {
 public:
  Pool(int threads, int64_t max_chunk) : max_chunk_(max_chunk) {
    if (threads < 1) throw std::invalid_argument("aio: threads must be >= 1");
    if (max_chunk < kGranule || max_chunk % kGranule != 0)
      throw std::invalid_argument("aio: max_chunk must be a positive multiple of 4096");
    for (int i = 0; i < threads; ++i) workers_.emplace_back([this] { run(); });
  }

  ~Pool() { shutdown(); }

  // `keep` owns the `nbytes` of host memory at `ptr` (the caller checks that).
  int64_t submit(bool write, int64_t fd, py::object keep, uintptr_t ptr, int64_t nbytes,
                 int64_t offset) {
    if (nbytes < 0 || offset < 0) throw std::invalid_argument("aio: negative size or offset");
    if (nbytes > 0 && ptr == 0) throw std::invalid_argument("aio: null buffer");
    auto req = std::make_shared<Request>();
    req->keep = std::move(keep);
    req->base = reinterpret_cast<char*>(ptr);
    req->nbytes = nbytes;
    req->offset = offset;
    req->fd = static_cast<int>(fd);
    req->write = write;
    req->end = offset + nbytes;

    const int64_t chunk = chunk_bytes(nbytes);
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) throw std::runtime_error("aio: submit after shutdown()");
    const int64_t id = next_id_++;
    for (int64_t lo = 0; lo < nbytes; lo += chunk) {
      queue_.push_back({req, lo, std::min(nbytes, lo + chunk)});
      ++req->pending;
    }
    requests_[id] = req;
    work_.notify_all();
    return id;
  }

  // (errno, bytes of the request's prefix transferred). Each id is waited once.
  // Called with the GIL, which it gives up only while blocked.
  std::tuple<int64_t, int64_t> wait(int64_t id) {
    std::shared_ptr<Request> req;
    {
      py::gil_scoped_release nogil;
      std::unique_lock<std::mutex> lock(mu_);
      auto it = requests_.find(id);
      if (it == requests_.end())
        throw std::invalid_argument("aio: unknown or already waited request id " +
                                    std::to_string(id));
      req = it->second;
      done_.wait(lock, [&] { return req->pending == 0; });
      requests_.erase(it);
    }
    // The tensor is released here, with the GIL: a worker may hold the last
    // reference to the Request, never to a Python object.
    req->keep = py::object();
    return {req->err, req->end - req->offset};
  }

  // Finish everything queued, then stop the threads. Idempotent.
  void shutdown() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_) return;
      stopping_ = true;
      work_.notify_all();
    }
    for (auto& t : workers_) t.join();
    workers_.clear();
  }

  int threads() const { return static_cast<int>(workers_.size()); }

 private:
  // Enough chunks to give every thread a share, none larger than max_chunk_
  // nor, for large requests, smaller than kMinChunk; always a granule multiple.
  int64_t chunk_bytes(int64_t nbytes) const {
    const int64_t n = static_cast<int64_t>(workers_.size());
    int64_t share = (nbytes + n - 1) / n;
    share = (share + kGranule - 1) / kGranule * kGranule;
    return std::max(kGranule, std::min(max_chunk_, std::max(share, kMinChunk)));
  }

  void run() {
    for (;;) {
      Chunk c;
      {
        std::unique_lock<std::mutex> lock(mu_);
        work_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopping, and nothing left to do
        c = std::move(queue_.front());
        queue_.pop_front();
      }
      auto [err, got] = transfer(*c.req, c.lo, c.hi);
      std::lock_guard<std::mutex> lock(mu_);
      Request& r = *c.req;
      if (err != 0 && r.err == 0) r.err = err;
      if (c.lo + got < c.hi) r.end = std::min(r.end, r.offset + c.lo + got);
      if (--r.pending == 0) done_.notify_all();
    }
  }

  const int64_t max_chunk_;
  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable work_, done_;
  std::deque<Chunk> queue_;
  std::unordered_map<int64_t, std::shared_ptr<Request>> requests_;
  int64_t next_id_ = 1;
  bool stopping_ = false;
};

}  // namespace

// Registered into hybrid_cpu_ops by csrc/cpu_adam.cpp's module: one build for the
// host tiers' two jobs (hybrid/kernels/cpu_ops.py).
void register_aio(py::module_& mod) {
  // submit() only queues; wait() and shutdown() block, so they release the GIL
  // and the Python threads (the training loop) run while the disk works.
  py::class_<Pool>(mod, "Pool")
      .def(py::init<int, int64_t>(), py::arg("threads"), py::arg("max_chunk"))
      .def("submit", &Pool::submit, "queue a read or write; returns its id",
           py::arg("write"), py::arg("fd"), py::arg("keep"), py::arg("ptr"), py::arg("nbytes"),
           py::arg("offset"))
      .def("wait", &Pool::wait, "(errno, bytes transferred) of a request", py::arg("id"))
      .def("shutdown", &Pool::shutdown, "finish queued requests and stop the threads",
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("threads", &Pool::threads);
}
