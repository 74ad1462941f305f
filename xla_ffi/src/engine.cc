// Store and load (what the handlers call), setup and teardown, and the process-wide engine.
// The other parts of the engine are listed in engine.h.
#include "engine.h"

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
      gds_active_ = backend_->gds();
      // Without GPUDirect (compat mode) kvikio puts a second thread pool in front of the same
      // pread/pwrite: on the H100's store it read at 0.79-0.86x raw O_DIRECT where the POSIX
      // backend read at 0.97-1.02x. Auto keeps it for GDS only.
      if (!gds_active_ && cfg.gds == 2) backend_.reset();
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
                          EntryPtr* out, int device, int64_t uses, int64_t run_id, int64_t pass,
                          int pass_dir) {
  if (tier != Tier::kNvme && tier != Tier::kHost && tier != Tier::kHostThenNvme)
    return Status(EINVAL, "store of tag '" + std::string(name) + "': invalid tier " +
                              std::to_string(static_cast<int32_t>(tier)) +
                              " (0 = nvme, 1 = host, 2 = host, spilling to nvme)");
  if (uses == 0)
    return Status(EINVAL, "store of tag '" + std::string(name) +
                              "': uses=0 keeps nothing "
                              "(write the null handle instead)");
  Lock lk(mu_);
  SSD_RETURN_IF_ERROR(TakePendingError());
  if (hooks_) hooks_->ReclaimReleases(false);
  auto e = std::make_shared<Entry>();
  e->uses_left_ = uses == Entry::kManual ? Entry::kManual : uses < 0 ? Entry::kUncounted : uses;
  e->id_ = next_id_++;
  if (next_id_ == 0) next_id_ = 1;
  e->site_ = site;
  e->device_ = device;
  e->run_id_ = run_id;
  e->pass_ = pass;
  e->pass_dir_ = pass_dir;
  e->tier_ = tier;
  e->nbytes_ = nbytes;
  e->padded_ = RoundUp(nbytes, kAlign);
  e->seq_ = next_seq_++;
  e->name_ = std::string(name);
  bool in_host_tier = false;
  uint64_t host_off = 0;
  if (nbytes > 0 && tier != Tier::kNvme) {
    in_host_tier = AllocHost(Arena::kHostTier, e->padded_, &host_off);
    if (!in_host_tier && hooks_) {  // entries whose last load's copy is still running hold room
      hooks_->ReclaimReleases(true);
      SSD_RETURN_IF_ERROR(TakePendingError());  // a wait that failed
      in_host_tier = AllocHost(Arena::kHostTier, e->padded_, &host_off);
    }
    while (!in_host_tier && ReleaseOldestRetired())  // then entries a background sweep retired
      in_host_tier = AllocHost(Arena::kHostTier, e->padded_, &host_off);
    if (tier == Tier::kHostThenNvme) {  // the entry's tier is where it went
      e->tier_ = in_host_tier ? Tier::kHost : Tier::kNvme;
      if (!in_host_tier) {
        stats_.spilled_tensors++;
        stats_.spilled_bytes += nbytes;
        if (tier_.alloc.free_bytes() >= e->padded_) NoteFragmentedSpill(*e);
      }
    }
  }
  if (nbytes == 0) {
    e->tier_ = tier == Tier::kHostThenNvme ? Tier::kHost : tier;
    e->host_ = HostCopy::kStored;  // nothing to copy (no buffer either)
  } else if (e->tier_ == Tier::kHost) {
    uint64_t off = host_off;
    if (!in_host_tier) {
      return Status(ENOMEM,
                    "host tier full: " + std::to_string(e->padded_) + " bytes requested, " +
                        std::to_string(tier_.alloc.free_bytes()) + " free (largest extent " +
                        std::to_string(tier_.alloc.largest_free()) + ", host_tier_bytes=" +
                        std::to_string(cfg_.host_tier_bytes) + ") storing tag '" + e->name_ + "'");
    }
    e->host_arena_ = Arena::kHostTier;
    e->host_off_ = off;
    e->host_ptr_ = tier_.base + off;
  } else {
    uint64_t off;
    Status full;
    bool got_slot = space_.Alloc(e->device_, e->padded_, &off);
    if (!got_slot && hooks_) {
      hooks_->ReclaimReleases(true);
      SSD_RETURN_IF_ERROR(TakePendingError());
      got_slot = space_.Alloc(e->device_, e->padded_, &off);
    }
    // Then retired entries, oldest first; a released one whose write is still running gives
    // its room back when the write ends.
    while (!got_slot && (ReleaseOldestRetired() || WaitForReleasedRoom(lk)))
      got_slot = space_.Alloc(e->device_, e->padded_, &off);
    if (!got_slot) {
      const RangeAllocator& group = space_.Group(e->device_);
      full =
          Status(ENOSPC, "No space left in the ssdtrain store for tag '" + e->name_ +
                             "': " + std::to_string(e->padded_) + " bytes requested, " +
                             std::to_string(group.free_bytes()) + " free (largest extent " +
                             std::to_string(group.largest_free()) +
                             ", capacity_bytes=" + std::to_string(cfg_.capacity_bytes) +
                             (space_.groups() > 1
                                  ? ", split over " + std::to_string(space_.groups()) + " devices"
                                  : "") +
                             ")" + SpilledFrom(tier));
    } else {
      Status s = space_.Reserve(off, e->padded_);
      if (!s.ok()) {
        space_.Free(off, e->padded_);
        full = s.With("storing tag '" + e->name_ + "'");
      }
    }
    if (full.ok()) {
      e->has_slot_ = true;
      e->file_off_ = off;
      Status a = AcquireCacheBuffer(lk, *e, true);
      if (!a.ok()) {
        space_.Free(off, e->padded_);
        return a;
      }
    } else {
      bool fs_full = full.code() == ENOSPC || full.code() == EDQUOT || full.code() == EFBIG;
      if (cfg_.on_full != 1 || !fs_full) return full;
      // on_full=keep: hold the tensor in the host tier instead (never overwrites live data).
      if (!AllocHost(Arena::kHostTier, e->padded_, &off))
        return Status(ENOSPC, full.message() +
                                  "; on_full=keep: the host tier has no room "
                                  "either (" +
                                  std::to_string(tier_.alloc.free_bytes()) +
                                  " bytes free, host_tier_bytes=" +
                                  std::to_string(cfg_.host_tier_bytes) + ")");
      e->tier_ = Tier::kHost;
      e->kept_full_ = true;
      e->host_arena_ = Arena::kHostTier;
      e->host_off_ = off;
      e->host_ptr_ = tier_.base + off;
      stats_.full_kept_tensors++;
      stats_.full_kept_bytes += nbytes;
      if (!warned_full_) {
        warned_full_ = true;
        fprintf(stderr,
                "ssdtrain: store full (capacity_bytes=%llu); on_full=keep: keeping tag '%s' "
                "and later overflow in host memory (host tier)\n",
                static_cast<unsigned long long>(cfg_.capacity_bytes), e->name_.c_str());
      }
    }
  }
  entries_[e->id_] = e;
  by_site_[{device, site}].insert(e->id_);
  if (e->uses_left_ == Entry::kUncounted) {
    uncounted_since_sweep_++;
    uncounted_bytes_since_sweep_ += nbytes;
  }
  unloaded_[e->seq_] = e;  // every tier: the LIFO read-ahead into device staging uses it
  stats_.bytes_written += nbytes;
  stats_.tensors_written++;
  DeviceStats& ds = device_stats_[device];
  ds.bytes_written += nbytes;
  ds.tensors_written++;
  *out = e;
  return Status::Ok();
}

