// Store and load (what the handlers call), setup and teardown, and the process-wide engine.
// The other parts of the engine are listed in ssdtrain/engine.h.
#include "ssdtrain/engine.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>

namespace ssdtrain {

Status Engine::Create(const Config& cfg, std::shared_ptr<Engine>* out) {
  std::shared_ptr<Engine> e(new Engine());
  Status s = e->Init(cfg);
  if (!s.ok()) return s;
  *out = std::move(e);
  return Status::Ok();
}

Status Engine::Init(const Config& cfg) {
  cfg_ = cfg;
  std::random_device rd;
  salt_ = (static_cast<uint32_t>(rd()) ^ static_cast<uint32_t>(getpid() * 2654435761u)) | 1u;
  next_id_ = 1 + (rd() % 1024);
  SSD_RETURN_IF_ERROR(cache_.Init(cfg.host_cache_bytes, "host_cache_bytes"));
  SSD_RETURN_IF_ERROR(tier_.Init(cfg.host_tier_bytes, "host_tier_bytes"));
  SSD_RETURN_IF_ERROR(FaultSpec::Parse(getenv("SSDTRAIN_FAULT"), &fault_));
  SSD_RETURN_IF_ERROR(space_.Open(cfg));
#ifdef SSDTRAIN_HAVE_KVIKIO
  if (cfg.gds != 0) {
    std::string why;
    backend_ = MakeKvikioBackend(space_.files(), cfg.gds, space_.o_direct(), cfg.io_threads, &why);
    if (backend_) {
      gds_active = backend_->gds();
      // Without GPUDirect (compat mode) kvikio puts a second thread pool in front of the same
      // pread/pwrite: on the H100's store it read at 0.79-0.86x raw O_DIRECT where the POSIX
      // backend read at 0.97-1.02x. Auto keeps it for GDS only.
      if (!gds_active && cfg.gds == 2) backend_.reset();
    } else if (cfg.gds == 1) {
      fprintf(stderr, "ssdtrain: kvikio backend unavailable (%s); using POSIX I/O\n", why.c_str());
    }
  }
#endif
  if (!backend_) backend_ = MakePosixBackend(space_.files(), &fault_);
  if (cfg.bandwidth_cap)
    backend_ = MakeThrottledBackend(std::move(backend_), cfg.bandwidth_cap, &throttle_);
  pool_ = std::make_unique<ThreadPool>(cfg.io_threads);
  return Status::Ok();
}

Engine::~Engine() {
  ReleaseAll();
  pool_.reset();  // joins the I/O threads
  hooks_.reset();
  backend_.reset();
  space_.Close();
  cache_.Destroy();
  tier_.Destroy();
}

Status Engine::TakePendingError() {
  if (pending_error_.ok()) return Status::Ok();
  Status s = pending_error_;
  pending_error_ = Status();
  return s.With("an earlier asynchronous ssdtrain I/O failed");
}

Status Engine::BeginStore(int64_t site, Tier tier, uint64_t nbytes, std::string_view name,
                          EntryPtr* out, int device, int64_t uses) {
  if (tier != Tier::kNvme && tier != Tier::kHost)
    return Status(EINVAL, "store of tag '" + std::string(name) + "': invalid tier " +
                              std::to_string(static_cast<int32_t>(tier)) + " (0 = nvme, 1 = host)");
  if (uses == 0)
    return Status(EINVAL, "store of tag '" + std::string(name) +
                              "': uses=0 keeps nothing "
                              "(write the null handle instead)");
  Lock lk(mu);
  SSD_RETURN_IF_ERROR(TakePendingError());
  if (hooks_) hooks_->ReclaimReleases(false);
  auto e = std::make_shared<Entry>();
  e->uses_left = uses == Entry::kManual ? Entry::kManual : uses < 0 ? Entry::kUncounted : uses;
  e->id = next_id_++;
  if (next_id_ == 0) next_id_ = 1;
  e->site = site;
  e->device = device;
  e->tier = tier;
  e->nbytes = nbytes;
  e->padded = RoundUp(nbytes, kAlign);
  e->seq = next_seq_++;
  e->name = std::string(name);
  if (nbytes == 0) {
    e->host_valid = true;
  } else if (tier == Tier::kHost) {
    uint64_t off;
    bool got = AllocHost(Arena::kHostTier, e->padded, &off);
    if (!got && hooks_) {  // entries whose last load's copy is still running hold room
      hooks_->ReclaimReleases(true);
      got = AllocHost(Arena::kHostTier, e->padded, &off);
    }
    if (!got) {
      return Status(ENOMEM, "host tier full: " + std::to_string(e->padded) + " bytes requested, " +
                                std::to_string(tier_.alloc.free_bytes()) +
                                " free (host_tier_bytes=" + std::to_string(cfg_.host_tier_bytes) +
                                ") storing tag '" + e->name + "'");
    }
    e->host_arena = Arena::kHostTier;
    e->host_off = off;
    e->host_ptr = tier_.base + off;
  } else {
    uint64_t off;
    Status full;
    bool got_slot = space_.Alloc(e->device, e->padded, &off);
    if (!got_slot && hooks_) {
      hooks_->ReclaimReleases(true);
      got_slot = space_.Alloc(e->device, e->padded, &off);
    }
    if (!got_slot) {
      const RangeAllocator& group = space_.Group(e->device);
      full =
          Status(ENOSPC, "No space left in the ssdtrain store for tag '" + e->name +
                             "': " + std::to_string(e->padded) + " bytes requested, " +
                             std::to_string(group.free_bytes()) + " free (largest extent " +
                             std::to_string(group.largest_free()) +
                             ", capacity_bytes=" + std::to_string(cfg_.capacity_bytes) +
                             (space_.groups() > 1
                                  ? ", split over " + std::to_string(space_.groups()) + " devices"
                                  : "") +
                             ")");
    } else {
      Status s = space_.Reserve(off, e->padded);
      if (!s.ok()) {
        space_.Free(off, e->padded);
        full = s.With("storing tag '" + e->name + "'");
      }
    }
    if (full.ok()) {
      e->has_slot = true;
      e->file_off = off;
      Status a = AcquireCacheBuffer(lk, *e, true);
      if (!a.ok()) {
        space_.Free(off, e->padded);
        return a;
      }
    } else {
      bool fs_full = full.code() == ENOSPC || full.code() == EDQUOT || full.code() == EFBIG;
      if (cfg_.on_full != 1 || !fs_full) return full;
      // on_full=keep: hold the tensor in the host tier instead (never overwrites live data).
      if (!AllocHost(Arena::kHostTier, e->padded, &off))
        return Status(ENOSPC, full.message() +
                                  "; on_full=keep: the host tier has no room "
                                  "either (" +
                                  std::to_string(tier_.alloc.free_bytes()) +
                                  " bytes free, host_tier_bytes=" +
                                  std::to_string(cfg_.host_tier_bytes) + ")");
      e->tier = Tier::kHost;
      e->kept_full = true;
      e->host_arena = Arena::kHostTier;
      e->host_off = off;
      e->host_ptr = tier_.base + off;
      stats.full_kept_tensors++;
      stats.full_kept_bytes += nbytes;
      if (!warned_full_) {
        warned_full_ = true;
        fprintf(stderr,
                "ssdtrain: store full (capacity_bytes=%llu); on_full=keep: keeping tag '%s' "
                "and later overflow in host memory (host tier)\n",
                static_cast<unsigned long long>(cfg_.capacity_bytes), e->name.c_str());
      }
    }
  }
  entries_[e->id] = e;
  by_site_[{device, site}].insert(e->id);
  if (e->uses_left == Entry::kUncounted) {
    uncounted_since_sweep_++;
    uncounted_bytes_since_sweep_ += nbytes;
  }
  unloaded_[e->seq] = e;  // every tier: the LIFO read-ahead into device staging uses it
  stats.bytes_written += nbytes;
  stats.tensors_written++;
  DeviceStats& ds = device_stats_[device];
  ds.bytes_written += nbytes;
  ds.tensors_written++;
  *out = e;
  return Status::Ok();
}

Status Engine::CommitStore(const EntryPtr& e) {
  Lock lk(mu);
  e->filling = false;
  e->host_valid = true;
  e->host_from_store = true;
  if (e->released) {
    MaybeFree(e);
    return Status::Ok();
  }
  if (e->tier == Tier::kNvme && e->nbytes > 0) EnqueueWrite(e);
  cv.notify_all();
  return Status::Ok();
}

Status Engine::WriteThrough(const EntryPtr& e,
                            const std::function<Status(void*, uint64_t, uint64_t)>& fill) {
  const uint64_t window =
      std::min<uint64_t>(e->padded, std::max<uint64_t>(cfg_.chunk_bytes * 8, 64 * kMiB));
  void* raw = nullptr;
  if (posix_memalign(&raw, kAlign, window) != 0)
    return Status(
        ENOMEM, "allocating a " + HumanBytes(window) + " bounce buffer for tag '" + e->name + "'");
  char* bounce = static_cast<char*>(raw);
  auto t0 = Clock::now();
  Status s;
  uint32_t crc = 0;
  for (uint64_t off = 0; off < e->nbytes && s.ok(); off += window) {
    uint64_t len = std::min(window, e->nbytes - off);
    s = fill(bounce, off, len);
    if (!s.ok()) break;
    if (cfg_.verify) crc = Crc32c(crc, bounce, len);
    uint64_t plen = RoundUp(len, kAlign);
    if (plen > len) memset(bounce + len, 0, plen - len);
    s = SyncIo(true, bounce, e->file_off + off, plen);
  }
  free(bounce);
  Lock lk(mu);
  stats.stall_seconds += Seconds(t0, Clock::now());
  stats.bounce_writes++;
  e->filling = false;
  if (!s.ok()) {
    Release(e);
    return s.With("synchronous write of " + DescribeTag(e->name, e->site, e->id));
  }
  e->w = WState::kDone;
  if (cfg_.verify) {
    e->crc = crc;
    e->crc_set = true;
  }
  stats.disk_bytes_written += e->nbytes;
  stats.disk_tensors_written++;
  MaybeFree(e);
  cv.notify_all();
  return Status::Ok();
}

void Engine::AbortStore(const EntryPtr& e) {
  Lock lk(mu);
  e->filling = false;
  Release(e);
}

Status Engine::StoreFromHost(const void* src, uint64_t nbytes, int64_t site, Tier tier,
                             std::string_view name, uint32_t handle[2], int device, int64_t uses) {
  if (uses == 0) {
    CountUnusedStore(nbytes, device);
    MakeNullHandle(handle);
    return Status::Ok();
  }
  EntryPtr e;
  SSD_RETURN_IF_ERROR(BeginStore(site, tier, nbytes, name, &e, device, uses));
  MakeHandle(*e, handle);
  if (nbytes == 0 || e->host_ptr) {
    if (nbytes) {
      memcpy(e->host_ptr, src, nbytes);
      if (e->padded > nbytes) memset(e->host_ptr + nbytes, 0, e->padded - nbytes);
      if (cfg_.verify && e->tier == Tier::kNvme) {
        e->crc = Crc32c(0, e->host_ptr, nbytes);
        e->crc_set = true;
      }
    }
    return CommitStore(e);
  }
  return WriteThrough(e, [src](void* dst, uint64_t off, uint64_t len) {
    memcpy(dst, static_cast<const char*>(src) + off, len);
    return Status::Ok();
  });
}

Status Engine::AcquireHost(Lock& lk, const EntryPtr& e, HostRef* ref) {
  ref->e = e;
  if (e->nbytes == 0) return Status::Ok();
  auto t0 = Clock::now();
  bool missed = false;
  for (;;) {
    if (e->reading || e->filling) {
      auto w0 = Clock::now();
      while (e->reading || e->filling) cv.wait(lk);
      stats.stall_seconds += Seconds(w0, Clock::now());
    }
    if (!e->error.ok()) return e->error.With("load of " + DescribeTag(e->name, e->site, e->id));
    if (!cfg_.forwarding && e->tier == Tier::kNvme && e->host_from_store &&
        (e->w == WState::kQueued || e->w == WState::kRunning)) {
      auto w0 = Clock::now();  // the write drops the store's copy (FinishWrite)
      cv.wait(lk, [&] { return e->w != WState::kQueued && e->w != WState::kRunning; });
      stats.stall_seconds += Seconds(w0, Clock::now());
      continue;
    }
    if (e->host_ptr && e->host_valid) {
      if (e->tier == Tier::kNvme && !missed) {
        if (e->host_from_store) {
          stats.forwarded_tensors++;
          stats.forwarded_bytes += e->nbytes;
        } else {
          stats.prefetch_hits++;
        }
      }
      ConsumeRead(*e);
      e->pins++;
      ref->pinned = true;
      ref->ptr = e->host_ptr;
      return Status::Ok();
    }
    if (e->w != WState::kDone)
      return Status(EIO, "load of " + DescribeTag(e->name, e->site, e->id) +
                             ": no copy of the data is available (write state " +
                             std::to_string(static_cast<int>(e->w)) + ")");
    if (!missed) {
      missed = true;
      stats.prefetch_misses++;
      t0 = Clock::now();
    }
    if (!e->host_ptr) {
      SSD_RETURN_IF_ERROR(AcquireCacheBuffer(lk, *e, true));
      if (e->reading || e->filling || e->host_valid) continue;  // raced with read-ahead
    }
    if (!e->host_ptr) break;  // no room: bounce below
    StartRead(e, true);
    auto w0 = Clock::now();
    while (e->reading) cv.wait(lk);
    stats.stall_seconds += Seconds(w0, Clock::now());
    if (!e->r_status.ok()) return e->r_status;
  }
  // Larger than the cache, or no room: read through a private bounce buffer.
  void* raw = nullptr;
  if (posix_memalign(&raw, kAlign, e->padded) != 0)
    return Status(ENOMEM, "allocating a " + HumanBytes(e->padded) + " bounce buffer to load " +
                              DescribeTag(e->name, e->site, e->id));
  e->pins++;  // keeps the file slot alive
  ref->pinned = true;
  stats.bounce_reads++;
  lk.unlock();
  Status s = SyncIo(false, static_cast<char*>(raw), e->file_off, e->padded);
  Status c = s.ok() ? CheckCrc(*e, static_cast<char*>(raw)) : Status();
  lk.lock();
  if (!c.ok()) {
    stats.checksum_failures++;
    s = c;
  }
  stats.stall_seconds += Seconds(t0, Clock::now());
  (void)t0;
  if (!s.ok()) {
    free(raw);
    return c.ok() ? s.With("load of " + DescribeTag(e->name, e->site, e->id)) : s;
  }
  stats.disk_bytes_read += e->nbytes;
  stats.disk_tensors_read++;
  stats.disk_loaded_bytes += e->nbytes;
  ref->bounce = static_cast<char*>(raw);
  ref->ptr = ref->bounce;
  return Status::Ok();
}

void Engine::ConsumeRead(Entry& e) {
  if (!e.unconsumed_read) return;
  e.unconsumed_read = false;
  stats.disk_loaded_bytes += e.nbytes;
}

void Engine::ReleaseHost(Lock& lk, HostRef* ref) {
  if (ref->bounce) {
    free(ref->bounce);
    ref->bounce = nullptr;
  }
  if (ref->pinned) {
    ref->e->pins--;
    ref->pinned = false;
    MaybeFree(ref->e);
    cv.notify_all();
  }
  ref->ptr = nullptr;
}

Status Engine::LoadToHost(const uint32_t handle[2], void* dst, uint64_t nbytes, int64_t site,
                          std::string_view name, int device) {
  Lock lk(mu);
  SSD_RETURN_IF_ERROR(TakePendingError());
  EntryPtr e;
  SSD_RETURN_IF_ERROR(LookupForLoad(lk, handle, nbytes, site, name, &e, device));
  e->loading++;
  HostRef ref;
  Status s = AcquireHost(lk, e, &ref);
  if (!s.ok()) {
    e->loading--;
    ReleaseHost(lk, &ref);
    return s;
  }
  if (nbytes) {
    lk.unlock();
    if (hooks_ && e->dev && !ref.bounce) s = hooks_->WaitHostReady(*e);
    if (s.ok()) memcpy(dst, ref.ptr, nbytes);
    lk.lock();
  }
  e->loading--;
  ReleaseHost(lk, &ref);
  if (s.ok()) CountLoad(e);
  SchedulePrefetch(lk, device);
  return s;
}

Status Engine::DebugTruncate(uint64_t size) {
  Lock lk(mu);
  return space_.DebugTruncate(size);
}

Status Engine::DebugCorrupt(uint64_t loff) {
  Lock lk(mu);
  return space_.DebugCorrupt(loff);
}

std::string Engine::FilePaths() {
  Lock lk(mu);
  return space_.Paths();
}

// ---------------------------------------------------------------------------
// Process-wide engine
// ---------------------------------------------------------------------------
namespace {
std::mutex g_engine_mu;
std::shared_ptr<Engine> g_engine;
}  // namespace

std::shared_ptr<Engine> CurrentEngine(Status* st) {
  std::lock_guard<std::mutex> g(g_engine_mu);
  if (!g_engine) {
    Status s = Engine::Create(Config::Defaults(), &g_engine);
    if (!s.ok()) {
      *st = s.With("creating the default ssdtrain engine (call configure() first)");
      return nullptr;
    }
  }
  *st = Status::Ok();
  return g_engine;
}

// Used by c_api.cc.
Status ReplaceEngine(const Config* cfg) {
  std::shared_ptr<Engine> old;
  {
    std::lock_guard<std::mutex> g(g_engine_mu);
    old = std::move(g_engine);
    g_engine.reset();
  }
  if (old) {
    old->ReleaseAll();
    old.reset();  // destroyed here unless a handler still holds it
  }
  if (!cfg) return Status::Ok();
  std::shared_ptr<Engine> fresh;
  SSD_RETURN_IF_ERROR(Engine::Create(*cfg, &fresh));
  std::lock_guard<std::mutex> g(g_engine_mu);
  g_engine = std::move(fresh);
  return Status::Ok();
}

std::shared_ptr<Engine> PeekEngine() {
  std::lock_guard<std::mutex> g(g_engine_mu);
  return g_engine;
}

}  // namespace ssdtrain