// A "host,nvme" store that went to the files although the host tier had its bytes free, in
// extents too small: counted, and said once per configuration (the store's room is not what
// host_tier_bytes suggests).
void Engine::NoteFragmentedSpill(const Entry& e) {
  stats_.fragmented_spills++;
  stats_.fragmented_spill_bytes += e.nbytes_;
  if (warned_fragmented_) return;
  warned_fragmented_ = true;
  fprintf(stderr,
          "ssdtrain: tag '%s' (%llu bytes) spilled to the files although the host tier has "
          "%llu bytes free: its largest free extent is %llu (fragmentation: an entry takes one "
          "extent). Leave the host tier a margin of a few of the largest entries; the "
          "statistics fragmented_spills and host_tier_largest_free count it\n",
          e.name_.c_str(), static_cast<unsigned long long>(e.padded_),
          static_cast<unsigned long long>(tier_.alloc.free_bytes()),
          static_cast<unsigned long long>(tier_.alloc.largest_free()));
}

// The host tier's room, for the message of a "host,nvme" store the files could not take either:
// an entry needs one extent of either tier, so free room in extents too small does not count.
std::string Engine::SpilledFrom(Tier tier) const {
  if (tier != Tier::kHostThenNvme) return "";
  return "; spilled from the host tier, which has " + std::to_string(tier_.alloc.free_bytes()) +
         " bytes free, largest extent " + std::to_string(tier_.alloc.largest_free()) +
         " (host_tier_bytes=" + std::to_string(cfg_.host_tier_bytes) + ")";
}

Status Engine::CommitStore(const EntryPtr& e) {
  Lock lk(mu_);
  e->EndFilling();
  e->host_ = HostCopy::kStored;
  if (e->released()) {
    MaybeFree(e);
    return Status::Ok();
  }
  if (e->tier_ == Tier::kNvme && e->nbytes_ > 0) EnqueueWrite(e);
  cv_.notify_all();
  return Status::Ok();
}

Status Engine::WriteThrough(const EntryPtr& e,
                            const std::function<Status(void*, uint64_t, uint64_t)>& fill) {
  const uint64_t window =
      std::min<uint64_t>(e->padded_, std::max<uint64_t>(cfg_.chunk_bytes * 8, 64 * kMiB));
  void* raw = nullptr;
  if (posix_memalign(&raw, kAlign, window) != 0)
    return Status(
        ENOMEM, "allocating a " + HumanBytes(window) + " bounce buffer for tag '" + e->name_ + "'");
  char* bounce = static_cast<char*>(raw);
  auto t0 = Clock::now();
  Status s;
  uint32_t crc = 0;
  for (uint64_t off = 0; off < e->nbytes_ && s.ok(); off += window) {
    uint64_t len = std::min(window, e->nbytes_ - off);
    s = fill(bounce, off, len);
    if (!s.ok()) break;
    if (cfg_.verify) crc = Crc32c(crc, bounce, len);
    uint64_t plen = RoundUp(len, kAlign);
    if (plen > len) memset(bounce + len, 0, plen - len);
    s = SyncIo(true, bounce, e->file_off_ + off, plen);
  }
  free(bounce);
  Lock lk(mu_);
  stats_.stall_seconds += Seconds(t0, Clock::now());
  stats_.bounce_writes++;
  e->EndFilling();
  if (!s.ok()) {
    Release(e);
    return s.With("synchronous write of " + DescribeTag(e->name_, e->site_, e->id_));
  }
  e->w_ = WState::kDone;
  if (cfg_.verify) {
    e->crc_ = crc;
    e->crc_set_ = true;
  }
  stats_.disk_bytes_written += e->nbytes_;
  stats_.disk_tensors_written++;
  MaybeFree(e);
  cv_.notify_all();
  return Status::Ok();
}

void Engine::AbortStore(const EntryPtr& e) {
  Lock lk(mu_);
  e->EndFilling();
  Release(e);
}

Status Engine::StoreFromHost(const void* src, uint64_t nbytes, int64_t site, Tier tier,
                             std::string_view name, uint32_t handle[2], int device, int64_t uses,
                             int64_t run_id, int64_t pass, int pass_dir) {
  if (uses == 0) {
    CountUnusedStore(nbytes, device);
    MakeNullHandle(handle);
    return Status::Ok();
  }
  EntryPtr e;
  SSD_RETURN_IF_ERROR(
      BeginStore(site, tier, nbytes, name, &e, device, uses, run_id, pass, pass_dir));
  MakeHandle(*e, handle);
  if (nbytes == 0 || e->host_ptr_) {
    if (nbytes) {
      memcpy(e->host_ptr_, src, nbytes);
      e->ZeroHostPadding();
      if (cfg_.verify && e->tier_ == Tier::kNvme) {
        e->crc_ = Crc32c(0, e->host_ptr_, nbytes);
        e->crc_set_ = true;
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
  if (e->nbytes_ == 0) return Status::Ok();
  auto t0 = Clock::now();
  bool missed = false;
  for (;;) {
    if (e->reading() || e->filling()) {
      auto w0 = Clock::now();
      while (e->reading() || e->filling()) cv_.wait(lk);
      stats_.stall_seconds += Seconds(w0, Clock::now());
    }
    if (!e->error_.ok())
      return e->error_.With("load of " + DescribeTag(e->name_, e->site_, e->id_));
    if (!cfg_.forwarding && e->tier_ == Tier::kNvme && e->host_from_store() &&
        (e->w_ == WState::kQueued || e->w_ == WState::kRunning)) {
      auto w0 = Clock::now();  // the write drops the store's copy (FinishWrite)
      cv_.wait(lk, [&] { return e->w_ != WState::kQueued && e->w_ != WState::kRunning; });
      stats_.stall_seconds += Seconds(w0, Clock::now());
      continue;
    }
    if (e->host_ptr_ && e->host_valid()) {
      if (e->tier_ == Tier::kNvme && !missed) {
        if (e->host_from_store()) {
          stats_.forwarded_tensors++;
          stats_.forwarded_bytes += e->nbytes_;
        } else {
          stats_.prefetch_hits++;
        }
      }
      ConsumeRead(*e);
      e->pins_++;
      ref->pinned = true;
      ref->ptr = e->host_ptr_;
      return Status::Ok();
    }
    if (e->w_ != WState::kDone)
      return Status(EIO, "load of " + DescribeTag(e->name_, e->site_, e->id_) +
                             ": no copy of the data is available (write state " +
                             std::to_string(static_cast<int>(e->w_)) + ")");
    if (!missed) {
      missed = true;
      stats_.prefetch_misses++;
      t0 = Clock::now();
    }
    if (!e->host_ptr_) {
      SSD_RETURN_IF_ERROR(AcquireCacheBuffer(lk, *e, true));
      if (e->reading() || e->filling() || e->host_valid()) continue;  // raced with read-ahead
    }
    if (!e->host_ptr_) break;  // no room: bounce below
    StartRead(e, true);
    auto w0 = Clock::now();
    while (e->reading()) cv_.wait(lk);
    stats_.stall_seconds += Seconds(w0, Clock::now());
    if (!e->r_status_.ok()) return e->r_status_;
  }
  // Larger than the cache, or no room: read through a private bounce buffer.
  void* raw = nullptr;
  if (posix_memalign(&raw, kAlign, e->padded_) != 0)
    return Status(ENOMEM, "allocating a " + HumanBytes(e->padded_) + " bounce buffer to load " +
                              DescribeTag(e->name_, e->site_, e->id_));
  e->pins_++;  // keeps the file slot alive
  ref->pinned = true;
  stats_.bounce_reads++;
  lk.unlock();
  Status s = SyncIo(false, static_cast<char*>(raw), e->file_off_, e->padded_);
  Status c = s.ok() ? CheckCrc(*e, static_cast<char*>(raw)) : Status();
  lk.lock();
  if (!c.ok()) {
    stats_.checksum_failures++;
    s = c;
  }
  stats_.stall_seconds += Seconds(t0, Clock::now());
  (void)t0;
  if (!s.ok()) {
    free(raw);
    return c.ok() ? s.With("load of " + DescribeTag(e->name_, e->site_, e->id_)) : s;
  }
  stats_.disk_bytes_read += e->nbytes_;
  stats_.disk_tensors_read++;
  stats_.disk_loaded_bytes += e->nbytes_;
  ref->bounce = static_cast<char*>(raw);
  ref->ptr = ref->bounce;
  return Status::Ok();
}

void Engine::ConsumeRead(Entry& e) {
  if (e.host_ != HostCopy::kRead) return;
  e.host_ = HostCopy::kReadTaken;
  stats_.disk_loaded_bytes += e.nbytes_;
}

void Engine::ReleaseHost(Lock& lk, HostRef* ref) {
  if (ref->bounce) {
    free(ref->bounce);
    ref->bounce = nullptr;
  }
  if (ref->pinned) {
    ref->e->pins_--;
    ref->pinned = false;
    MaybeFree(ref->e);
    cv_.notify_all();
  }
  ref->ptr = nullptr;
}

Status Engine::LoadToHost(const uint32_t handle[2], void* dst, uint64_t nbytes, int64_t site,
                          std::string_view name, int device, bool consume, LoadOrder order,
                          int64_t run_id, int64_t pass, int pass_dir) {
  Lock lk(mu_);
  SSD_RETURN_IF_ERROR(TakePendingError());
  const bool stream = order == LoadOrder::kStream;
  uint32_t predicted[2] = {0, 0};
  uint64_t left = 0;
  const bool guessed = stream
                           ? PredictStreamLoad(site, pass, run_id, device, nbytes, predicted, &left)
                           : order == LoadOrder::kStoreOrder &&
                                 PredictOrderedLoad(site, run_id, device, nbytes, predicted, &left);
  EntryPtr e;
  SSD_RETURN_IF_ERROR(LookupForLoad(lk, handle, nbytes, site, name, &e, device, consume));
  if (guessed) {
    if (predicted[0] == handle[0] && predicted[1] == handle[1])
      stats_.speculative_loads++;
    else
      stats_.handle_mismatches++;
  }
  if (stream)
    NoteStreamLoad(run_id, device, pass, pass_dir, *e);
  else if (order != LoadOrder::kActivation)
    NoteExactLoad(run_id, device, *e);
  e->loading_++;
  HostRef ref;
  Status s = AcquireHost(lk, e, &ref);
  if (!s.ok()) {
    e->loading_--;
    ReleaseHost(lk, &ref);
    return s;
  }
  if (nbytes) {
    lk.unlock();
    if (hooks_ && e->dev_ && !ref.bounce) s = hooks_->WaitHostReady(*e);
    if (s.ok()) memcpy(dst, ref.ptr, nbytes);
    lk.lock();
  }
  e->loading_--;
  ReleaseHost(lk, &ref);
  if (s.ok()) CountLoad(e);
  SchedulePrefetch(lk, device, order != LoadOrder::kActivation ? e.get() : nullptr, stream);
  return s;
}

Status Engine::GrowStaging(uint64_t bytes) {
  Lock lk(mu_);
  if (bytes <= cfg_.staging_bytes) return Status::Ok();
  if (hooks_) SSD_RETURN_IF_ERROR(hooks_->GrowStaging(bytes));
  cfg_.staging_bytes = bytes;  // the GPUs not used yet allocate this with their first store
  return Status::Ok();
}

Status Engine::DebugTruncate(uint64_t size) {
  Lock lk(mu_);
  return space_.DebugTruncate(size);
}

Status Engine::DebugCorrupt(uint64_t loff) {
  Lock lk(mu_);
  return space_.DebugCorrupt(loff);
}

std::string Engine::FilePaths() {
  Lock lk(mu_);
  return space_.Paths();
}

// ---------------------------------------------------------------------------
// Process-wide engine
// ---------------------------------------------------------------------------
namespace {
std::mutex g_engine_mu;
std::shared_ptr<Engine> g_engine;
// Why there is no engine (the error a handler gets): an engine is only ever created from a
// configuration Python sends, never with defaults of its own.
const char* g_no_engine =
    "no store is configured in this process: call jax_ssdtrain.configure(...) first";
// The salts of the engines ReplaceEngine replaced (the newest kMaxReplaced): a load of a handle
// one of them made is told its store was replaced, not that the handle is corrupted.
// Its own mutex: an engine's loads ask it under their engine's lock.
constexpr size_t kMaxReplaced = 1024;
std::mutex g_replaced_mu;
std::vector<uint32_t> g_replaced_salts;
}  // namespace

bool FromReplacedStore(const uint32_t h[2]) {
  std::lock_guard<std::mutex> g(g_replaced_mu);
  for (uint32_t salt : g_replaced_salts)
    if (HandleCheckWithSalt(h[0], salt) == h[1]) return true;
  return false;
}

std::shared_ptr<Engine> CurrentEngine(Status* st) {
  std::lock_guard<std::mutex> g(g_engine_mu);
  if (!g_engine) {
    *st = Status(EINVAL, g_no_engine);
    return nullptr;
  }
  *st = Status::Ok();
  return g_engine;
}

Status ReplaceEngine(const Config* cfg) {
  std::shared_ptr<Engine> old;
  {
    std::lock_guard<std::mutex> g(g_engine_mu);
    old = std::move(g_engine);
    g_engine.reset();
    if (old) {
      std::lock_guard<std::mutex> r(g_replaced_mu);
      if (g_replaced_salts.size() == kMaxReplaced) g_replaced_salts.erase(g_replaced_salts.begin());
      g_replaced_salts.push_back(old->salt());
    }
    if (!cfg)
      g_no_engine =
          "the store was shut down (jax_ssdtrain.shutdown(), or the end of a "
          "jax_ssdtrain.configured(...) block) before this program ran; call "
          "jax_ssdtrain.configure(...) to open a store again";
  }
  if (old) {
    old->ReleaseAll();
    old.reset();  // destroyed here unless a handler still holds it
  }
  if (!cfg) return Status::Ok();
  std::shared_ptr<Engine> fresh;
  Status s = Engine::Create(*cfg, &fresh);
  std::lock_guard<std::mutex> g(g_engine_mu);
  if (!s.ok()) {
    g_no_engine =
        "the store's last configuration failed (jax_ssdtrain.configure raised): call "
        "jax_ssdtrain.configure(...) again";
    return s;
  }
  g_engine = std::move(fresh);
  return Status::Ok();
}

std::shared_ptr<Engine> PeekEngine() {
  std::lock_guard<std::mutex> g(g_engine_mu);
  return g_engine;
}

}  // namespace ssdtrain
